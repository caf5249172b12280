"""Decoding (and encoding) many stored blocks of one shape at once: the hit path's decoder, the put path's encoder.

A stored block in a quantizing codec is a v1 block (engram/codec/blockformat.py): a 56-byte header, K's
payload, V's payload. All full blocks of a model have the same shape, so the payloads of a run of blocks lie at
the same places relative to each block's start. `decode_blocks` decodes a run found at byte offsets of one
uint8 buffer (a staging buffer on the GPU, or the daemon's HBM pool opened by CUDA IPC) with one kernel launch
per payload on the Triton backend; the reference and cpu backends loop over blocks with the same numerics.

K is grouped along tokens (its matrix is (L*H*D, T)), V along head_dim ((L*T*H, D)); both come back as
(blocks, L, T, H, D) views, K's a permuted view of its matrix: writing it into the worker's KV memory is the
one copy that puts it in place (engram/destinations.py).

A stream layout's v2 block (engram/codec/streamformat.py) goes the same way stream by stream (`streams_plan`,
`decode_streams`, `encode_streams`): one launch per quantized stream per run; a raw stream is a strided view of
the staged bytes.

What it does not do: verify checksums (the daemon verified every block when it was stored; see
docs/ARCHITECTURE.md, "Integrity on the hit path"), or decode partial blocks (blockformat.decode does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engram import codec as kvcodec
from engram.codec import blockformat, streamformat
from engram.codec.base import Axis, codec_by_name
from engram.codec.fp4_reference import FORMATS, padded
from engram.errors import EngramError
from engram.layout import DType, StreamSpec


@dataclass(frozen=True)
class BlockPlan:
    """Where K's and V's payloads lie in a stored block of one codec, dtype and shape, and their matrices."""

    codec: str
    dtype: DType
    shape: tuple[int, int, int, int, int]  # (L, 2, T, H, D)
    k_at: int  # byte offset of K's payload from the block's start
    v_at: int
    k_matrix: tuple[int, int]  # (rows, cols), cols padded to the codec's group
    v_matrix: tuple[int, int]
    nbytes: int  # the whole stored block

    @property
    def tokens(self) -> int:
        return self.shape[2]


def plan(codec: str, dtype: DType, shape: tuple[int, ...]) -> BlockPlan:
    """The plan of a v1 block with the default axes (K per channel, V per token), as Engram writes them."""
    layers, two, tokens, heads, dim = shape
    if two != 2 or codec not in FORMATS:
        raise ValueError(f"a batched plan needs a (L, 2, T, H, D) block in one of {sorted(FORMATS)}, "
                         f"got {codec} {tuple(shape)}")
    fmt = FORMATS[codec]
    group = fmt.GROUP
    if tokens % group or dim % group:
        raise ValueError(f"{codec} groups of {group} do not tile tokens={tokens} and head_dim={dim} without "
                         "padding; such blocks decode one at a time")
    k_matrix = (layers * heads * dim, padded(tokens, group))
    v_matrix = (layers * tokens * heads, padded(dim, group))
    k_at = blockformat.HEADER_LEN
    v_at = k_at + fmt.payload_nbytes((k_matrix[0], tokens))
    nbytes = blockformat.encoded_nbytes(codec_by_name(codec), tuple(shape), dtype)  # type: ignore[arg-type]
    return BlockPlan(codec, dtype, tuple(shape), k_at, v_at, k_matrix, v_matrix, nbytes)  # type: ignore[arg-type]


def header_matches(plan_: BlockPlan, head: bytes | memoryview) -> bool:
    """Whether a block's 56-byte header describes a block of this plan (codec, axes, dtype, shape) and is
    itself intact (its own checksum); the body is not read."""
    try:
        fmt = blockformat.parse_header(head)
    except EngramError:
        return False
    return (fmt.codec.name == plan_.codec and fmt.k_axis == Axis.CHANNEL and fmt.v_axis == Axis.TOKEN
            and fmt.dtype == plan_.dtype and fmt.shape == plan_.shape)


def decode_blocks(src: Tensor, offsets: Tensor, plan_: BlockPlan, *, backend: str) -> tuple[Tensor, Tensor]:
    """K and V of len(offsets) blocks, each (blocks, L, T, H, D) in the plan's dtype on src's device.
    src: a flat uint8 buffer; offsets: int64 byte offsets of each block's start (on src's device for the
    Triton backend)."""
    layers, _, tokens, heads, dim = plan_.shape
    n = offsets.numel()
    dtype = plan_.dtype.torch_dtype
    k_rows, k_cols = plan_.k_matrix
    v_rows, v_cols = plan_.v_matrix
    k = torch.empty(n, k_rows, k_cols, dtype=dtype, device=src.device)
    v = torch.empty(n, v_rows, v_cols, dtype=dtype, device=src.device)
    if backend == "triton":
        from engram.kernels import fp4 as kernels

        kernels.dequantize_blocks_into(plan_.codec, src, offsets + plan_.k_at, k_rows, k_cols, k)
        kernels.dequantize_blocks_into(plan_.codec, src, offsets + plan_.v_at, v_rows, v_cols, v)
    else:
        fmt = FORMATS[plan_.codec]
        module = kvcodec._backend(backend)
        _, dequantize = module.CODECS[plan_.codec]
        into = kvcodec._strided(module)  # decodes into out[b] in place
        for b, off in enumerate(offsets.tolist()):
            for out, at, rows, real_cols in ((k, plan_.k_at, k_rows, tokens), (v, plan_.v_at, v_rows, dim)):
                start = off + at
                nbytes = fmt.payload_nbytes((rows, real_cols))
                body = memoryview(src[start : start + nbytes].cpu().numpy())  # type: ignore[arg-type]
                q = fmt.from_bytes(body, (rows, real_cols), src.device)
                if into:
                    dequantize(q, dtype, out=out[b, :, :real_cols])
                else:
                    out[b, :, :real_cols] = dequantize(q, dtype)
    k_view = k[:, :, :tokens].view(n, layers, heads, dim, tokens).permute(0, 1, 4, 2, 3)
    v_view = v[:, :, :dim].view(n, layers, tokens, heads, dim)
    return k_view, v_view


def unsealed_header(plan_: BlockPlan) -> bytes:
    """The v1 header of a block of this plan with both checksums zero: a worker writes it, and the daemon
    computes the checksums from the bytes as they lie in its pool (engram/store/inplace.py)."""
    codec = codec_by_name(plan_.codec)
    body_len = plan_.nbytes - blockformat.HEADER_LEN
    fields = blockformat.header_fields(codec, Axis.CHANNEL, Axis.TOKEN, plan_.dtype, plan_.shape, body_len, 0)
    return fields + bytes(blockformat.HEADER_LEN - len(fields))


_HEADS: dict[tuple[BlockPlan, torch.device], Tensor] = {}


def encode_blocks(kv: Tensor, plan_: BlockPlan, dst: Tensor, offsets: Tensor, *, backend: str) -> Tensor:
    """Write len(offsets) blocks kv (blocks, L, 2, T, H, D) as v1 blocks of the plan (unsealed headers) into the
    uint8 buffer dst at byte offsets (int64 on dst's device). The Triton backend does it in a few launches for
    all blocks: one amax reduction per stream, one permute copy for K, one encode launch per stream.

    Returns a bool tensor on dst's device, true when some block held NaN or Inf (its bytes are then not a
    valid encoding): the caller checks it once, after all its runs, instead of synchronising per run."""
    from engram.codec import fp4_reference as ref

    n = kv.shape[0]
    head = _HEADS.get((plan_, dst.device))
    if head is None:  # made once: a copy from pageable memory would wait for the stream
        head = _HEADS[(plan_, dst.device)] = torch.frombuffer(bytearray(unsealed_header(plan_)),
                                                              dtype=torch.uint8).to(dst.device)
    where = offsets[:, None] + torch.arange(len(head), device=dst.device)[None, :]
    dst[where.flatten()] = head.repeat(n)
    if backend != "triton":
        enc = codec_by_name(plan_.codec)
        for b, off in enumerate(offsets.tolist()):
            body = enc.encode(kv[b], Axis.CHANNEL, Axis.TOKEN, backend)
            at = off + blockformat.HEADER_LEN
            dst[at : at + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(dst.device)
        return torch.zeros((), dtype=torch.bool, device=dst.device)  # the reference raised on NaN/Inf
    from engram.kernels import fp4 as kernels

    layers, _, tokens, heads, dim = plan_.shape
    k = kv[:, :, 0].permute(0, 1, 3, 4, 2).reshape(n, layers * heads * dim, tokens)  # (n, L*H*D, T): a copy
    v = kv[:, :, 1].reshape(n, layers * tokens * heads, dim)  # (n, L*T*H, D)
    bad = torch.zeros((), dtype=torch.bool, device=dst.device)
    for x, at in ((k, plan_.k_at), (v, plan_.v_at)):
        amax = x.reshape(n, -1).abs().amax(dim=1).float()  # (n,): per block, as the reference per matrix
        bad |= ~torch.isfinite(amax).all()
        scales = None
        if plan_.codec == "nvfp4":
            scales = ref.nvfp4_tensor_scale(amax)
        elif plan_.codec == "fp8_e4m3":
            scales = ref.fp8_tensor_scale(amax)
        kernels.quantize_blocks_into(plan_.codec, x.contiguous(), scales, dst, offsets + at)
    return bad


# ---- stream layouts: block format v2 -----------------------------------------------------------------


@dataclass(frozen=True)
class StreamsPlan:
    """Where each stream's payload lies in a full v2 block of one stream layout, and its matrix as stored (cols
    padded to the codec's group). Planned from the model's streams, like `plan`: the daemon verified every
    stored block's header against them when it was put."""

    fmt: streamformat.StreamsFormat
    matrices: tuple[tuple[int, int], ...]  # per part: (rows, padded cols); raw parts: (rows, cols)

    @property
    def nbytes(self) -> int:
        return self.fmt.nbytes

    @property
    def tokens(self) -> int:
        return self.fmt.tokens


