"""Triton kernels for the NVFP4, MXFP4 and FP8 E4M3 codecs: the same bytes as engram.codec.fp4_reference.

A kernel sees the padded matrix as a flat run of groups (cols is a multiple of the group size, so groups never
straddle rows). It reads the input as words of two elements (int32 for bf16/fp16, int64 for fp32): a word's
two elements are exactly the two nibbles of one code byte, so codes are built and stored without reshuffling
data between threads, and the code byte of word i sits at byte i. Each program takes `groups_per_program`
consecutive groups as one (groups, words per group) tile: contiguous vector loads and stores, no atomics.

Bit-exactness with the reference rests on a few habits. Rounding to E2M1/E4M3 and building E8M0 exponents use
integer operations on float32 bits, never Triton's fp8 casts (wrong for ~1.2% of values under the interpreter).
Divisions are tl.div_rn (IEEE), since `/` on float32 lowers to the approximate div.full.f32. No mul+add pair is
left for the compiler to fuse into an FMA where the product's rounding would matter (fusion is also switched
off). Signs are set with bit operations, not float negation. Under the interpreter bf16 outputs are rounded with
integer operations (its fp32 -> bf16 cast truncates); on the GPU the native cvt.rn.bf16 is used, and the GPU
tests check both paths.

The encoders are arithmetic-bound on Hopper (it has no FP4 convert instruction), mostly on the 64-lane integer
pipe, so the code counts integer operations per element; see docs/FP4_NOTES.md for the measured speeds.

Tensors on the CPU run through Triton's interpreter, which is chosen when a kernel is decorated: set
TRITON_INTERPRET=1 before this module is first imported. CUDA tensors need it unset. NaN/Inf inputs raise
ValueError, as in the reference, but without an extra pass where possible: a kernel marks a group holding NaN/Inf
with a NaN scale code and the wrapper looks for it in the (small) scales afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from engram.codec import fp4_reference as ref
from engram.codec.fp4_reference import FP8Tensor, MXFP4Tensor, NVFP4Tensor


@dataclass(frozen=True)
class KernelConfig:
    """One tile configuration. GPU tests run every entry of CONFIGS against the reference, bit for bit: a
    configuration can compile to wrong code on one GPU and not on the interpreter."""

    groups_per_program: int  # rows of a program's (groups, words per group) tile
    num_warps: int


CONFIGS = tuple(KernelConfig(g, w) for g in (64, 256, 1024) for w in (2, 4, 8))
# Fastest on an H200 for 256 MiB - 1 GiB of bf16 (benchmarks/codec_speed.py, docs/FP4_NOTES.md): the encoders
# are arithmetic-bound and like many elements per thread; the decoders are memory-bound.
QUANTIZE_CONFIG = KernelConfig(256, 2)
DEQUANTIZE_CONFIG = KernelConfig(64, 2)

_IN_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SIGN = tl.constexpr(-(2**31))  # 0x80000000 as an int32 constant


# ---------------------------------------------------------------------------------------------------------
# Device functions


@triton.jit
def _load_pairs(ptr, offs, mask, IN_KIND: tl.constexpr):
    """float32 bit patterns (int32) of the first and second element of each word."""
    w = tl.load(ptr + offs, mask=mask, other=0)
    if IN_KIND == 1:  # bf16: its bits are the top half of a float32's
        return w << 16, w & -65536
    elif IN_KIND == 2:  # fp16: widening is exact, on any backend
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True)
    else:  # fp32: an int64 word
        return w.to(tl.int32), (w >> 32).to(tl.int32)


@triton.jit
def _e2m1_code(q):
    """E2M1 magnitude code (0..7) of q >= 0, round to nearest even, saturating at 6."""
    q = tl.minimum(q, 6.0)
    qb = q.to(tl.int32, bitcast=True)
    # q >= 1: keep one mantissa bit, ties to even on the kept bit, a carry moves into the exponent; the exponent
    # then gives codes 2..7 as (qb >> 22) - 252, i.e. ((qb >> 22) + 4) & 7.
    normal = (qb + (0x1FFFFF + 0x1000000) + ((qb >> 22) & 1)) >> 22
    # q < 1: steps of 0.5; adding 2^22 (whose ulp is 0.5) lets the float adder round, leaving 0..2 in the low bits.
    small = (q + 4194304.0).to(tl.int32, bitcast=True)
    return tl.where(q < 1.0, small, normal) & 7


@triton.jit
def _e4m3_code(s):
    """E4M3 code of s in [0, 448], round to nearest even."""
    sb = s.to(tl.int32, bitcast=True)
    normal = ((sb + 0x7FFFF + ((sb >> 20) & 1)) >> 20) - 960  # 3 mantissa bits kept, bias 127 -> 7
    small = (s + 16384.0).to(tl.int32, bitcast=True) - 0x46800000  # ulp of 2^14 is 2^-9, the subnormal step
    return tl.where(s < 0.015625, small, normal)


@triton.jit
def _e4m3_value(code):
    """float32 value of E4M3 magnitude codes 0..126."""
    normal = ((code + 960) << 20).to(tl.float32, bitcast=True)
    return tl.where(code >= 8, normal, (code & 7).to(tl.float32) * 0.001953125)


@triton.jit
def _quantize_pairs(lo, hi, inv):
    """Code bytes of (first, second) element bits, each group times its reciprocal scale inv (groups, 1)."""
    c0 = _e2m1_code((lo & 0x7FFFFFFF).to(tl.float32, bitcast=True) * inv)
    c1 = _e2m1_code((hi & 0x7FFFFFFF).to(tl.float32, bitcast=True) * inv)
    sign = ((lo >> 28) & 8) | ((hi >> 24) & 0x80)
    return (c0 | (c1 << 4) | sign).to(tl.uint8)


@triton.jit
def _dequantize_pairs(byte):
    """E2M1 values of a byte's (low, high) nibbles. The nibble's 3 magnitude bits placed at bit 22 of a float32
    make value * 2^-126 (codes 0 and 1 land on float32 subnormals, as E2M1's own subnormals); one exact
    multiply by 2^126 restores the value."""
    c = byte.to(tl.int32)
    lo = ((c << 22) & 0x01C00000) | ((c << 28) & _SIGN)
    hi = ((c << 18) & 0x01C00000) | ((c << 24) & _SIGN)
    return lo.to(tl.float32, bitcast=True) * 2.0**126, hi.to(tl.float32, bitcast=True) * 2.0**126


@triton.jit
def _store_pairs(ptr, offs, mask, lo, hi, OUT_KIND: tl.constexpr, NATIVE_BF16: tl.constexpr):
    """Store two float32 tensors as the first and second element of each output word."""
    if OUT_KIND == 1:
        if NATIVE_BF16:  # cvt.rn.bf16.f32: round to nearest even, like torch
            wl = lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            wh = hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16
        else:  # integer round to nearest even of the float32 bits
            bl = lo.to(tl.int32, bitcast=True)
            bh = hi.to(tl.int32, bitcast=True)
            wl = ((bl + 0x7FFF + ((bl >> 16) & 1)) >> 16) & 0xFFFF
            wh = (bh + 0x7FFF + ((bh >> 16) & 1)) & -65536
        tl.store(ptr + offs, wl | wh, mask=mask)
    elif OUT_KIND == 2:
        wl = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        wh = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16
        tl.store(ptr + offs, wl | wh, mask=mask)
    else:
        wl = lo.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        wh = hi.to(tl.int32, bitcast=True).to(tl.int64) << 32
        tl.store(ptr + offs, wl | wh, mask=mask)


@triton.jit
def _tile(n_groups, BLOCK_GROUPS: tl.constexpr, WORDS: tl.constexpr):
    """This program's group ids (BLOCK_GROUPS,), their mask, and word offsets (BLOCK_GROUPS, WORDS), which are
    also the offsets of the code bytes."""
    g = tl.program_id(0).to(tl.int64) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    return g, g < n_groups, g[:, None] * WORDS + tl.arange(0, WORDS)[None, :]


# ---------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _nvfp4_quantize(x_ptr, ts_ptr, codes_ptr, scales_ptr, n_groups,
                    IN_KIND: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    g, gmask, offs = _tile(n_groups, BLOCK_GROUPS, 8)  # 16 elements = 8 words a group
    lo, hi = _load_pairs(x_ptr, offs, gmask[:, None], IN_KIND)  # (BG, 8) float32 bits each
    amax_bits = tl.max(tl.maximum(lo & 0x7FFFFFFF, hi & 0x7FFFFFFF), axis=1)  # (BG,)
    amax = amax_bits.to(tl.float32, bitcast=True)
    ts = tl.load(ts_ptr)
    raw = tl.minimum(tl.div_rn(tl.div_rn(amax, 6.0), ts), 448.0)
    sc = tl.where(amax > 0, tl.maximum(_e4m3_code(raw), 1), 0)
    s = _e4m3_value(sc) * ts
    inv = tl.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(s > 0, s, 1.0))
    tl.store(codes_ptr + offs, _quantize_pairs(lo, hi, inv[:, None]), mask=gmask[:, None])
    sc = tl.where(amax_bits >= 0x7F800000, 0x7F, sc)  # NaN/Inf in the group: mark it for the wrapper
    tl.store(scales_ptr + g, sc.to(tl.uint8), mask=gmask)


@triton.jit
def _nvfp4_dequantize(codes_ptr, scales_ptr, ts_ptr, out_ptr, n_groups, OUT_KIND: tl.constexpr,
                      NATIVE_BF16: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    g, gmask, offs = _tile(n_groups, BLOCK_GROUPS, 8)
    lo, hi = _dequantize_pairs(tl.load(codes_ptr + offs, mask=gmask[:, None], other=0))  # (BG, 8) each
    s = _e4m3_value(tl.load(scales_ptr + g, mask=gmask, other=0).to(tl.int32))[:, None]  # (BG, 1)
    ts = tl.load(ts_ptr)
    _store_pairs(out_ptr, offs, gmask[:, None], (lo * s) * ts, (hi * s) * ts, OUT_KIND, NATIVE_BF16)


@triton.jit
def _mxfp4_quantize(x_ptr, codes_ptr, scales_ptr, n_groups,
                    IN_KIND: tl.constexpr, ROUND_UP: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    g, gmask, offs = _tile(n_groups, BLOCK_GROUPS, 16)  # 32 elements = 16 words a group
    lo, hi = _load_pairs(x_ptr, offs, gmask[:, None], IN_KIND)
    amax_bits = tl.max(tl.maximum(lo & 0x7FFFFFFF, hi & 0x7FFFFFFF), axis=1)  # (BG,)
    sc = (amax_bits >> 23) - 2  # biased exponent of amax, minus 2: the OCP floor rule
    if ROUND_UP:
        sc += ((amax_bits & 0x7FFFFF) > 0x400000).to(tl.int32)
    sc = tl.minimum(tl.maximum(sc, 0), 254)
    inv = ((254 - sc) << 23).to(tl.float32, bitcast=True)  # exactly 1 / 2^(sc - 127)
    tl.store(codes_ptr + offs, _quantize_pairs(lo, hi, inv[:, None]), mask=gmask[:, None])
    sc = tl.where(amax_bits >= 0x7F800000, 0xFF, sc)  # NaN/Inf in the group: the E8M0 NaN code
    tl.store(scales_ptr + g, sc.to(tl.uint8), mask=gmask)


@triton.jit
def _mxfp4_dequantize(codes_ptr, scales_ptr, out_ptr, n_groups, OUT_KIND: tl.constexpr,
                      NATIVE_BF16: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    g, gmask, offs = _tile(n_groups, BLOCK_GROUPS, 16)
    lo, hi = _dequantize_pairs(tl.load(codes_ptr + offs, mask=gmask[:, None], other=0))
    sc = tl.load(scales_ptr + g, mask=gmask, other=0).to(tl.int32)
    s = tl.where(sc == 0, 0x00400000, sc << 23).to(tl.float32, bitcast=True)[:, None]  # 2^(sc - 127)
    _store_pairs(out_ptr, offs, gmask[:, None], lo * s, hi * s, OUT_KIND, NATIVE_BF16)


@triton.jit
def _fp8_quantize(x_ptr, scale_ptr, codes_ptr, n, IN_KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # FP8 has no groups: a flat tile
    mask = offs < n
    if IN_KIND == 1:
        bits = (tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF) << 16
    else:
        bits = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    inv = tl.div_rn(1.0, tl.load(scale_ptr))
    code = _e4m3_code(tl.minimum(mag.to(tl.float32, bitcast=True) * inv, 448.0))
    code = tl.where(mag >= 0x7F800000, 0x7F, code) | ((bits >> 24) & 0x80)  # NaN/Inf: the E4M3 NaN code
    tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)


@triton.jit
def _fp8_dequantize(codes_ptr, scale_ptr, out_ptr, n, OUT_KIND: tl.constexpr, NATIVE_BF16: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    v = (_e4m3_value(c & 0x7F) * tl.load(scale_ptr)).to(tl.int32, bitcast=True) | ((c & 0x80) << 24)
    v = v.to(tl.float32, bitcast=True)
    if OUT_KIND == 1:
        if NATIVE_BF16:
            tl.store(out_ptr + offs, v.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=mask)
        else:
            b = v.to(tl.int32, bitcast=True)
            tl.store(out_ptr + offs, ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16), mask=mask)
    elif OUT_KIND == 2:
        tl.store(out_ptr + offs, v.to(tl.float16), mask=mask)
    else:
        tl.store(out_ptr + offs, v, mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Batched decoders: one launch decodes one payload (K's or V's) of many blocks of one shape. Block b's payload
# starts at byte offsets[b] of `src` (a staging buffer, or a pool the worker opened by CUDA IPC) and decodes
# to out[b]. Grid: (programs per payload, blocks). The per-block scale is read as 4 little-endian bytes, so
# `src` needs no alignment.


@triton.jit
def _f32_at(ptr):
    b0 = tl.load(ptr).to(tl.int32)
    b1 = tl.load(ptr + 1).to(tl.int32)
    b2 = tl.load(ptr + 2).to(tl.int32)
    b3 = tl.load(ptr + 3).to(tl.int32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_dequantize_blocks(src_ptr, offsets_ptr, out_ptr, out_stride, n_groups, scales_at, codes_at,
                             OUT_KIND: tl.constexpr, NATIVE_BF16: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    base = src_ptr + tl.load(offsets_ptr + tl.program_id(1))  # the payload: tensor scale, scales, codes
    out = out_ptr + tl.program_id(1).to(tl.int64) * out_stride
    g, gmask, offs = _tile(n_groups, BLOCK_GROUPS, 8)
    lo, hi = _dequantize_pairs(tl.load(base + codes_at + offs, mask=gmask[:, None], other=0))
    s = _e4m3_value(tl.load(base + scales_at + g, mask=gmask, other=0).to(tl.int32))[:, None]
    ts = _f32_at(base)
    _store_pairs(out, offs, gmask[:, None], (lo * s) * ts, (hi * s) * ts, OUT_KIND, NATIVE_BF16)


@triton.jit
def _mxfp4_dequantize_blocks(src_ptr, offsets_ptr, out_ptr, out_stride, n_groups, codes_at,
                             OUT_KIND: tl.constexpr, NATIVE_BF16: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    base = src_ptr + tl.load(offsets_ptr + tl.program_id(1))  # the payload: scales, codes
    out = out_ptr + tl.program_id(1).to(tl.int64) * out_stride
    g, gmask, offs = _tile(n_groups, BLOCK_GROUPS, 16)
    lo, hi = _dequantize_pairs(tl.load(base + codes_at + offs, mask=gmask[:, None], other=0))
    sc = tl.load(base + g, mask=gmask, other=0).to(tl.int32)
    s = tl.where(sc == 0, 0x00400000, sc << 23).to(tl.float32, bitcast=True)[:, None]
    _store_pairs(out, offs, gmask[:, None], lo * s, hi * s, OUT_KIND, NATIVE_BF16)


@triton.jit
def _fp8_dequantize_blocks(src_ptr, offsets_ptr, out_ptr, out_stride, n, OUT_KIND: tl.constexpr,
                           NATIVE_BF16: tl.constexpr, BLOCK: tl.constexpr):
    base = src_ptr + tl.load(offsets_ptr + tl.program_id(1))  # the payload: scale, codes
    out = out_ptr + tl.program_id(1).to(tl.int64) * out_stride
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(base + 4 + offs, mask=mask, other=0).to(tl.int32)
    v = (_e4m3_value(c & 0x7F) * _f32_at(base)).to(tl.int32, bitcast=True) | ((c & 0x80) << 24)
    v = v.to(tl.float32, bitcast=True)
    if OUT_KIND == 1:
        if NATIVE_BF16:
            tl.store(out + offs, v.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=mask)
        else:
            b = v.to(tl.int32, bitcast=True)
            tl.store(out + offs, ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16), mask=mask)
    elif OUT_KIND == 2:
        tl.store(out + offs, v.to(tl.float16), mask=mask)
    else:
        tl.store(out + offs, v, mask=mask)


# Batched encoders: one launch encodes one matrix (K's or V's) of many blocks, x[b] (rows, cols) contiguous, into
# the payload at byte offsets[b] of `dst`, as the codec's to_bytes lays it out. Per-block scales come in ts[b]
# (already checked finite by the caller: no NaN marks).


@triton.jit
def _put_f32(ptr, value):
    bits = value.to(tl.int32, bitcast=True)
    tl.store(ptr, (bits & 0xFF).to(tl.uint8))
    tl.store(ptr + 1, ((bits >> 8) & 0xFF).to(tl.uint8))
    tl.store(ptr + 2, ((bits >> 16) & 0xFF).to(tl.uint8))
    tl.store(ptr + 3, ((bits >> 24) & 0xFF).to(tl.uint8))


@triton.jit
def _nvfp4_quantize_blocks(x_ptr, x_stride, ts_ptr, dst_ptr, offsets_ptr, n_groups, scales_at, codes_at,
                           IN_KIND: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    b = tl.program_id(1)
    x = x_ptr + b.to(tl.int64) * x_stride
    base = dst_ptr + tl.load(offsets_ptr + b)
    ts = tl.load(ts_ptr + b)
    g, gmask, offs = _tile(n_groups, BLOCK_GROUPS, 8)
    lo, hi = _load_pairs(x, offs, gmask[:, None], IN_KIND)
    amax_bits = tl.max(tl.maximum(lo & 0x7FFFFFFF, hi & 0x7FFFFFFF), axis=1)
    amax = amax_bits.to(tl.float32, bitcast=True)
    raw = tl.minimum(tl.div_rn(tl.div_rn(amax, 6.0), ts), 448.0)
    sc = tl.where(amax > 0, tl.maximum(_e4m3_code(raw), 1), 0)
    s = _e4m3_value(sc) * ts
    inv = tl.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(s > 0, s, 1.0))
    tl.store(base + codes_at + offs, _quantize_pairs(lo, hi, inv[:, None]), mask=gmask[:, None])
    tl.store(base + scales_at + g, sc.to(tl.uint8), mask=gmask)
    if tl.program_id(0) == 0:
        _put_f32(base, ts)


@triton.jit
def _mxfp4_quantize_blocks(x_ptr, x_stride, dst_ptr, offsets_ptr, n_groups, codes_at,
                           IN_KIND: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    b = tl.program_id(1)
    x = x_ptr + b.to(tl.int64) * x_stride
    base = dst_ptr + tl.load(offsets_ptr + b)
    g, gmask, offs = _tile(n_groups, BLOCK_GROUPS, 16)
    lo, hi = _load_pairs(x, offs, gmask[:, None], IN_KIND)
    amax_bits = tl.max(tl.maximum(lo & 0x7FFFFFFF, hi & 0x7FFFFFFF), axis=1)
    sc = (amax_bits >> 23) - 2
    sc = tl.minimum(tl.maximum(sc, 0), 254)
    inv = ((254 - sc) << 23).to(tl.float32, bitcast=True)
    tl.store(base + codes_at + offs, _quantize_pairs(lo, hi, inv[:, None]), mask=gmask[:, None])
    tl.store(base + g, sc.to(tl.uint8), mask=gmask)


@triton.jit
def _fp8_quantize_blocks(x_ptr, x_stride, scale_ptr, dst_ptr, offsets_ptr, n, IN_KIND: tl.constexpr,
                         BLOCK: tl.constexpr):
    b = tl.program_id(1)
    x = x_ptr + b.to(tl.int64) * x_stride
    base = dst_ptr + tl.load(offsets_ptr + b)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if IN_KIND == 1:
        bits = (tl.load(x + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF) << 16
    else:
        bits = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    scale = tl.load(scale_ptr + b)
    inv = tl.div_rn(1.0, scale)
    code = _e4m3_code(tl.minimum(mag.to(tl.float32, bitcast=True) * inv, 448.0)) | ((bits >> 24) & 0x80)
    tl.store(base + 4 + offs, code.to(tl.uint8), mask=mask)
    if tl.program_id(0) == 0:
        _put_f32(base, scale)


INTERPRETED = isinstance(_nvfp4_quantize, InterpretedFunction)
NATIVE_BF16 = not INTERPRETED  # the interpreter's fp32 -> bf16 cast truncates


# ---------------------------------------------------------------------------------------------------------
# Launchers: no checks and no host synchronisation, for fused callers and benchmarks. x is (rows, cols)
# contiguous with cols a multiple of the group size; outputs are preallocated with the payload's shapes.


def _words(x: Tensor) -> Tensor:
    """x as words of two elements (int32 for 16-bit types, int64 for float32)."""
    return x.view(torch.int64 if x.dtype == torch.float32 else torch.int32)


def _options(config: KernelConfig) -> dict[str, int | bool]:
    # No FMA contraction: the kernels have no mul+add pair where it would matter, and must stay that way.
    return {"num_warps": config.num_warps, "enable_fp_fusion": False}


def _grid(n_groups: int, config: KernelConfig) -> tuple[int]:
    return (triton.cdiv(n_groups, config.groups_per_program),)


def quantize_nvfp4_into(x: Tensor, tensor_scale: Tensor, codes: Tensor, scales: Tensor,
                        config: KernelConfig = QUANTIZE_CONFIG) -> None:
    """x (rows, cols) -> codes (rows, cols/2), scales (rows, cols/16); tensor_scale is a () float32 tensor on
    x's device. A group holding NaN/Inf gets scale byte 0x7F: check for it if x may hold any."""
    n = scales.numel()
    _nvfp4_quantize[_grid(n, config)](_words(x), tensor_scale, codes, scales, n, IN_KIND=_IN_KINDS[x.dtype],
                                      BLOCK_GROUPS=config.groups_per_program, **_options(config))


def dequantize_nvfp4_into(codes: Tensor, scales: Tensor, tensor_scale: Tensor, out: Tensor,
                          config: KernelConfig = DEQUANTIZE_CONFIG, native_bf16: bool = NATIVE_BF16) -> None:
    n = scales.numel()
    _nvfp4_dequantize[_grid(n, config)](codes, scales, tensor_scale, _words(out), n, OUT_KIND=_OUT_KINDS[out.dtype],
                                        NATIVE_BF16=native_bf16, BLOCK_GROUPS=config.groups_per_program,
                                        **_options(config))


def quantize_mxfp4_into(x: Tensor, codes: Tensor, scales: Tensor, round_up: bool = False,
                        config: KernelConfig = QUANTIZE_CONFIG) -> None:
    n = scales.numel()
    _mxfp4_quantize[_grid(n, config)](_words(x), codes, scales, n, IN_KIND=_IN_KINDS[x.dtype], ROUND_UP=round_up,
                                      BLOCK_GROUPS=config.groups_per_program, **_options(config))


def dequantize_mxfp4_into(codes: Tensor, scales: Tensor, out: Tensor, config: KernelConfig = DEQUANTIZE_CONFIG,
                          native_bf16: bool = NATIVE_BF16) -> None:
    n = scales.numel()
    _mxfp4_dequantize[_grid(n, config)](codes, scales, _words(out), n, OUT_KIND=_OUT_KINDS[out.dtype],
                                        NATIVE_BF16=native_bf16, BLOCK_GROUPS=config.groups_per_program,
                                        **_options(config))


def quantize_fp8_e4m3_into(x: Tensor, scale: Tensor, codes: Tensor, config: KernelConfig = QUANTIZE_CONFIG) -> None:
    block = config.groups_per_program * 16  # FP8 tiles as many elements as an NVFP4 tile
    bits = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    _fp8_quantize[(triton.cdiv(x.numel(), block),)](bits, scale, codes, x.numel(), IN_KIND=_IN_KINDS[x.dtype],
                                                    BLOCK=block, **_options(config))


def dequantize_fp8_e4m3_into(codes: Tensor, scale: Tensor, out: Tensor, config: KernelConfig = DEQUANTIZE_CONFIG,
                             native_bf16: bool = NATIVE_BF16) -> None:
    block = config.groups_per_program * 16
    dst = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    _fp8_dequantize[(triton.cdiv(codes.numel(), block),)](codes, scale, dst, codes.numel(),
                                                          OUT_KIND=_OUT_KINDS[out.dtype], NATIVE_BF16=native_bf16,
                                                          BLOCK=block, **_options(config))


def quantize_blocks_into(fmt: str, x: Tensor, scales: Tensor | None, dst: Tensor, offsets: Tensor,
                         config: KernelConfig = QUANTIZE_CONFIG) -> None:
    """Encode x[b] ((blocks, rows, cols) contiguous, cols a multiple of the group) into the payload at byte
    offsets[b] of the uint8 buffer dst, laid out as the codec's to_bytes; scales[b] is block b's per-tensor scale
    (nvfp4, fp8_e4m3; float32 on x's device). No checks and no host synchronisation."""
    n_blocks, rows, cols = x.shape
    if n_blocks == 0:
        return
    opts = {"IN_KIND": _IN_KINDS[x.dtype], **_options(config)}
    if fmt == "fp8_e4m3":
        block = config.groups_per_program * 16
        bits = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
        n = rows * cols
        _fp8_quantize_blocks[(triton.cdiv(n, block), n_blocks)](bits, n, scales, dst, offsets, n, BLOCK=block, **opts)
        return
    words = _words(x)
    stride = words[0].numel()
    group = ref.NVFP4_GROUP if fmt == "nvfp4" else ref.MXFP4_GROUP
    n_groups = rows * cols // group
    grid = (triton.cdiv(n_groups, config.groups_per_program), n_blocks)
    if fmt == "nvfp4":
        _nvfp4_quantize_blocks[grid](words, stride, scales, dst, offsets, n_groups, 4, 4 + n_groups,
                                     BLOCK_GROUPS=config.groups_per_program, **opts)
    elif fmt == "mxfp4":
        _mxfp4_quantize_blocks[grid](words, stride, dst, offsets, n_groups, n_groups,
                                     BLOCK_GROUPS=config.groups_per_program, **opts)
    else:
        raise ValueError(f"unknown format {fmt!r}")


def dequantize_blocks_into(fmt: str, src: Tensor, offsets: Tensor, rows: int, cols: int, out: Tensor,
                           config: KernelConfig = DEQUANTIZE_CONFIG, native_bf16: bool = NATIVE_BF16) -> None:
    """Decode the payloads of len(offsets) blocks: each a (rows, cols) matrix in `fmt` (cols padded to the
    group, as stored) starting at byte offsets[b] (int64, on src's device) of the uint8 buffer `src`, into
    out[b] (out: (blocks, rows, cols) contiguous). No checks and no host synchronisation."""
    n_blocks = offsets.numel()
    if n_blocks == 0:
        return
    opts = {"OUT_KIND": _OUT_KINDS[out.dtype], "NATIVE_BF16": native_bf16, **_options(config)}
    if fmt == "fp8_e4m3":
        block = config.groups_per_program * 16
        dst = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
        n = rows * cols
        _fp8_dequantize_blocks[(triton.cdiv(n, block), n_blocks)](src, offsets, dst, n, n, BLOCK=block, **opts)
        return
    group = ref.NVFP4_GROUP if fmt == "nvfp4" else ref.MXFP4_GROUP
    n_groups = rows * cols // group
    words = _words(out)
    stride = words[0].numel()
    grid = (triton.cdiv(n_groups, config.groups_per_program), n_blocks)
    if fmt == "nvfp4":
        scales_at = 4
        _nvfp4_dequantize_blocks[grid](src, offsets, words, stride, n_groups, scales_at, scales_at + n_groups,
                                       BLOCK_GROUPS=config.groups_per_program, **opts)
    elif fmt == "mxfp4":
        _mxfp4_dequantize_blocks[grid](src, offsets, words, stride, n_groups, n_groups,
                                       BLOCK_GROUPS=config.groups_per_program, **opts)
    else:
        raise ValueError(f"unknown format {fmt!r}")


# ---------------------------------------------------------------------------------------------------------
# The codec API: the reference's signatures (plus `config`), payloads and errors. Decoded tensors are
# (rows, cols) views of the padded output.


def _check_backend(x: Tensor) -> None:
    if x.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("Triton kernels on CPU tensors need its interpreter: set TRITON_INTERPRET=1 before "
                           "engram.kernels.fp4 is imported, or use the reference codecs (engram.codec.fp4_reference)")


def _raise_if_marked(marked: Tensor, x: Tensor, name: str) -> None:
    """The kernel marked NaN/Inf groups; only then pay for an exact count."""
    if bool(marked.any()):
        ref.raise_if_not_finite(x, name)
        raise AssertionError(f"{name}: the kernel marked a NaN/Inf group, but torch.isfinite finds none")


def quantize_nvfp4(x: Tensor, tensor_scale: Tensor | float | None = None, *, name: str = "x",
                   config: KernelConfig = QUANTIZE_CONFIG) -> NVFP4Tensor:
    """engram.codec.fp4_reference.quantize_nvfp4 on the GPU (or the interpreter)."""
    ref.check_matrix(x, name)
    _check_backend(x)
    if tensor_scale is None:
        ts = ref.nvfp4_tensor_scale(ref.finite_amax(x, name))  # the amax pass: 2 bytes/element read for bf16
    else:
        ts = ref.checked_scale(tensor_scale, ref.NVFP4_TENSOR_SCALE_RANGE, x.device, name)
    xp = ref.pad_cols(x, ref.NVFP4_GROUP)  # (rows, cols_p)
    codes = torch.empty(xp.shape[0], xp.shape[1] // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(xp.shape[0], xp.shape[1] // ref.NVFP4_GROUP, dtype=torch.uint8, device=x.device)
    quantize_nvfp4_into(xp, ts, codes, scales, config)
    if tensor_scale is not None:  # otherwise the amax pass has already seen any NaN/Inf
        _raise_if_marked(scales == 0x7F, x, name)
    return NVFP4Tensor(codes, scales, ts, (x.shape[0], x.shape[1]))


def dequantize_nvfp4(q: NVFP4Tensor, dtype: torch.dtype = torch.float32, *,
                     config: KernelConfig = DEQUANTIZE_CONFIG) -> Tensor:
    _check_backend(q.codes)
    out = torch.empty(q.codes.shape[0], q.codes.shape[1] * 2, dtype=dtype, device=q.codes.device)
    dequantize_nvfp4_into(q.codes, q.scales, q.tensor_scale, out, config)
    return out[:, : q.shape[1]]


def quantize_mxfp4(x: Tensor, *, round_up: bool = False, name: str = "x",
                   config: KernelConfig = QUANTIZE_CONFIG) -> MXFP4Tensor:
    """engram.codec.fp4_reference.quantize_mxfp4; NaN/Inf are found from the kernel's marks, without a pass."""
    ref.check_matrix(x, name)
    _check_backend(x)
    xp = ref.pad_cols(x, ref.MXFP4_GROUP)
    codes = torch.empty(xp.shape[0], xp.shape[1] // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(xp.shape[0], xp.shape[1] // ref.MXFP4_GROUP, dtype=torch.uint8, device=x.device)
    quantize_mxfp4_into(xp, codes, scales, round_up, config)
    _raise_if_marked(scales == 0xFF, x, name)
    return MXFP4Tensor(codes, scales, (x.shape[0], x.shape[1]))


def dequantize_mxfp4(q: MXFP4Tensor, dtype: torch.dtype = torch.float32, *,
                     config: KernelConfig = DEQUANTIZE_CONFIG) -> Tensor:
    _check_backend(q.codes)
    out = torch.empty(q.codes.shape[0], q.codes.shape[1] * 2, dtype=dtype, device=q.codes.device)
    dequantize_mxfp4_into(q.codes, q.scales, out, config)
    return out[:, : q.shape[1]]


def quantize_fp8_e4m3(x: Tensor, scale: Tensor | float | None = None, *, name: str = "x",
                      config: KernelConfig = QUANTIZE_CONFIG) -> FP8Tensor:
    """engram.codec.fp4_reference.quantize_fp8_e4m3 on the GPU (or the interpreter)."""
    ref.check_matrix(x, name)
    _check_backend(x)
    if scale is None:
        s = ref.fp8_tensor_scale(ref.finite_amax(x, name))
    else:
        s = ref.checked_scale(scale, ref.FP8_SCALE_RANGE, x.device, name)
    xc = x.contiguous()
    codes = torch.empty(xc.shape, dtype=torch.uint8, device=x.device)
    quantize_fp8_e4m3_into(xc, s, codes, config)
    if scale is not None:
        _raise_if_marked((codes & 0x7F) == 0x7F, x, name)
    return FP8Tensor(codes, s, (x.shape[0], x.shape[1]))


def dequantize_fp8_e4m3(q: FP8Tensor, dtype: torch.dtype = torch.float32, *,
                        config: KernelConfig = DEQUANTIZE_CONFIG) -> Tensor:
    _check_backend(q.codes)
    out = torch.empty(q.codes.shape, dtype=dtype, device=q.codes.device)
    dequantize_fp8_e4m3_into(q.codes, q.scale, out, config)
    return out


CODECS: dict[str, tuple[ref.Quantize, ref.Dequantize]] = {
    "nvfp4": (quantize_nvfp4, dequantize_nvfp4),
    "mxfp4": (quantize_mxfp4, dequantize_mxfp4),
    "fp8_e4m3": (quantize_fp8_e4m3, dequantize_fp8_e4m3),
}
