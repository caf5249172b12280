"""vLLM's paged KV cache as Engram reads and writes it: one layer's cache tensor seen as K and V pages, a load
that leaves the blocks vLLM computed itself alone, and a request's KV gathered out of its blocks.

vLLM hands the connector one tensor per layer (register_kv_caches). Two layouts are known, told apart by shape:

- (num_blocks, H, block_size, 2 * D): vLLM's standardized per-layer view (0.3x: `create_kv_cache_views`, "[B,
  H, N, C]"), K in the first D channels of each row and V in the last D, any strides;
- (2, num_blocks, block_size, H, D): FlashAttention's layout in earlier vLLM releases.

Either way the pages come out as (num_pages, page_tokens, H, D) views, so writes through them land in vLLM's
cache. A page may be smaller than vLLM's block (kernel blocks): block id b is then pages b * r ... b * r + r - 1.

An MLA model's cache holds one latent entry a token (kv_lora_rank + rope dims: 576 for DeepSeek-V2/V3, no K/V
split): (num_blocks, 1, block_size, 576) in the standardized view (one "head"), (num_blocks, block_size, 576) in
earlier releases. Its pages are (num_pages, page_tokens, 576) views, Engram's "latent" stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from engram.destinations import KVDestination, PagedKV, PagedStreamsKV, check_fits
from engram.errors import InvalidArgument
from engram.layout import KVLayout, StreamSpec

Split = Callable[[Tensor, int], tuple[Tensor, Tensor]]


def _standardized(cache: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    rows = cache.transpose(1, 2)  # (B, N, H, 2D)
    return rows[..., :head_dim], rows[..., head_dim:]


def _flash_attn_v0(cache: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    return cache[0], cache[1]


# (name, does this shape match, split): first match wins.
_LAYOUTS: tuple[tuple[str, Callable[[tuple[int, ...], int, int], bool], Split], ...] = (
    ("(num_blocks, kv_heads, block_size, 2 * head_dim)",
     lambda s, h, d: len(s) == 4 and s[1] == h and s[3] == 2 * d, _standardized),
    ("(2, num_blocks, block_size, kv_heads, head_dim)",
     lambda s, h, d: len(s) == 5 and s[0] == 2 and s[3:] == (h, d), _flash_attn_v0),
)


def kv_pages(cache: Tensor, num_kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """One layer's K and V pages, (num_pages, page_tokens, H, D) views of vLLM's cache tensor."""
    shape = tuple(cache.shape)
    for _, matches, split in _LAYOUTS:
        if matches(shape, num_kv_heads, head_dim):
            return split(cache, head_dim)
    raise InvalidArgument(f"a vLLM KV cache of shape {shape} is in no layout Engram knows for {num_kv_heads} KV heads "
                          f"of dim {head_dim}: {[name for name, _, _ in _LAYOUTS]}")


def latent_pages(cache: Tensor, width: int) -> Tensor:
    """One MLA layer's latent pages, a (num_pages, page_tokens, width) view of vLLM's cache tensor."""
    shape = tuple(cache.shape)
    if len(shape) == 4 and shape[1] == 1 and shape[3] == width:  # [B, H=1, N, C]
        return cache[:, 0]
    if len(shape) == 3 and shape[2] == width:
        return cache
    raise InvalidArgument(f"a vLLM MLA cache of shape {shape} is in no layout Engram knows for a {width}-wide latent: "
                          f"['(num_blocks, 1, block_size, {width})', '(num_blocks, block_size, {width})']")


def page_table(block_ids: Sequence[int], pages_per_block: int) -> Tensor:
    """vLLM block ids -> the pages holding them, in token order."""
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
    return (ids[:, None] * pages_per_block + torch.arange(pages_per_block)).reshape(-1)


class FromToken:
    """A PagedKV that writes only tokens from `first` on: the blocks before it are vLLM's own prefix-cache hits,
    possibly shared with running requests, and a lossy codec's values must not replace theirs."""

    def __init__(self, inner: PagedKV | PagedStreamsKV, first: int) -> None:
        if first % inner.page_tokens:
            raise InvalidArgument(f"a load starts on a page boundary ({inner.page_tokens} tokens), not at {first}")
        self.inner = inner
        self.first = first

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def capacity_tokens(self) -> int:
        return self.inner.capacity_tokens

    def fits(self, layout: KVLayout) -> None:
        check_fits(self.inner, layout)

    def write(self, stream: int, data: Tensor, start: int, n_tokens: int) -> None:
        if start + n_tokens <= self.first:
            return
        if start >= self.first:
            self.inner.write(stream, data, start, n_tokens)
            return
        # The run straddles `first`: its tokens from there on, as one "block" of that many tokens.
        blocks, layers, bt = data.shape[:3]
        cut = self.first - start
        entry = data.shape[3:]  # (H, D), or a stream's entry shape
        rest = data.transpose(0, 1).reshape(layers, blocks * bt, *entry)[:, cut:n_tokens]  # (L, n - cut, *entry)
        self.inner.write(stream, rest.unsqueeze(0), self.first, n_tokens - cut)


def gather(pages: Tensor, table: Tensor, n_tokens: int, out: Tensor) -> None:
    """Copy a request's first n_tokens out of `pages` (num_pages, page_tokens, *entry) into out (n_tokens,
    *entry): K or V (H, D), or an MLA latent (576,)."""
    pt = pages.shape[1]
    used = table[: -(-n_tokens // pt)].to(pages.device)
    out.copy_(pages.index_select(0, used).flatten(0, 1)[:n_tokens])


def as_destination(pages: list[list[Tensor]], table: Tensor, first: int,
                   streams: Sequence[StreamSpec] = ()) -> KVDestination:
    """The request's pages as a load's destination: K and V pages (pages = [k, v]) for a K/V layout, or one list
    of per-layer pages per stream of a stream layout (an MLA model's latent)."""
    paged: PagedKV | PagedStreamsKV
    if streams:
        paged = PagedStreamsKV(streams, {s.name: p for s, p in zip(streams, pages, strict=True)}, table)
    else:
        paged = PagedKV(pages[0], pages[1], table)
    return paged if first == 0 else FromToken(paged, first)