def streams_plan(streams: Sequence[StreamSpec], layers: int, tokens: int) -> StreamsPlan:
    """The plan of a v2 block of these (resolved) streams. ValueError where a quantized stream's groups do not
    tile its matrix without padding: such blocks decode one at a time (as partial blocks do)."""
    fmt = streamformat.plan(streams, layers, tokens)
    matrices = []
    for p in fmt.parts:
        rows, cols = p.matrix
        if p.quantized:
            group = FORMATS[p.codec.name].GROUP
            if cols % group or rows * cols == 0:
                raise ValueError(f"{p.codec.name} groups of {group} do not tile stream {p.name}'s ({rows}, {cols}) "
                                 "matrix; such blocks decode one at a time")
        matrices.append((rows, cols))
    return StreamsPlan(fmt, tuple(matrices))


def _raw_part(src: Tensor, offsets: list[int], part: streamformat.Part) -> Tensor:
    """A raw stream of len(offsets) blocks, (blocks, layers, entries, *shape): a strided view of src where the
    blocks are evenly spaced and aligned for the dtype, else one copy."""
    n = len(offsets)
    dtype = part.dtype.torch_dtype
    size = dtype.itemsize
    step = offsets[1] - offsets[0] if n > 1 else part.nbytes
    even = all(o == offsets[0] + i * step for i, o in enumerate(offsets))
    start = src.storage_offset() + offsets[0] + part.at
    if even and step % size == 0 and start % size == 0 and part.nbytes % size == 0:
        as_bytes = src.as_strided((n, part.nbytes), (step, 1), start)
        return as_bytes.view(dtype).view(n, *part.tensor_shape)
    return torch.stack([src[o + part.at : o + part.at + part.nbytes].clone().view(dtype).view(part.tensor_shape)
                        for o in offsets])


