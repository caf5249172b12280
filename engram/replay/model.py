"""The replay-model contract and a reference hybrid (global + sliding-window) decoder in pure PyTorch.

`ReplayModel` is what bounded replay (engram/replay/reconstruct.py) needs from a model: its layer pattern and
window, and a forward over a span of tokens that reads a provided past (the stored global KV of every position,
and whatever SWA KV precedes the span). `HybridDecoder` implements it; so does the HF adapter (hf.py).

Conventions (the daemon's; convert other engines' at the boundary):
- window W counts the keys a sliding query sees *including itself*: the query at t sees t-W+1 .. t.
- KV at this boundary is one sequence, laid out as stored: K and V of one layer are (T, n_kv, d_h), K after RoPE.
- "stored" layers are the GLOBAL ones; REINDEX/REUSE layers read the nearest preceding GLOBAL layer's KV and
  have none of their own; SLIDING layers' KV is never persisted (replay rebuilds it).

What this module does not do: batching several sequences, paged KV, sampling, training. Two numerics:
- BATCH_INVARIANT (default): every op computes a row with the same arithmetic whatever other rows are in the
  call (no BLAS GEMM, whose per-row result depends on the matrix height: measured ~1e-14 in float64 on MKL).
  This is what makes "the replay rebuilds the prefill's SWA KV bit for bit" testable. Slow; for tests.
- FAST: F.linear and scaled_dot_product_attention (the benchmark's path); equal to the reference within rounding.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol, cast, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engram.errors import InvalidArgument

KV = tuple[Tensor, Tensor]  # K, V of one layer: each (T, n_kv, d_h)
GlobalKVTransform = Callable[[Tensor], Tensor]


class ReplayError(InvalidArgument, ValueError):
    """Bad input to the replay path (shapes, positions, configs). A ValueError, and an InvalidArgument so the
    gRPC edge maps it like any other malformed request."""


class AttentionKind(enum.StrEnum):
    GLOBAL = "global"  # full causal attention; produces the stored global KV (the "full" layer when sharing)
    SLIDING = "sliding"  # sees the last W keys; KV rebuilt by replay, never stored
    REINDEX = "reindex"  # reads the nearest preceding GLOBAL layer's KV, scores with its own query and own top-K
    REUSE = "reuse"  # reads that KV and reuses the most recent top-K index (of a GLOBAL or REINDEX layer)


GLOBAL_READERS = frozenset({AttentionKind.GLOBAL, AttentionKind.REINDEX, AttentionKind.REUSE})


class Numerics(enum.StrEnum):
    BATCH_INVARIANT = "batch_invariant"
    FAST = "fast"


def gpt_oss_pattern(n_layers: int) -> tuple[AttentionKind, ...]:
    """gpt-oss: sliding and global layers alternate, starting with a sliding one."""
    return tuple(AttentionKind.SLIDING if i % 2 == 0 else AttentionKind.GLOBAL for i in range(n_layers))


def gemma3_pattern(n_layers: int) -> tuple[AttentionKind, ...]:
    """Gemma 3: five sliding layers, then one global, repeated."""
    return tuple(AttentionKind.GLOBAL if (i + 1) % 6 == 0 else AttentionKind.SLIDING for i in range(n_layers))


def all_sliding_pattern(n_layers: int) -> tuple[AttentionKind, ...]:
    """Mistral-7B-v0.1-like: every layer slides; nothing is stored, everything is replayed."""
    return (AttentionKind.SLIDING,) * n_layers


_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HybridConfig:
    """Shape of a HybridDecoder. Defaults are a tiny model that runs the exactness tests in milliseconds."""

    layers: tuple[AttentionKind, ...]  # one kind per layer; plain strings are accepted and normalized
    window: int = 8  # W: keys a sliding query sees, itself included
    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2  # GQA: query heads share KV heads in groups of n_heads // n_kv_heads
    head_dim: int = 16
    d_ff: int = 128  # SwiGLU hidden width
    rope_theta: float = 10_000.0
    sinks: bool = False  # gpt-oss attention sinks: one learned logit per head in every softmax denominator
    top_k: int | None = None  # GLOBAL/REINDEX layers attend over their top-K keys per query; None = all keys
    norm_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    seed: int = 0  # weights are a pure function of (config, seed)

    def __post_init__(self) -> None:
        try:
            kinds = tuple(AttentionKind(k) for k in self.layers)
        except ValueError as exc:
            raise ReplayError(f"unknown layer kind in {self.layers!r}; use {[k.value for k in AttentionKind]}") from exc
        object.__setattr__(self, "layers", kinds)
        if not kinds:
            raise ReplayError("a model needs at least one layer")
        if self.window < 1:
            raise ReplayError(f"window must be >= 1 (keys a sliding query sees, itself included), got {self.window}")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ReplayError(f"n_heads ({self.n_heads}) must be a positive multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ReplayError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.top_k is not None and self.top_k < 1:
            raise ReplayError(f"top_k must be >= 1 or None (attend to all keys), got {self.top_k}")
        if self.dtype not in _DTYPES.values():
            raise ReplayError(f"dtype {self.dtype} unsupported; use one of {list(_DTYPES)}")
        seen_global = False
        for i, kind in enumerate(kinds):
            if kind in (AttentionKind.REINDEX, AttentionKind.REUSE) and not seen_global:
                raise ReplayError(f"layer {i} is {kind.value} but no global layer precedes it to share KV from; "
                                  "put a 'global' layer first")
            seen_global = seen_global or kind is AttentionKind.GLOBAL

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def replay_spec(self) -> ReplaySpec:
        return ReplaySpec(self.layers, self.window, self.n_kv_heads, self.head_dim, self.dtype)

    def to_json(self) -> str:
        d = asdict(self)
        d["layers"] = [k.value for k in self.layers]
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HybridConfig:
        d = json.loads(text)
        d["layers"] = tuple(d["layers"])
        d["dtype"] = _DTYPES[d["dtype"]]
        return cls(**d)


@dataclass(frozen=True)
class ReplaySpec:
    """What the reconstructor needs to know about a model, whatever implements it."""

    kinds: tuple[AttentionKind, ...]
    window: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    supports_cone: bool = True  # forward_span honours per-layer start positions

    @property
    def stored_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose KV is persisted (the GLOBAL ones), in order."""
        return tuple(i for i, k in enumerate(self.kinds) if k is AttentionKind.GLOBAL)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k is AttentionKind.SLIDING)


