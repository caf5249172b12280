"""Where a worker wants a cached prefix's KV: its own KV memory, in the layout its attention reads.

The hit path (engram/loader.py) decodes a run of blocks at a time into each stream of the layout (the K/V
layout's: K and V of shape (blocks, L, block_tokens, H, D), L the model's persisted layers; a stream layout's:
(blocks, L, entries per block, *entry shape)) and hands each to the destination, which writes it in place with as
few copies as its layout allows. Five layouts cover the serving stacks:

- `ContiguousKV`: one tensor (L, 2, T, H, D), any strides: what `EngramClient.get_prefix` returns, and a worker
  that keeps its KV as one buffer. One strided copy per stream per run of blocks.
- `LayerKV`: one K and one V tensor per layer, each (T, H, D) with any strides: Hugging Face's DynamicCache
  keeps (batch, H, T, D) per layer, whose [0].transpose(0, 1) is such a view. One copy per layer and stream.
- `PagedKV`: per layer K and V pages (num_pages, page_tokens, H, D) and a block table mapping the request's
  logical pages to physical ones, as vLLM's paged KV cache (page_tokens must divide block_tokens). On a GPU one
  Triton launch per run and stream writes every layer (engram/kernels/paged.py); elsewhere, or with
  ENGRAM_PAGED_KERNEL=0, one index_copy_ per layer and stream.
- `PagedStreamsKV`: a stream layout's streams in paged caches, per stream and layer pages (num_pages,
  page_tokens, *shape) and a block table: vLLM's MLA cache (one latent a token). Written as PagedKV's pages.
- `StreamsKV`: a stream layout's streams, one tensor (L, entries, *shape) each, any strides: what get_prefix
  returns for a stream layout, and a worker that keeps a stream in one buffer (the transformers integration's
  MLA latent). One strided copy per stream per run of blocks.

A destination holds the layout's dtype (a load does not convert: another dtype is refused), and a block table
names each physical page once. `check_fits` refuses one the model's KV does not fit (dtype, per-token shape,
layers, pages that do not tile a block) before a load asks the daemon, so that a misconfigured worker hears of
it on a miss too, not only once something was cached; each write checks again (a loader used on its own).

Writes run on the caller's current CUDA stream, so the worker's own kernels that read the KV afterwards are
ordered after them without a host synchronisation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor

from engram.errors import InvalidArgument
from engram.kernels import triton_available
from engram.layout import KVLayout, StreamSpec

# Paged caches on a GPU are written by the Triton kernel (engram/kernels/paged.py). ENGRAM_PAGED_KERNEL=0 keeps
# them on the torch path: for comparisons (benchmarks/paged_write.py does it in-process), or as a way around the
# kernel should it misbehave on some GPU.
PAGED_KERNEL = os.environ.get("ENGRAM_PAGED_KERNEL", "1") != "0"


class KVDestination(Protocol):
    @property
    def device(self) -> torch.device: ...

    @property
    def capacity_tokens(self) -> int:
        """Tokens it can hold: a load writes at most this many."""
        ...

    def write(self, stream: int, data: Tensor, start: int, n_tokens: int) -> None:
        """Write entries [start, start + n_tokens) of stream `stream` of the layout (the K/V layout: 0 K, 1 V).
        data: (blocks, L, entries per block, *entry shape) ((blocks, L, block_tokens, H, D) for K and V),
        covering start onward; only its first n_tokens entries (in block order) are written. An entry is a token
        except in a compressed stream (engram.layout.StreamSpec.compress)."""
        ...


def check_fits(dest: KVDestination, layout: KVLayout) -> None:
    """Refuse a destination the layout's KV does not fit, before a load (InvalidArgument, as its write would
    raise). A destination of the worker's own making, without a `fits` method, is left to its writes."""
    fits = getattr(dest, "fits", None)
    if fits is not None:
        fits(layout)


def _check_dtype(have: torch.dtype, data: Tensor | torch.dtype) -> None:
    """A load writes the layout's dtype as it is: a copy_ into another would cast it silently (an integer
    destination truncates the KV) or fail in torch (index_copy_), so a destination of another dtype is refused."""
    want = data if isinstance(data, torch.dtype) else data.dtype
    if have != want:
        raise InvalidArgument(f"the model's KV is {want}; the destination is {have}: allocate it as {want} "
                              "(a load does not convert)")


