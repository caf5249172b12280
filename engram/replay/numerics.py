"""The ops the reference decoder runs, in two numerics.

- BATCH_INVARIANT (default): every op computes a row with the same arithmetic whatever other rows are in the
  call (no BLAS GEMM, whose per-row result depends on the matrix height: measured ~1e-14 in float64 on MKL).
  This is what makes "the replay rebuilds the prefill's SWA KV bit for bit" testable. Slow; for tests.
- FAST: F.linear and scaled_dot_product_attention (the benchmark's path); equal to the reference within rounding.

Why the batch-invariant ops look the way they do: on the CPU a result can depend on more than its inputs: a
GEMM's per-row sums on the matrix height, a vectorized sum on the row length (masked trailing keys regroup the
lanes), an elementwise exp or cos on whether the element fell in the SIMD body or the scalar tail of the flat
tensor. The batch-invariant ops avoid all three, so a position's numbers depend only on the data at positions
<= it: a prefill, a longer prefill, a replay and a decode step agree bit for bit. (Verified on x86 CPUs; CUDA
kernels make no such promise.)

What this module does not do: hold weights or know layer kinds (decoder.py does).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


class Numerics(enum.StrEnum):
    BATCH_INVARIANT = "batch_invariant"
    FAST = "fast"

_VEC_CHUNK = 16_384  # a multiple of every SIMD width and below ATen's parallel grain (32768): no scalar tail


def _pointwise(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn elementwise, every element through the vectorized kernel (flat size padded, single-threaded chunks)."""
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % 64
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return torch.cat([fn(c) for c in flat.split(_VEC_CHUNK)])[:n].view(x.shape)


def linear(x: Tensor, w: Tensor, numerics: Numerics) -> Tensor:
    if numerics is Numerics.FAST:
        return F.linear(x, w)
    return (x.unsqueeze(-2) * w).sum(-1)  # (..., T, 1, d_in) * (d_out, d_in) -> (..., T, d_out)


def silu(x: Tensor, numerics: Numerics) -> Tensor:
    return F.silu(x) if numerics is Numerics.FAST else _pointwise(F.silu, x)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _softmax(scores: Tensor, sinks: Tensor | None, numerics: Numerics) -> Tensor:
    """scores (B, H, Tq, S) with -inf where masked; a sink adds exp(sink) to each row's denominator.

    Batch-invariant: the denominator is a sequential left-to-right sum (cumsum), so masked trailing keys add
    exact zeros and a row's sum does not depend on how many of them the call carries.
    """
    if numerics is Numerics.FAST:
        if sinks is None:
            return torch.softmax(scores, dim=-1)
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    top = scores.amax(-1, keepdim=True)  # (B, H, Tq, 1); a max is exact in any order
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1)
        top = torch.maximum(top, sink)
    e = _pointwise(torch.exp, scores - top)
    denom = e.cumsum(-1)[..., -1:]
    if sinks is not None:
        denom = denom + _pointwise(torch.exp, sink - top)
    return e / denom


def rope_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 numerics: Numerics) -> tuple[Tensor, Tensor]:
    # angles in float64 from integer positions: the same position gets the same angle in any span
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, d_h / 2)
    if numerics is Numerics.FAST:
        return angles.cos().to(dtype), angles.sin().to(dtype)
    return _pointwise(torch.cos, angles).to(dtype), _pointwise(torch.sin, angles).to(dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (B, h, T, d_h / 2) each; cos, sin (T, d_h / 2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _global_scores(q: Tensor, k: Tensor, numerics: Numerics) -> Tensor:
    """q (B, H, Tq, d_h), k (B, H, S, d_h) -> (B, H, Tq, S), unscaled."""
    if numerics is Numerics.FAST:
        return q @ k.transpose(-1, -2)
    return (q.unsqueeze(-2) * k.unsqueeze(2)).sum(-1)  # (B, H, Tq, S, d_h) -> (B, H, Tq, S)


def _weighted_values(p: Tensor, v: Tensor, numerics: Numerics) -> Tensor:
    """p (B, H, Tq, S), v (B, H, S, d_h) -> (B, H, Tq, d_h)."""
    if numerics is Numerics.FAST:
        return p @ v
    # a sequential sum over S (see _softmax): (B, H, Tq, d_h, S) -> (B, H, Tq, d_h)
    return (p.unsqueeze(-2) * v.transpose(-1, -2).unsqueeze(2)).cumsum(-1)[..., -1]


def attend_global(q: Tensor, k: Tensor, v: Tensor, *, sinks: Tensor | None, top_k: int | None,
                   index: Tensor | None, numerics: Numerics) -> tuple[Tensor, Tensor | None]:
    """Causal attention of queries at positions [S - Tq, S) over keys [0, S).

    q (B, H, Tq, d_h); k, v (B, H, S, d_h). With top_k, each query keeps its top_k keys by score (or the
    given `index`, (B, H, Tq, top_k), for a REUSE layer). Returns the output (B, H, Tq, d_h) and the index used.
    Every query row spans all S keys (masked past the diagonal) so a replayed row sees the same row as the
    prefill's and rounds the same way.
    """
    tq, s, d_h = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d_h)
    sparse = top_k is not None and top_k < s
    if numerics is Numerics.FAST and sinks is None and not sparse:
        if tq == s:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True), None
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(tq, s)), None
    acc = acc_dtype(q.dtype)
    scores = _global_scores(q.to(acc), k.to(acc), numerics) * scale  # (B, H, Tq, S)
    qpos = torch.arange(s - tq, s, device=q.device)
    future = torch.arange(s, device=q.device)[None, :] > qpos[:, None]  # (Tq, S)
    scores = scores.masked_fill(future, float("-inf"))
    if sparse:
        assert top_k is not None
        if index is None:
            index = scores.topk(top_k, dim=-1).indices  # (B, H, Tq, top_k)
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, True)
        scores = scores.masked_fill(~keep, float("-inf"))
    p = _softmax(scores, sinks, numerics)
    return _weighted_values(p, v.to(acc), numerics).to(q.dtype), index


