"""One Triton launch that writes a run of loaded entries into every layer's paged KV cache.

The torch path (engram.destinations._write_pages) costs, per layer and stream, a copy of the layer's slice out of
the run and an index_copy_ into the pages: for a 32K-token prefix of a 32-layer model, staged in 64 MiB runs,
about 8,000 small launches, and the host issues them more slowly than the copy engine brings the data in (the
vLLM connector's 32K load took twice the contiguous hit path's time on the same H100). Here one launch per run
and stream copies every layer: a program moves a tile of entries of one layer, through the block table, from
the run straight into the pages.

A worker's layers are separate tensors (vLLM allocates one cache per layer), so the kernel gets the first
layer's pages and, per layer, the element offset of its pages from the first's (an int64 table on the device):
every layer's pages must have the same shape, strides and dtype, which `layer_offsets` checks. Entries are
(outer, inner) elements ((kv_heads, head_dim) of K or V, any strides: vLLM's standardized view interleaves K and
V in a row) or one vector (an MLA latent: outer = 1).

Tensors on the CPU run through Triton's interpreter when TRITON_INTERPRET=1 was set before this module was first
imported (the tests); the daemon's clients call it for CUDA tensors only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from engram.errors import InvalidArgument

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TILE_ELEMENTS = 8192  # elements a program moves: entries per program = this // the padded entry size
NUM_WARPS = 4


@triton.jit
def _scatter_entries(src, dst, layer_off, table, n, first_page, per_block, pt, outer, inner,
                     s_block, s_layer, s_entry, s_outer, s_inner, d_page, d_row, d_outer, d_inner,
                     ENTRIES: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
    """Entries [tile * ENTRIES, +ENTRIES) of one layer (program_id 1): entry t of the run is entry t % per_block
    of the run's block t // per_block, and lands in row t % pt of page table[first_page + t // pt]."""
    layer = tl.program_id(1)
    t = tl.program_id(0).to(tl.int64) * ENTRIES + tl.arange(0, ENTRIES).to(tl.int64)
    o = tl.arange(0, BLOCK_O)
    i = tl.arange(0, BLOCK_I)
    live = t < n
    page = tl.load(table + first_page + t // pt, mask=live, other=0)
    src_entry = (t // per_block) * s_block + layer.to(tl.int64) * s_layer + (t % per_block) * s_entry
    dst_entry = tl.load(layer_off + layer) + page * d_page + (t % pt) * d_row
    src_elem = o[:, None] * s_outer + i[None, :] * s_inner  # (BLOCK_O, BLOCK_I)
    dst_elem = o[:, None] * d_outer + i[None, :] * d_inner
    mask = live[:, None, None] & (o < outer)[None, :, None] & (i < inner)[None, None, :]
    x = tl.load(src + src_entry[:, None, None] + src_elem[None, :, :], mask=mask)
    tl.store(dst + dst_entry[:, None, None] + dst_elem[None, :, :], x, mask=mask)


INTERPRETED = isinstance(_scatter_entries, InterpretedFunction)


def _entry_dims(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, int, int, int] | None:
    """An entry's (outer, inner, outer stride, inner stride), or None for a shape the kernel does not take."""
    if len(shape) == 1:
        return 1, int(shape[0]), 0, int(strides[0])
    if len(shape) == 2:
        return int(shape[0]), int(shape[1]), int(strides[0]), int(strides[1])
    return None


def layer_offsets(layers: Sequence[Tensor]) -> Tensor | None:
    """Each layer's pages as an element offset from the first layer's (int64, on their device), or None where
    the kernel cannot write them (layers of different shapes, strides, dtypes or devices; an unsupported dtype
    or entry shape; a CPU tensor outside the interpreter)."""
    first = layers[0]
    if first.dtype not in DTYPES or first.dim() not in (3, 4) or (first.device.type != "cuda" and not INTERPRETED):
        return None
    size = first.element_size()
    offsets = []
    for t in layers:
        if (t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype
                or t.device != first.device):
            return None
        delta = t.data_ptr() - first.data_ptr()
        if delta % size:
            return None
        offsets.append(delta // size)
    return torch.tensor(offsets, dtype=torch.int64, device=first.device)


def write_pages(layers: Sequence[Tensor], offsets: Tensor, table: Tensor, pt: int, data: Tensor, start: int,
                n_tokens: int) -> bool:
    """Entries [start, start + n_tokens) of data (blocks, L, per_block, *entry) into every layer's pages
    (num_pages, pt, *entry) through the block table, in one launch on the current stream. `offsets` is
    layer_offsets(layers). False, having written nothing, where the run is not one the kernel takes (another
    dtype than the pages', an entry of 3 dimensions); the caller then takes the torch path."""
    blocks, n_layers, per_block = (int(d) for d in data.shape[:3])
    pages = layers[0]
    if data.dtype != pages.dtype or data.device != pages.device or tuple(data.shape[3:]) != tuple(pages.shape[2:]):
        return False
    src = _entry_dims(data.shape[3:], data.stride()[3:])
    dst = _entry_dims(pages.shape[2:], pages.stride()[2:])
    if src is None or dst is None:
        return False
    if n_layers != len(layers) or offsets.numel() != n_layers:
        raise InvalidArgument(f"the run holds {n_layers} layers; the destination has {len(layers)}")
    if start % pt:
        raise InvalidArgument(f"page_tokens={pt} must divide the model's block_tokens (a run starts at {start})")
    if not 0 <= n_tokens <= blocks * per_block:
        raise InvalidArgument(f"a run of {blocks * per_block} entries cannot supply {n_tokens}")
    first = start // pt
    if first + -(-n_tokens // pt) > table.numel():
        raise InvalidArgument(f"entries up to {start + n_tokens} need {first + -(-n_tokens // pt)} pages; the block "
                              f"table has {table.numel()}")
    if n_tokens == 0:
        return True
    outer, inner, s_outer, s_inner = src
    _, _, d_outer, d_inner = dst
    block_o = triton.next_power_of_2(outer)
    block_i = triton.next_power_of_2(inner)
    entries = max(1, min(triton.next_power_of_2(n_tokens), TILE_ELEMENTS // (block_o * block_i)))
    s_block, s_layer, s_entry = data.stride()[:3]
    d_page, d_row = pages.stride()[:2]
    grid = (triton.cdiv(n_tokens, entries), n_layers)
    with torch.cuda.device(pages.device) if pages.is_cuda else contextlib.nullcontext():  # launch on the pages' GPU
        _scatter_entries[grid](data, pages, offsets, table, n_tokens, first, per_block, pt, outer, inner,
                               s_block, s_layer, s_entry, s_outer, s_inner, d_page, d_row, d_outer, d_inner,
                               ENTRIES=entries, BLOCK_O=block_o, BLOCK_I=block_i, num_warps=NUM_WARPS)
    return True