def decode_streams(src: Tensor, offsets: list[int], device_offsets: Tensor, plan_: StreamsPlan, *,
                   backend: str) -> list[Tensor]:
    """Each stream of len(offsets) full v2 blocks found at byte `offsets` of the uint8 buffer src (device_offsets:
    the same as int64 on src's device, for the kernels), as (blocks, layers, entries, *shape) in the stream's
    dtype, in the layout's stream order. The Triton backend launches once per quantized stream for the whole
    run; a raw stream is a view of src (no pass at all); the reference backend loops over blocks."""
    n = len(offsets)
    out: list[Tensor] = []
    for p, (rows, cols) in zip(plan_.fmt.parts, plan_.matrices, strict=True):
        if not p.quantized:
            out.append(_raw_part(src, offsets, p))
            continue
        m = torch.empty(n, rows, cols, dtype=p.dtype.torch_dtype, device=src.device)
        if backend == "triton":
            from engram.kernels import fp4 as kernels

            kernels.dequantize_blocks_into(p.codec.name, src, device_offsets + p.at, rows, cols, m)
        else:
            fmt = FORMATS[p.codec.name]
            _, dequantize = kvcodec._backend(backend).CODECS[p.codec.name]
            for b, off in enumerate(offsets):
                body = src[off + p.at : off + p.at + p.nbytes].cpu().numpy().tobytes()
                m[b] = dequantize(fmt.from_bytes(body, (rows, cols), src.device), m.dtype)
        out.append(_from_matrices(m, p))
    return out