def _kv_of(layout: KVLayout) -> tuple[int, int, int, torch.dtype]:
    """(persisted layers, kv_heads, head_dim, dtype) of the KV a K and V destination receives; a stream layout
    other than K and V alike is refused (its streams go into StreamsKV or PagedStreamsKV)."""
    specs = layout.stream_specs
    if len(specs) != 2 or len({(s.shape, s.dtype, s.compress) for s in specs}) != 1 or len(specs[0].shape) != 2 \
            or specs[0].compress != 1:
        raise InvalidArgument(f"the model's blocks hold the streams {[s.name for s in specs]}, not K and V: load them "
                              "into StreamsKV or PagedStreamsKV")
    heads, dim = specs[0].shape
    return layout.persisted_layers, heads, dim, specs[0].dtype.torch_dtype


def _check_distinct(places: Sequence[tuple[str, Tensor]]) -> None:
    """Each place a load writes is a tensor of its own: one tensor given for two (PagedKV(k, k, table): K and V)
    was accepted, and a load wrote one over the other (V read back as K). Views of one buffer that share no
    element (vLLM's K and V, cache[0] and cache[1]) are two places; only the same view given twice is refused."""
    seen: dict[tuple[object, ...], str] = {}
    for name, t in places:
        if t.device.type == "meta" or not t.numel():  # no memory to share (meta: refused at the load)
            continue
        key = (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if key in seen:
            raise InvalidArgument(f"{seen[key]} and {name} are one tensor: a load would write one over the other; "
                                  "give each its own")
        seen[key] = name


def _check_layers(want: int, have: int) -> None:
    if want != have:
        raise InvalidArgument(f"the model stores {want} layers; the destination has {have}")


def _check_streams(have: Sequence[StreamSpec], layout: KVLayout) -> None:
    """A stream destination's streams (what its tensors were checked against) are the model's, codecs aside."""
    for s, want in zip(have, layout.stream_specs, strict=False):
        if (s.name, s.shape, s.dtype, s.compress) != (want.name, want.shape, want.dtype, want.compress):
            raise InvalidArgument(f"stream {want.name}: the model's is ({', '.join(map(str, want.shape))}) "
                                  f"{want.dtype.torch_dtype} per entry, one entry per {want.compress} tokens; the "
                                  f"destination's stream {s.name} is ({', '.join(map(str, s.shape))}) "
                                  f"{s.dtype.torch_dtype}, one per {s.compress}: allocate it as the model's")
    if len(have) != len(layout.stream_specs):
        raise InvalidArgument(f"the model's blocks hold the streams {[s.name for s in layout.stream_specs]}; the "
                              f"destination has {[s.name for s in have]}")


def _tokens_major(data: Tensor, n_tokens: int) -> Tensor:
    """(blocks, L, bt, H, D) -> its first n_tokens tokens as (L, n_tokens, H, D) (a copy)."""
    blocks, layers, bt, heads, dim = data.shape
    return data.transpose(0, 1).reshape(layers, blocks * bt, heads, dim)[:, :n_tokens]


class ContiguousKV:
    """One (L, 2, T, H, D) tensor."""

    def __init__(self, kv: Tensor) -> None:
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise InvalidArgument(f"a KV destination is (layers, 2, tokens, kv_heads, head_dim), got {tuple(kv.shape)}")
        self.kv = kv

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def capacity_tokens(self) -> int:
        return int(self.kv.shape[2])

    def fits(self, layout: KVLayout) -> None:
        layers, heads, dim, dtype = _kv_of(layout)
        self._check_shape(layers, heads, dim)
        _check_dtype(self.kv.dtype, dtype)

    def _check_shape(self, layers: int, heads: int, dim: int) -> None:
        if (self.kv.shape[0], *self.kv.shape[3:]) != (layers, heads, dim):  # (.., D, H): the bytes in another order
            raise InvalidArgument(f"the model's KV is (layers, 2, tokens, kv_heads, head_dim) = ({layers}, 2, T, "
                                  f"{heads}, {dim}); the destination is {tuple(self.kv.shape)}")

    def write(self, stream: int, data: Tensor, start: int, n_tokens: int) -> None:
        blocks, layers, bt, heads, dim = data.shape
        self._check_shape(layers, heads, dim)
        _check_dtype(self.kv.dtype, data)
        target = self.kv[:, stream, start : start + n_tokens]  # (L, n, H, D)
        if n_tokens == blocks * bt:
            # (L, blocks, bt, H, D) view of the target: one copy, whatever the source's strides.
            target.view(layers, blocks, bt, heads, dim).copy_(data.transpose(0, 1))
        else:
            target.copy_(_tokens_major(data, n_tokens))


class LayerKV:
    """Per layer, a K and a V tensor (T, H, D), any strides."""

    def __init__(self, k: Sequence[Tensor], v: Sequence[Tensor]) -> None:
        if len(k) != len(v) or not k:
            raise InvalidArgument(f"LayerKV needs one K and one V tensor per layer, got {len(k)} and {len(v)}")
        shapes = {tuple(t.shape) for t in (*k, *v)}
        if len(shapes) != 1 or len(next(iter(shapes))) != 3:
            raise InvalidArgument(f"every layer's K and V must be (tokens, kv_heads, head_dim) of one shape, got {shapes}")
        self.streams = (list(k), list(v))
        _check_distinct(_places(("K", "V"), self.streams))

    @property
    def device(self) -> torch.device:
        return self.streams[0][0].device

    @property
    def capacity_tokens(self) -> int:
        return int(self.streams[0][0].shape[0])

    def fits(self, layout: KVLayout) -> None:
        layers, heads, dim, dtype = _kv_of(layout)
        self._check(layers, heads, dim, dtype)

    def _check(self, layers: int, heads: int, dim: int, dtype: torch.dtype) -> None:
        _check_layers(layers, len(self.streams[0]))
        if tuple(self.streams[0][0].shape[1:]) != (heads, dim):  # every tensor has one shape (the constructor)
            raise InvalidArgument(f"the model's K and V are (tokens, kv_heads, head_dim) = (T, {heads}, {dim}) per layer; "
                                  f"the destination's are {tuple(self.streams[0][0].shape)}")
        for target in (*self.streams[0], *self.streams[1]):
            _check_dtype(target.dtype, dtype)

    def write(self, stream: int, data: Tensor, start: int, n_tokens: int) -> None:
        blocks, layers, bt, heads, dim = data.shape
        self._check(layers, heads, dim, data.dtype)
        for layer, target in enumerate(self.streams[stream]):
            part = target[start : start + n_tokens]  # (n, H, D)
            src = data[:, layer]  # (blocks, bt, H, D)
            if n_tokens == blocks * bt:
                part.view(blocks, bt, heads, dim).copy_(src)
            else:
                part.copy_(src.reshape(blocks * bt, heads, dim)[:n_tokens])


class _Paged:
    """Per-layer pages of each stream, and the request's block table (page i of the request is table[i])."""

    streams: Sequence[Sequence[Tensor]]
    page_tokens: int
    table: Tensor
    _offsets: dict[int, Tensor | None]  # per stream: _kernel_offsets' answer

    @property
    def device(self) -> torch.device:
        return self.streams[0][0].device

    @property
    def capacity_tokens(self) -> int:
        return int(self.table.numel()) * self.page_tokens

    def _fits_pages(self, layout: KVLayout, entries: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Each stream's per-layer pages against the model's (entry shape, dtype) of that stream, and pages that
        tile a block (a run of blocks starts on a page)."""
        _check_layers(layout.persisted_layers, len(self.streams[0]))
        for layers, (shape, dtype) in zip(self.streams, entries, strict=True):
            for pages in layers:
                if tuple(pages.shape[2:]) != shape:
                    raise InvalidArgument(f"the model's pages are (pages, page_tokens, {', '.join(map(str, shape))}) "
                                          f"per layer; the destination's are {tuple(pages.shape)}")
                _check_dtype(pages.dtype, dtype)
        if layout.block_tokens % self.page_tokens:
            raise InvalidArgument(f"page_tokens={self.page_tokens} must divide the model's block_tokens "
                                  f"({layout.block_tokens})")

    def write(self, stream: int, data: Tensor, start: int, n_tokens: int) -> None:
        layers = self.streams[stream]
        for pages in layers:
            _check_dtype(pages.dtype, data)
        offsets = self._kernel_offsets(stream)
        if offsets is not None:
            from engram.kernels import paged

            if paged.write_pages(layers, offsets, self.table, self.page_tokens, data, start, n_tokens):
                return
        _write_pages(layers, self.table, self.page_tokens, data, start, n_tokens)

    def _kernel_offsets(self, stream: int) -> Tensor | None:
        """The Triton kernel's per-layer offsets for this stream's pages (engram/kernels/paged.py: one launch per
        run writes every layer), or None where the torch path writes: pages on the CPU, Triton missing, layers
        the kernel cannot address. Worked out once per stream."""
        cache = self._offsets
        if stream not in cache:
            cache[stream] = None
            if PAGED_KERNEL and self.device.type == "cuda" and triton_available():
                from engram.kernels import paged

                cache[stream] = paged.layer_offsets(self.streams[stream])
        return cache[stream]


class PagedKV(_Paged):
    """Per layer, K and V pages (num_pages, page_tokens, H, D), and the request's block table: logical page i
    of the request is physical page block_table[i]."""

    def __init__(self, k: Sequence[Tensor], v: Sequence[Tensor], block_table: Sequence[int] | Tensor) -> None:
        if len(k) != len(v) or not k:
            raise InvalidArgument(f"PagedKV needs one K and one V page tensor per layer, got {len(k)} and {len(v)}")
        shapes = {tuple(t.shape) for t in (*k, *v)}
        if len(shapes) != 1 or len(next(iter(shapes))) != 4:
            raise InvalidArgument(f"every layer's pages must be (pages, page_tokens, kv_heads, head_dim) of one shape, "
                                  f"got {shapes}")
        self.streams = (list(k), list(v))
        _check_distinct(_places(("K", "V"), self.streams))
        self.page_tokens = int(k[0].shape[1])
        self.table = _page_table(block_table, k[0])
        self._offsets = {}

    def fits(self, layout: KVLayout) -> None:
        _, heads, dim, dtype = _kv_of(layout)
        self._fits_pages(layout, [((heads, dim), dtype)] * 2)


def _places(names: Sequence[str], streams: Sequence[Sequence[Tensor]]) -> list[tuple[str, Tensor]]:
    """("K of layer 0", tensor), ...: each stream's per-layer tensors, named for _check_distinct."""
    return [(f"{name} of layer {i}", t) for name, layers in zip(names, streams, strict=True)
            for i, t in enumerate(layers)]


def _page_table(block_table: Sequence[int] | Tensor, pages: Tensor) -> Tensor:
    table = torch.as_tensor(block_table, dtype=torch.int64)
    if table.dim() != 1 or (table.numel() and (int(table.min()) < 0 or int(table.max()) >= pages.shape[0])):
        raise InvalidArgument(f"block_table must name pages in [0, {pages.shape[0]}), got {table.tolist()[:8]}...")
    ids, counts = table.unique(return_counts=True)
    if bool((counts > 1).any()):  # two logical pages on one physical page: the later write wins, the other reads wrong
        page = int(ids[counts > 1][0])
        at = (table == page).nonzero().flatten().tolist()
        raise InvalidArgument(f"block_table names page {page} more than once (logical pages {at}): each logical page "
                              "needs a physical page of its own")
    return table.to(pages.device)


def _write_pages(layers: Sequence[Tensor], table: Tensor, pt: int, data: Tensor, start: int, n_tokens: int) -> None:
    """Entries [start, start + n_tokens) of data (blocks, L, per_block, *shape) into per-layer pages (num_pages,
    pt, *shape) through the block table: one index_copy_ per layer for the whole pages, the rest row by row."""
    blocks, _, per_block = data.shape[:3]
    entry = tuple(data.shape[3:])
    if start % pt:
        raise InvalidArgument(f"page_tokens={pt} must divide the model's block_tokens (a run starts at {start})")
    whole = n_tokens // pt  # whole pages; a partial last page is written row by row
    first = start // pt
    rest = n_tokens - whole * pt
    for layer, pages in enumerate(layers):
        src = data[:, layer].reshape(blocks * per_block, *entry)
        if whole:
            pages.index_copy_(0, table[first : first + whole], src[: whole * pt].view(whole, pt, *entry))
        if rest:
            pages[int(table[first + whole]), :rest].copy_(src[whole * pt : n_tokens])


class StreamsKV:
    """A stream layout's streams (engram.layout.StreamSpec, in the layout's order), one tensor (L, entries,
    *shape) each, any strides."""

    def __init__(self, streams: Sequence[StreamSpec], tensors: Mapping[str, Tensor]) -> None:
        names = [s.name for s in streams]
        if set(tensors) != set(names):
            raise InvalidArgument(f"StreamsKV needs one tensor per stream {names}, got {sorted(tensors)}")
        self.streams = tuple(streams)
        self.tensors = [tensors[s.name] for s in self.streams]
        for s, t in zip(self.streams, self.tensors, strict=True):
            if t.dim() != 2 + len(s.shape) or tuple(t.shape[2:]) != s.shape or t.dtype != s.dtype.torch_dtype:
                raise InvalidArgument(f"stream {s.name}: a (layers, entries, {', '.join(map(str, s.shape))}) "
                                      f"{s.dtype.torch_dtype} tensor, got {tuple(t.shape)} {t.dtype}")
        devices = {t.device for t in self.tensors}
        if len(devices) != 1:
            raise InvalidArgument(f"every stream's tensor must be on one device, got {sorted(map(str, devices))}")
        _check_distinct([(f"stream {s.name}", t) for s, t in zip(self.streams, self.tensors, strict=True)])

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def capacity_tokens(self) -> int:
        # tokens whose entries fit: T tokens make T // compress entries of a compressed stream
        return min((int(t.shape[1]) + 1) * s.compress - 1 for s, t in zip(self.streams, self.tensors, strict=True))

    def fits(self, layout: KVLayout) -> None:
        _check_streams(self.streams, layout)
        for t in self.tensors:
            _check_layers(layout.persisted_layers, int(t.shape[0]))

    def write(self, stream: int, data: Tensor, start: int, n_tokens: int) -> None:
        blocks, layers, per_block = data.shape[:3]
        dest = self.tensors[stream]
        # As the other destinations' writes: a loader used without check_fits cast or broadcast into it silently
        if (int(dest.shape[0]), *dest.shape[2:]) != (layers, *data.shape[3:]):
            raise InvalidArgument(f"stream {self.streams[stream].name}: the model's is (layers, entries, "
                                  f"{', '.join(map(str, data.shape[3:]))}) with {layers} layers; the destination "
                                  f"is {tuple(dest.shape)}")
        _check_dtype(dest.dtype, data)
        target = dest[:, start : start + n_tokens]  # (L, n, *shape)
        if n_tokens == blocks * per_block:
            # (L, blocks, per_block, *shape) view of the target: one copy, whatever the source's strides.
            target.view(layers, blocks, per_block, *data.shape[3:]).copy_(data.transpose(0, 1))
        else:
            target.copy_(data.transpose(0, 1).reshape(layers, blocks * per_block, *data.shape[3:])[:, :n_tokens])


class PagedStreamsKV(_Paged):
    """A stream layout's streams in paged caches: per stream, per layer pages (num_pages, page_tokens, *shape),
    and the request's block table, as PagedKV's. vLLM's MLA cache is one such stream: a 576-wide latent a token
    (engram/integrations/vllm). Streams compressed over tokens are not paged this way (their entries are not
    the pages' tokens)."""

    def __init__(self, streams: Sequence[StreamSpec], pages: Mapping[str, Sequence[Tensor]],
                 block_table: Sequence[int] | Tensor) -> None:
        names = [s.name for s in streams]
        if set(pages) != set(names):
            raise InvalidArgument(f"PagedStreamsKV needs pages for every stream {names}, got {sorted(pages)}")
        self.specs = tuple(streams)
        self.streams = [list(pages[s.name]) for s in streams]
        first = self.streams[0][0] if self.streams[0] else None
        if first is None or first.dim() < 3:
            raise InvalidArgument("PagedStreamsKV needs per-layer pages (num_pages, page_tokens, *shape) per stream")
        self.page_tokens = int(first.shape[1])
        for s, layers in zip(streams, self.streams, strict=True):
            if s.compress != 1:
                raise InvalidArgument(f"stream {s.name} is compressed {s.compress}:1; paged caches hold one entry a "
                                      "token")
            want = (first.shape[0], self.page_tokens, *s.shape)
            bad = [tuple(t.shape) for t in layers if tuple(t.shape) != want or t.dtype != s.dtype.torch_dtype]
            if not layers or bad or len(layers) != len(self.streams[0]):
                raise InvalidArgument(f"stream {s.name}: every layer's pages must be {want} {s.dtype.torch_dtype}, "
                                      f"as many layers as the other streams; got {bad or len(layers)}")
            if {t.device for t in layers} != {first.device}:
                raise InvalidArgument(f"stream {s.name}: every stream's pages must be on one device")
        _check_distinct(_places([f"stream {s.name}" for s in streams], self.streams))
        self.table = _page_table(block_table, first)
        self._offsets = {}

    def fits(self, layout: KVLayout) -> None:
        _check_streams(self.specs, layout)
        self._fits_pages(layout, [(s.shape, s.dtype.torch_dtype) for s in self.specs])