@dataclass(frozen=True)
class ReplayPast:
    """The context a span [start, start + T) runs against."""

    start: int
    global_kv: tuple[KV, ...]  # per stored layer: (G, n_kv, d_h) for positions [0, G), G >= start
    swa_kv: tuple[KV, ...]  # per sliding layer: (n, n_kv, d_h) for [start - n, start); n = 0 starts a replay


@dataclass(frozen=True)
class SpanOutput:
    swa_kv: tuple[KV, ...]  # per sliding layer: KV for positions [swa_start[i], end)
    swa_start: tuple[int, ...]
    global_kv: tuple[KV, ...]  # per stored layer: KV the span added past the stored ones, [G, end); empty in a replay
    logits: Tensor | None  # (end - starts[-1], vocab)
    token_layers: int  # (token, layer) pairs run: sum over layers of the rows entering the layer


@dataclass(frozen=True)
class SwaWindow:
    """The sliding layers' KV a query at position `prefix_len` needs: positions [start, prefix_len), where
    start = max(0, prefix_len - W + 1) (its own key, at prefix_len, it computes itself)."""

    prefix_len: int
    start: int
    kv: tuple[KV, ...]  # per sliding layer: (prefix_len - start, n_kv, d_h)


@dataclass(frozen=True)
class PrefillResult:
    logits: Tensor | None  # (T, vocab)
    global_kv: tuple[KV, ...]  # per stored layer, as stored (global_kv_transform applied): (T, n_kv, d_h)
    swa_kv: tuple[KV, ...]  # per sliding layer, every position: (T, n_kv, d_h)
    window: int

    def stored_global_kv(self, prefix_len: int) -> tuple[KV, ...]:
        """What the daemon would hold for the first `prefix_len` tokens."""
        return tuple((k[:prefix_len], v[:prefix_len]) for k, v in self.global_kv)

    def swa_window(self, prefix_len: int) -> SwaWindow:
        """The SWA KV a replay of the first `prefix_len` tokens must rebuild (the reference it is judged by)."""
        start = max(0, prefix_len - self.window + 1)
        return SwaWindow(prefix_len, start, tuple((k[start:prefix_len], v[start:prefix_len]) for k, v in self.swa_kv))