def _windows(x: Tensor, rows_from: int, window: int) -> Tensor:
    """x (B, h, S, d_h) -> (B, h, S - rows_from, d_h, W): row r holds x[r - W + 1 .. r] (zeros before row 0)."""
    pad = x.new_zeros(*x.shape[:2], window - 1, x.shape[-1])
    xp = torch.cat((pad, x), dim=2)  # (B, h, W - 1 + S, d_h)
    return xp.unfold(2, window, 1)[:, :, rows_from:].contiguous()  # (B, h, Tq, d_h, W)


def attend_sliding(q: Tensor, k: Tensor, v: Tensor, *, window: int, sinks: Tensor | None,
                    numerics: Numerics) -> Tensor:
    """Queries at the last Tq of the S key positions; each sees its last `window` keys (itself included).

    q (B, H, Tq, d_h); k, v (B, H, S, d_h) -> (B, H, Tq, d_h). The batch-invariant path gathers each query's
    W keys into a fixed-width band, so a query whose window is complete computes the same numbers in a
    prefill, a replay or a decode step.
    """
    tq, s, d_h = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d_h)
    acc = acc_dtype(q.dtype)
    if numerics is Numerics.FAST:
        return _attend_sliding_fast(q, k, v, window=window, sinks=sinks)
    kw = _windows(k.to(acc), s - tq, window).transpose(-1, -2).contiguous()  # (B, H, Tq, W, d_h)
    scores = (q.to(acc).unsqueeze(-2) * kw).sum(-1) * scale  # (B, H, Tq, W)
    slot = torch.arange(window, device=q.device)[None, :]  # slot j holds key row r - W + 1 + j
    rows = torch.arange(s - tq, s, device=q.device)[:, None]
    scores = scores.masked_fill(rows - window + 1 + slot < 0, float("-inf"))
    p = _softmax(scores, sinks, Numerics.BATCH_INVARIANT)
    vw = _windows(v.to(acc), s - tq, window)  # (B, H, Tq, d_h, W)
    return (p.unsqueeze(-2) * vw).sum(-1).to(q.dtype)  # (B, H, Tq, d_h)


def _attend_sliding_fast(q: Tensor, k: Tensor, v: Tensor, *, window: int, sinks: Tensor | None,
                         chunk: int = 2048) -> Tensor:
    """Chunked banded attention: each query chunk attends to its keys plus the W - 1 before it."""
    tq, s = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    outs = []
    for a in range(s - tq, s, chunk):
        b = min(a + chunk, s)
        k0 = max(0, a - window + 1)
        qpos = torch.arange(a, b, device=q.device)[:, None]
        kpos = torch.arange(k0, b, device=q.device)[None, :]
        allowed = (kpos <= qpos) & (kpos > qpos - window)  # (b - a, b - k0)
        qc = q[:, :, a - (s - tq):b - (s - tq)]
        kc, vc = k[:, :, k0:b], v[:, :, k0:b]
        if sinks is None:
            outs.append(F.scaled_dot_product_attention(qc, kc, vc, attn_mask=allowed))
            continue
        acc = acc_dtype(q.dtype)
        scores = (qc.to(acc) @ kc.to(acc).transpose(-1, -2)) * scale
        p = _softmax(scores.masked_fill(~allowed, float("-inf")), sinks, Numerics.FAST)
        outs.append((p @ vc.to(acc)).to(q.dtype))
    return torch.cat(outs, dim=2)