def _from_matrices(m: Tensor, p: streamformat.Part) -> Tensor:
    """(blocks, rows, cols) matrices of one stream -> (blocks, layers, entries, *shape) views."""
    n = m.shape[0]
    if p.axis == Axis.CHANNEL:
        return m.view(n, p.layers, p.width, p.entries).transpose(2, 3).unflatten(3, p.shape)
    return m.view(n, *p.tensor_shape)


def _to_matrices(x: Tensor, p: streamformat.Part) -> Tensor:
    """(blocks, layers, entries, *shape) -> contiguous (blocks, rows, cols) matrices (one copy at most)."""
    n = x.shape[0]
    if p.axis == Axis.CHANNEL and p.quantized:
        return x.reshape(n, p.layers, p.entries, p.width).transpose(2, 3).reshape(n, *p.matrix).contiguous()
    return x.reshape(n, *p.matrix).contiguous()


_STREAM_HEADS: dict[tuple[StreamsPlan, torch.device], tuple[Tensor, Tensor]] = {}


def _head_and_gaps(plan_: StreamsPlan, device: torch.device) -> tuple[Tensor, Tensor]:
    """A plan's unsealed header (padded to the body), and the offsets of the body's bytes no stream covers."""
    fmt = plan_.fmt
    head = torch.frombuffer(bytearray(streamformat.unsealed_header(fmt)), dtype=torch.uint8).to(device)
    ranges, at = [], fmt.body_at
    for p in sorted(fmt.parts, key=lambda p: p.at):
        ranges.append(torch.arange(at, max(at, p.at)))
        at = max(at, p.at + p.nbytes)
    ranges.append(torch.arange(at, max(at, fmt.nbytes)))
    return head, torch.cat(ranges).to(device)


def encode_streams(data: Sequence[Tensor], plan_: StreamsPlan, dst: Tensor, offsets: Tensor, *,
                   backend: str) -> Tensor:
    """Write len(offsets) full blocks, each stream's data[i] (blocks, layers, entries, *shape), as v2 blocks of
    the plan (unsealed headers: the daemon seals them) into the uint8 buffer dst at byte offsets (int64 on dst's
    device). The Triton backend: per quantized stream one amax reduction and one encode launch for all blocks;
    a raw stream one strided copy. Returns a bool tensor on dst's device, true when some block held NaN or Inf
    (checked once by the caller)."""
    from engram.codec import fp4_reference as ref

    n = int(offsets.numel())
    cached = _STREAM_HEADS.get((plan_, dst.device))
    if cached is None:
        cached = _STREAM_HEADS[(plan_, dst.device)] = _head_and_gaps(plan_, dst.device)
    head, gaps = cached
    where = offsets[:, None] + torch.arange(len(head), device=dst.device)[None, :]
    dst[where.flatten()] = head.repeat(n)
    if gaps.numel():  # the padding between streams: zero, as the reference writes it (dst is a reused buffer)
        dst[(offsets[:, None] + gaps[None, :]).flatten()] = 0
    bad = torch.zeros((), dtype=torch.bool, device=dst.device)
    for p, x in zip(plan_.fmt.parts, data, strict=True):
        if not p.quantized:
            at = offsets[:, None] + p.at + torch.arange(p.nbytes, device=dst.device)[None, :]
            dst[at.flatten()] = x.contiguous().view(torch.uint8).reshape(-1)
            continue
        m = _to_matrices(x, p)
        if backend != "triton":
            for b, off in enumerate(offsets.tolist()):
                body = p.codec.encode_matrix(m[b], backend, f"stream {p.name}")
                dst[off + p.at : off + p.at + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8
                                                                            ).to(dst.device)
            continue
        from engram.kernels import fp4 as kernels

        amax = m.reshape(n, -1).abs().amax(dim=1).float()  # (n,): per block, as the reference per matrix
        bad |= ~torch.isfinite(amax).all()
        scales = None
        if p.codec.name == "nvfp4":
            scales = ref.nvfp4_tensor_scale(amax)
        elif p.codec.name == "fp8_e4m3":
            scales = ref.fp8_tensor_scale(amax)
        kernels.quantize_blocks_into(p.codec.name, m, scales, dst, offsets + p.at)
    return bad