@runtime_checkable
class ReplayModel(Protocol):
    @property
    def replay_spec(self) -> ReplaySpec: ...

    def forward_span(self, tokens: Tensor, past: ReplayPast, *, starts: Sequence[int] | None = None,
                     logits: bool = True) -> SpanOutput:
        """Run tokens (T,) for positions [past.start, past.start + T). `starts[l]` (L + 1 entries, non-
        decreasing, starts[0] == past.start) is the first position whose input to layer l is computed; the
        rows of layer l's output start at starts[l + 1]; None runs every row through every layer."""
        ...


# ---------------------------------------------------------------------------------------------------------
# Numerics. On the CPU a result can depend on more than its inputs: a GEMM's per-row sums on the matrix
# height, a vectorized sum on the row length (masked trailing keys regroup the lanes), an elementwise exp or cos
# on whether the element fell in the SIMD body or the scalar tail of the flat tensor. The batch-invariant ops
# avoid all three, so a position's numbers depend only on the data at positions <= it: a prefill, a longer
# prefill, a replay and a decode step agree bit for bit. (Verified on x86 CPUs; CUDA kernels make no such
# promise.)

_VEC_CHUNK = 16_384  # a multiple of every SIMD width and below ATen's parallel grain (32768): no scalar tail


def _pointwise(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn elementwise, every element through the vectorized kernel (flat size padded, single-threaded chunks)."""
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % 64
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return torch.cat([fn(c) for c in flat.split(_VEC_CHUNK)])[:n].view(x.shape)


def _linear(x: Tensor, w: Tensor, numerics: Numerics) -> Tensor:
    if numerics is Numerics.FAST:
        return F.linear(x, w)
    return (x.unsqueeze(-2) * w).sum(-1)  # (..., T, 1, d_in) * (d_out, d_in) -> (..., T, d_out)


def _silu(x: Tensor, numerics: Numerics) -> Tensor:
    return F.silu(x) if numerics is Numerics.FAST else _pointwise(F.silu, x)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
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


def _rope_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 numerics: Numerics) -> tuple[Tensor, Tensor]:
    # angles in float64 from integer positions: the same position gets the same angle in any span
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, d_h / 2)
    if numerics is Numerics.FAST:
        return angles.cos().to(dtype), angles.sin().to(dtype)
    return _pointwise(torch.cos, angles).to(dtype), _pointwise(torch.sin, angles).to(dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
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


def _attend_global(q: Tensor, k: Tensor, v: Tensor, *, sinks: Tensor | None, top_k: int | None,
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
    acc = _acc_dtype(q.dtype)
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


def _attend_sliding(q: Tensor, k: Tensor, v: Tensor, *, window: int, sinks: Tensor | None,
                    numerics: Numerics) -> Tensor:
    """Queries at the last Tq of the S key positions; each sees its last `window` keys (itself included).

    q (B, H, Tq, d_h); k, v (B, H, S, d_h) -> (B, H, Tq, d_h). The batch-invariant path gathers each query's
    W keys into a fixed-width band, so a query whose window is complete computes the same numbers in a
    prefill, a replay or a decode step.
    """
    tq, s, d_h = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d_h)
    acc = _acc_dtype(q.dtype)
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
        acc = _acc_dtype(q.dtype)
        scores = (qc.to(acc) @ kc.to(acc).transpose(-1, -2)) * scale
        p = _softmax(scores.masked_fill(~allowed, float("-inf")), sinks, Numerics.FAST)
        outs.append((p @ vc.to(acc)).to(q.dtype))
    return torch.cat(outs, dim=2)


# ---------------------------------------------------------------------------------------------------------
# The decoder.


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        acc = _acc_dtype(x.dtype)
        xa = x.to(acc)
        return (xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    """Pre-norm attention + SwiGLU MLP. REINDEX/REUSE layers have no K/V projections: they read shared KV."""

    def __init__(self, cfg: HybridConfig, kind: AttentionKind) -> None:
        super().__init__()
        self.kind = kind
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.q_proj = nn.Parameter(torch.empty(cfg.n_heads * cfg.head_dim, cfg.d_model))
        if kind in (AttentionKind.GLOBAL, AttentionKind.SLIDING):
            self.k_proj = nn.Parameter(torch.empty(cfg.n_kv_heads * cfg.head_dim, cfg.d_model))
            self.v_proj = nn.Parameter(torch.empty(cfg.n_kv_heads * cfg.head_dim, cfg.d_model))
        self.o_proj = nn.Parameter(torch.empty(cfg.d_model, cfg.n_heads * cfg.head_dim))
        self.sinks = nn.Parameter(torch.empty(cfg.n_heads)) if cfg.sinks else None
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.gate_proj = nn.Parameter(torch.empty(cfg.d_ff, cfg.d_model))
        self.up_proj = nn.Parameter(torch.empty(cfg.d_ff, cfg.d_model))
        self.down_proj = nn.Parameter(torch.empty(cfg.d_model, cfg.d_ff))


@dataclass
class _SharedState:
    """KV and top-K index that REINDEX/REUSE layers read from the layers before them."""

    kv: tuple[Tensor, Tensor] | None = None  # (B, n_kv, end, d_h) each
    index: Tensor | None = None  # (B, H, Tq, top_k)
    new_global: list[KV] = field(default_factory=list)


class HybridDecoder(nn.Module):
    """A reference hybrid decoder (gpt-oss / Gemma 3 / DeepSeek-style sharing patterns) that implements
    ReplayModel. One sequence per call; the global KV it reads and returns is in the stored layout."""

    def __init__(self, config: HybridConfig, *, device: torch.device | str | None = None,
                 numerics: Numerics | str = Numerics.BATCH_INVARIANT,
                 global_kv_transform: GlobalKVTransform | None = None) -> None:
        super().__init__()
        self.config = config
        self.numerics = Numerics(numerics)
        # Applied to each GLOBAL layer's K and V in the stored layout (T, n_kv, d_h) before anything attends
        # to them, so a worker's forward sees the same KV the daemon stores and a replay later reads.
        self.global_kv_transform = global_kv_transform
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.d_model))
        self.blocks = nn.ModuleList(Block(config, kind) for kind in config.layers)
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.d_model))
        self._init_weights()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.to(device=device, dtype=config.dtype)
        self.requires_grad_(False)

    def _init_weights(self) -> None:
        # A CPU generator and float32 draws, in parameter-registration order: the same (config, seed) gives the
        # same weights on any machine, device or dtype (up to the final cast).
        gen = torch.Generator().manual_seed(self.config.seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.data = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("sinks") or name == "embed":
                p.data = torch.randn(p.shape, generator=gen)
            else:  # (d_out, d_in): unit-variance outputs, so random attention is far from uniform
                p.data = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])

    @property
    def replay_spec(self) -> ReplaySpec:
        return self.config.replay_spec()

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def prefill(self, tokens: Tensor | Sequence[int], *, logits: bool = True) -> PrefillResult:
        """Run a whole sequence from position 0 (what a serving worker does)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        empty = tuple((self._empty_kv(), self._empty_kv()) for _ in self.config.replay_spec().stored_layers)
        sliding = tuple((self._empty_kv(), self._empty_kv()) for _ in self.config.replay_spec().sliding_layers)
        out = self.forward_span(tokens, ReplayPast(0, empty, sliding), logits=logits)
        return PrefillResult(out.logits, out.global_kv, out.swa_kv, self.config.window)

    def _empty_kv(self) -> Tensor:
        return torch.empty(0, self.config.n_kv_heads, self.config.head_dim, dtype=self.config.dtype,
                           device=self.device)

    @torch.inference_mode()
    def forward_span(self, tokens: Tensor, past: ReplayPast, *, starts: Sequence[int] | None = None,
                     logits: bool = True) -> SpanOutput:
        cfg, spec = self.config, self.config.replay_spec()
        tokens = torch.as_tensor(tokens, dtype=torch.long).to(self.device)
        if tokens.ndim != 1 or tokens.numel() == 0:
            raise ReplayError(f"tokens must be a non-empty 1-D tensor of ids, got shape {tuple(tokens.shape)}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size:
            raise ReplayError(f"token ids must lie in [0, {cfg.vocab_size}); got {int(tokens.min())}.."
                              f"{int(tokens.max())}")
        start, end = past.start, past.start + tokens.numel()
        starts = self._check_starts(starts, start, end)
        stored_len = self._check_past(past, spec, start, end)

        positions = torch.arange(start, end, device=self.device)
        cos, sin = _rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.dtype, self.numerics)  # (T, d_h / 2) each
        x = self.embed[tokens][None]  # (1, T, d_model); rows for positions [starts[0], end)
        shared = _SharedState()
        swa_kv: list[KV] = []
        stored_iter = iter(past.global_kv)
        sliding_iter = iter(past.swa_kv)
        token_layers = 0
        for layer, block in enumerate(cast(list[Block], list(self.blocks))):
            s_in, s_out = starts[layer], starts[layer + 1]
            token_layers += end - s_in
            stored = next(stored_iter) if block.kind is AttentionKind.GLOBAL else None
            swa_past = next(sliding_iter) if block.kind is AttentionKind.SLIDING else None
            if s_in == end:  # nothing of this layer is needed (upper layers of a cone replay)
                if swa_past is not None:
                    swa_kv.append((self._empty_kv(), self._empty_kv()))
                if stored is not None and stored_len < end:
                    raise ReplayError(f"layer {layer} must compute global KV for [{stored_len}, {end}) but starts "
                                      f"skip it; start global layers no later than the stored KV ends")
                continue
            if swa_past is not None and swa_past[0].shape[0] and s_in != start:
                raise ReplayError(f"sliding layer {layer} has SWA past ending at {start} but starts at {s_in}; "
                                  "a layer with a past must start at the span start")
            if stored is not None and s_in > stored_len:
                raise ReplayError(f"global layer {layer} starts at {s_in}, after the stored KV ends ({stored_len}); "
                                  "it could not compute the missing global KV")
            h = block.attn_norm(x)  # (1, T_in, d_model)
            attn = self._attention(block, h, s_in, s_out, end, cos[s_in - start:], sin[s_in - start:],
                                   stored, stored_len, swa_past, shared, swa_kv)
            x = x[:, s_out - s_in:] + _linear(attn, block.o_proj, self.numerics)  # (1, T_out, d_model)
            hm = block.mlp_norm(x)
            gate = _silu(_linear(hm, block.gate_proj, self.numerics), self.numerics)
            x = x + _linear(gate * _linear(hm, block.up_proj, self.numerics), block.down_proj, self.numerics)
        out_logits = None
        if logits:
            out_logits = _linear(self.norm(x), self.lm_head, self.numerics)[0]  # (end - starts[-1], vocab)
        return SpanOutput(tuple(swa_kv), tuple(starts[i] for i in spec.sliding_layers), tuple(shared.new_global),
                          out_logits, token_layers)

    def _attention(self, block: Block, h: Tensor, s_in: int, s_out: int, end: int, cos: Tensor, sin: Tensor,
                   stored: KV | None, stored_len: int, swa_past: KV | None, shared: _SharedState,
                   swa_kv: list[KV]) -> Tensor:
        """h (1, T_in, d_model) for positions [s_in, end) -> attention output (1, T_out, H * d_h) for [s_out, end)."""
        cfg, nx = self.config, self.numerics
        n_rep = cfg.n_heads // cfg.n_kv_heads
        q = _linear(h[:, s_out - s_in:], block.q_proj, nx).view(1, -1, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        q = _rope(q, cos[s_out - s_in:], sin[s_out - s_in:])  # (1, H, T_out, d_h)

        def kv_rows(rows: Tensor, c: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
            k = _linear(rows, block.k_proj, nx).view(1, -1, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
            v = _linear(rows, block.v_proj, nx).view(1, -1, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
            return _rope(k, c, s), v  # (1, n_kv, T, d_h) each

        if block.kind is AttentionKind.SLIDING:
            assert swa_past is not None
            k, v = kv_rows(h, cos, sin)
            swa_kv.append((_to_stored(k), _to_stored(v)))
            if q.shape[2] == 0:  # only this layer's KV is needed (the top sliding layer of a cone replay)
                return q.new_empty(1, 0, cfg.n_heads * cfg.head_dim)
            k_all = torch.cat((_from_stored(swa_past[0]), k), dim=2)  # (1, n_kv, n + T_in, d_h)
            v_all = torch.cat((_from_stored(swa_past[1]), v), dim=2)
            out = _attend_sliding(q, k_all.repeat_interleave(n_rep, 1), v_all.repeat_interleave(n_rep, 1),
                                  window=cfg.window, sinks=block.sinks, numerics=nx)
            return out.transpose(1, 2).reshape(1, -1, cfg.n_heads * cfg.head_dim)

        if block.kind is AttentionKind.GLOBAL:
            assert stored is not None
            k_all, v_all = _from_stored(stored[0][:min(stored_len, end)]), _from_stored(stored[1][:min(stored_len, end)])
            if stored_len < end:
                k, v = kv_rows(h[:, stored_len - s_in:], cos[stored_len - s_in:], sin[stored_len - s_in:])
                k, v = self._transform(_to_stored(k)), self._transform(_to_stored(v))
                shared.new_global.append((k, v))
                k_all = torch.cat((k_all, _from_stored(k)), dim=2)  # (1, n_kv, end, d_h)
                v_all = torch.cat((v_all, _from_stored(v)), dim=2)
            else:
                shared.new_global.append((self._empty_kv(), self._empty_kv()))
            shared.kv = (k_all, v_all)
            shared.index = None
        assert shared.kv is not None
        k_all, v_all = shared.kv
        index = None
        if block.kind is AttentionKind.REUSE and shared.index is not None:
            index = shared.index[:, :, -q.shape[2]:]  # the source layer's rows cover this layer's
        out, new_index = _attend_global(q, k_all.repeat_interleave(n_rep, 1), v_all.repeat_interleave(n_rep, 1),
                                        sinks=block.sinks, top_k=cfg.top_k, index=index, numerics=nx)
        if block.kind is not AttentionKind.REUSE:
            shared.index = new_index
        return out.transpose(1, 2).reshape(1, -1, cfg.n_heads * cfg.head_dim)

    def _transform(self, x: Tensor) -> Tensor:
        if self.global_kv_transform is None:
            return x
        y = self.global_kv_transform(x)
        if y.shape != x.shape:
            raise ReplayError(f"global_kv_transform must keep the shape {tuple(x.shape)}, returned {tuple(y.shape)}")
        return y.to(x.dtype)

    def _check_starts(self, starts: Sequence[int] | None, start: int, end: int) -> list[int]:
        n = self.config.n_layers
        if starts is None:
            return [start] * (n + 1)
        out = [int(s) for s in starts]
        if len(out) != n + 1:
            raise ReplayError(f"starts needs {n + 1} entries (one per layer, then the logits rows), got {len(out)}")
        if out[0] != start or any(b < a for a, b in itertools.pairwise(out)) or out[-1] > end:
            raise ReplayError(f"starts must be non-decreasing from the span start {start} to at most {end}; got {out}")
        return out

    def _check_past(self, past: ReplayPast, spec: ReplaySpec, start: int, end: int) -> int:
        cfg = self.config
        if start < 0:
            raise ReplayError(f"span start must be >= 0, got {start}")
        if len(past.global_kv) != len(spec.stored_layers):
            raise ReplayError(f"expected global KV for {len(spec.stored_layers)} stored layers "
                              f"(layers {spec.stored_layers}), got {len(past.global_kv)}")
        if len(past.swa_kv) != len(spec.sliding_layers):
            raise ReplayError(f"expected SWA past for {len(spec.sliding_layers)} sliding layers, got {len(past.swa_kv)}")
        lengths = set()
        for what, kvs in (("global", past.global_kv), ("SWA", past.swa_kv)):
            for i, (k, v) in enumerate(kvs):
                if k.shape != v.shape or k.ndim != 3 or tuple(k.shape[1:]) != (cfg.n_kv_heads, cfg.head_dim):
                    raise ReplayError(f"{what} KV {i}: K {tuple(k.shape)} and V {tuple(v.shape)} must both be "
                                      f"(T, n_kv_heads={cfg.n_kv_heads}, head_dim={cfg.head_dim})")
                if what == "global":
                    lengths.add(k.shape[0])
        if len(lengths) > 1:
            raise ReplayError(f"stored global KV layers hold different token counts {sorted(lengths)}")
        stored_len = lengths.pop() if lengths else end
        if stored_len < start:
            raise ReplayError(f"stored global KV covers [0, {stored_len}) but the span starts at {start}: "
                              "a global layer would miss keys")
        return min(stored_len, end)


def _to_stored(x: Tensor) -> Tensor:
    return x[0].transpose(0, 1).contiguous()  # (1, n_kv, T, d_h) -> (T, n_kv, d_h)


def _from_stored(x: Tensor) -> Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # (T, n_kv, d_h) -> (1, n_kv, T, d_h)


def save_decoder(model: HybridDecoder, path: str | Path) -> None:
    """Weights plus the config (safetensors metadata), so a load can refuse a mismatched config."""
    from safetensors.torch import save_file

    tensors = {name: p.detach().cpu().contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(path), metadata={"engram.replay.config": model.config.to_json()})


def load_decoder(path: str | Path, *, config: HybridConfig | None = None, device: torch.device | str | None = None,
                 numerics: Numerics | str = Numerics.BATCH_INVARIANT,
                 global_kv_transform: GlobalKVTransform | None = None) -> HybridDecoder:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "engram.replay.config" not in meta:
        raise ReplayError(f"{path} has no engram.replay.config metadata; save it with save_decoder")
    saved = HybridConfig.from_json(meta["engram.replay.config"])
    if config is not None and config != saved:
        raise ReplayError(f"{path} holds weights for {saved}, not the requested {config}; load without a config "
                          "or pass the saved one")
    model = HybridDecoder(saved, device=device, numerics=numerics, global_kv_transform=global_kv_transform)
    state = load_file(str(path), device=str(model.device))
    missing = set(dict(model.named_parameters())) ^ set(state)
    if missing:
        raise ReplayError(f"{path} parameters do not match the config: {sorted(missing)[:5]}")
    for name, p in model.named_parameters():
        p.data.copy_(state[name].to(p.dtype))
    return model
