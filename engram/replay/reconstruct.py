"""Bounded replay: rebuild the sliding-window layers' KV of a session from its tokens and stored global KV.

A session that went cold keeps only its global layers' KV. To resume it, the SWA layers need their KV for the
last window: a query at position P sees keys P-W+1 .. P, so positions [P-W+1, P) must be rebuilt (P computes
its own). Replay re-runs the last R tokens, [P-R, P), through the model: every global layer reads the STORED
KV of every position (the replayed ones too; recomputing it would leave an error that never vanishes), and the
SWA layers start with no past. A sliding layer's output at t is exact once all of t's W keys were computed
from exact inputs, so each sliding layer pushes the first exact position W-1 further right; after L_swa of
them the last window is exact iff R >= L_swa * (W - 1). See docs/REPLAY.md for the derivation.

What this module does not do: fetch or decode stored blocks, choose a mode for a session (the policy does),
or batch several sessions into one replay.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engram.replay.model import (
    KV,
    AttentionKind,
    ReplayError,
    ReplayModel,
    ReplayPast,
    ReplaySpec,
    SwaWindow,
    window_start,
)


class ReplayKind(enum.StrEnum):
    EXACT = "exact"  # R = L_swa * (W - 1): bit-exact given batch-invariant kernels
    APPROX = "approx"  # R = ceil(k * W): error shrinks about geometrically with k (SGLang's DSV4 offload: k = 1)
    FIXED = "fixed"  # R = a given token count (experiments, e.g. one short of the exact bound)


@dataclass(frozen=True)
class ReplayMode:
    kind: ReplayKind
    k: float = 0.0  # APPROX only
    tokens: int = 0  # FIXED only

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ReplayKind(self.kind))
        if self.kind is ReplayKind.APPROX and not self.k > 0:
            raise ReplayError(f"approx replay needs k > 0 (R = ceil(k * W)), got k={self.k}")
        if self.kind is ReplayKind.FIXED and self.tokens < 0:
            raise ReplayError(f"fixed replay needs tokens >= 0, got {self.tokens}")

    @classmethod
    def exact(cls) -> ReplayMode:
        return cls(ReplayKind.EXACT)

    @classmethod
    def approx(cls, k: float) -> ReplayMode:
        return cls(ReplayKind.APPROX, k=k)

    @classmethod
    def fixed(cls, tokens: int) -> ReplayMode:
        return cls(ReplayKind.FIXED, tokens=tokens)


def exact_bound(spec: ReplaySpec) -> int:
    """L_swa * (W - 1): the shortest replay whose last window is exact for any prefix longer than it."""
    return len(spec.sliding_layers) * (spec.window - 1)


_REPLAY_LENGTH: dict[ReplayKind, Callable[[ReplaySpec, ReplayMode], int]] = {
    ReplayKind.EXACT: lambda spec, mode: exact_bound(spec),
    ReplayKind.APPROX: lambda spec, mode: math.ceil(mode.k * spec.window),
    ReplayKind.FIXED: lambda spec, mode: mode.tokens,
}


def replay_length(spec: ReplaySpec, mode: ReplayMode, prefix_len: int) -> int:
    """R for a mode, clamped to the exact bound (a longer replay changes nothing) and to the prefix (a replay
    cannot start before token 0; from 0 it is exact)."""
    return min(_REPLAY_LENGTH[mode.kind](spec, mode), exact_bound(spec), prefix_len)


def layer_starts(spec: ReplaySpec, prefix_len: int, replayed: int, *, cone: bool = True) -> tuple[int, ...]:
    """First position each layer's input is computed at (L + 1 entries; the last is for the final norm).

    Flat: every layer from P - R. Cone: walk down from the top; nothing above the last sliding layer is needed;
    a sliding layer whose outputs are needed from position s needs its input (its K/V) from s - (W - 1),
    global layers read stored KV and need no more than their outputs. Clamped to P - R, so a cone replay
    computes the same rows a flat one would wherever they matter, and fewer of them.
    """
    first = prefix_len - replayed
    n = len(spec.kinds)
    if not cone:
        return (first,) * (n + 1)
    starts = [prefix_len] * (n + 1)
    need = prefix_len  # first position whose output of layer l is read by a layer above
    for layer in reversed(range(n)):
        if spec.kinds[layer] is AttentionKind.SLIDING:
            need -= spec.window - 1  # its window reaches W-1 back; its own KV is needed from P-W+1 >= need
        starts[layer] = max(first, need)
    return tuple(starts)


@dataclass(frozen=True)
class Reconstruction:
    window: SwaWindow  # the rebuilt SWA KV, ready for decode_next
    mode: ReplayMode
    replayed: int  # R: tokens re-run, positions [P - R, P)
    starts: tuple[int, ...]  # per-layer first input position (see layer_starts)
    token_layers: int  # (token, layer) pairs this replay ran
    flat_token_layers: int  # what a flat replay of the same R runs: L * R


def as_layer_kv(global_kv: Sequence[KV] | Tensor, spec: ReplaySpec, prefix_len: int,
                device: torch.device | None = None, *, exact_rows: bool = False) -> tuple[KV, ...]:
    """Normalize stored global KV to one (K, V) per stored layer, (P, *shape) each (spec.global_k_shape and
    global_v_shape: (n_kv, d_h), or an MLA layer's (1, kv_lora_rank) and (1, rope_dim)), in the model's dtype.

    Accepts a sequence of (K, V); one tensor in the block layout of engram.layout, (stored_layers, 2, T, n_kv,
    d_h); or an MLA model's latent stream as Engram stores it, (stored_layers, T, kv_lora_rank + rope_dim). T >= P
    (rows past P are ignored) or, with exact_rows, T == P.
    """
    k_shape, v_shape = spec.global_k_shape, spec.global_v_shape
    k_width = int(torch.Size(k_shape).numel())
    if isinstance(global_kv, Tensor):
        if global_kv.ndim == 3 and global_kv.shape[-1] == k_width + int(torch.Size(v_shape).numel()):
            t = global_kv.shape[1]
            pairs = [(layer[:, :k_width].reshape(t, *k_shape), layer[:, k_width:].reshape(t, *v_shape))
                     for layer in global_kv]
        elif global_kv.ndim == 5 and global_kv.shape[1] == 2 and k_shape == v_shape:
            pairs = [(layer[0], layer[1]) for layer in global_kv]
        else:
            forms = ("(stored_layers, T, latent width) or " if spec.global_shapes else "") + \
                "(stored_layers, 2, T, n_kv, d_h)"
            raise ReplayError(f"stored global KV as one tensor must be {forms}, got {tuple(global_kv.shape)}")
    else:
        pairs = [tuple(p) for p in global_kv]  # type: ignore[misc]
    if len(pairs) != len(spec.stored_layers):
        raise ReplayError(f"the model stores {len(spec.stored_layers)} global layers (layers {spec.stored_layers}); "
                          f"got KV for {len(pairs)}")
    out = []
    for i, pair in enumerate(pairs):
        if len(pair) != 2:
            raise ReplayError(f"stored layer {i}: expected a (K, V) pair, got {len(pair)} tensors")
        k, v = pair
        for name, t, want in (("K", k, k_shape), ("V", v, v_shape)):
            rows_ok = t.shape[0] == prefix_len if exact_rows else t.shape[0] >= prefix_len
            if t.ndim != 1 + len(want) or tuple(t.shape[1:]) != tuple(want) or not rows_ok:
                rows = str(prefix_len) if exact_rows else f">= {prefix_len}"
                dims = ", ".join(map(str, want)) if spec.global_shapes else \
                    f"n_kv_heads={want[0]}, head_dim={want[1]}"
                raise ReplayError(f"stored layer {i} {name} has shape {tuple(t.shape)}; need ({rows}, {dims}) for "
                                  f"a prefix of {prefix_len} tokens")
        out.append((k[:prefix_len].to(device=device, dtype=spec.dtype),
                    v[:prefix_len].to(device=device, dtype=spec.dtype)))
    return tuple(out)


def _model_device(model: ReplayModel) -> torch.device | None:
    return getattr(model, "device", None)


def _check_tokens(tokens: Tensor | Sequence[int], prefix_len: int | None) -> tuple[Tensor, int]:
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.ndim != 1:
        raise ReplayError(f"tokens must be 1-D (one session), got shape {tuple(tokens.shape)}")
    p = tokens.numel() if prefix_len is None else int(prefix_len)
    if p <= 0:
        raise ReplayError(f"prefix length must be >= 1 token, got {p}; a session with no tokens has nothing to replay")
    if p > tokens.numel():
        raise ReplayError(f"prefix length {p} is past the end of the {tokens.numel()} tokens given; pass the tokens "
                          "[0, P) or a smaller prefix_len")
    return tokens[:p], p


def reconstruct_swa(model: ReplayModel, tokens: Tensor | Sequence[int], global_kv: Sequence[KV] | Tensor,
                    mode: ReplayMode | None = None, *, prefix_len: int | None = None,
                    cone: bool | None = None) -> Reconstruction:
    """Rebuild every sliding layer's KV for positions [max(0, P-W+1), P) by replaying [P-R, P).

    tokens: the session's ids for at least [0, P); global_kv: the stored KV of [0, P) (see as_layer_kv).
    cone: None uses a cone replay when the model supports it; True insists; False runs flat.
    """
    mode = mode or ReplayMode.exact()
    spec = model.replay_spec
    tokens, p = _check_tokens(tokens, prefix_len)
    stored = as_layer_kv(global_kv, spec, p, _model_device(model))
    if cone and not spec.supports_cone:
        raise ReplayError("this model's forward_span runs every layer over the same rows; pass cone=False")
    use_cone = spec.supports_cone if cone is None else cone
    r = replay_length(spec, mode, p)
    starts = layer_starts(spec, p, r, cone=use_cone)
    n_layers = len(spec.kinds)
    # Rows [P-W+1, P) when R >= W-1; a shorter replay (approx with k < 1) yields a shorter window [P-R, P),
    # which decode_next attends to as it is: fewer keys, not made-up ones.
    w_start = max(window_start(spec.window, len(spec.sliding_layers), p), p - r)
    if r == 0 or not spec.sliding_layers:  # W = 1, R = 0 or no sliding layer: nothing to rebuild
        return Reconstruction(empty_window(model, p), mode, 0, starts, 0, 0)
    past = ReplayPast(p - r, stored, tuple((_empty(spec, model), _empty(spec, model)) for _ in spec.sliding_layers))
    out = model.forward_span(tokens[p - r:], past, starts=starts, logits=False)
    # every sliding layer's first computed row is <= w_start (the last one's is exactly P-W+1 in a cone)
    kv = tuple((k[w_start - first:], v[w_start - first:])
               for (k, v), first in zip(out.swa_kv, out.swa_start, strict=True))
    return Reconstruction(SwaWindow(p, w_start, kv), mode, r, starts, out.token_layers, n_layers * r)


def nothing_to_rebuild(spec: ReplaySpec) -> bool:
    """W = 1 or no sliding layer: a query's window holds no row, so any replay runs no token (the exact bound
    is 0) and the window is `empty_window`, with no need of the prefix's tokens or stored KV."""
    return exact_bound(spec) == 0


def empty_window(model: ReplayModel, prefix_len: int) -> SwaWindow:
    """A window of 0 rows at prefix_len, one (K, V) pair per sliding layer: a replay of R = 0."""
    spec = model.replay_spec
    return SwaWindow(prefix_len, prefix_len,
                     tuple((_empty(spec, model), _empty(spec, model)) for _ in spec.sliding_layers))


def _empty(spec: ReplaySpec, model: ReplayModel) -> Tensor:
    return torch.empty(0, spec.n_kv_heads, spec.head_dim, dtype=spec.dtype, device=_model_device(model))


@dataclass(frozen=True)
class DecodeStep:
    logits: Tensor  # (vocab,) for the position after the prefix
    global_kv: tuple[KV, ...]  # per stored layer: the new token's KV (1, n_kv, d_h), to append to storage
    window: SwaWindow  # the SWA window for the next position


def decode_next(model: ReplayModel, token: int | Tensor, global_kv: Sequence[KV] | Tensor,
                window: SwaWindow) -> DecodeStep:
    """Run the token at position P = window.prefix_len against stored global KV [0, P) and the SWA window."""
    spec = model.replay_spec
    p = window.prefix_len
    if len(window.kv) != len(spec.sliding_layers):
        raise ReplayError(f"the window holds {len(window.kv)} sliding layers; the model has {len(spec.sliding_layers)}")
    # The one rule (window_start), whatever the layers hold: without a sliding layer the window starts at P, and
    # a start before it (P-W+1, the old prefill's) or past it (a window of negative rows, handed on to the next
    # step) was taken, as no layer's rows were there to be counted against it.
    first = window_start(spec.window, len(spec.sliding_layers), p)
    if not first <= window.start <= p:
        rule = (f"at {p} (no sliding layer, or W = 1: it holds no row)" if nothing_to_rebuild(spec) else
                f"at {first} (W={spec.window}), or up to {p} after a shorter replay")
        raise ReplayError(f"the window of a query at {p} starts {rule}; not at {window.start}")
    for i, (k, v) in enumerate(window.kv):
        if k.shape != v.shape or k.shape[0] != p - window.start:
            raise ReplayError(f"sliding layer {i}: K {tuple(k.shape)} and V {tuple(v.shape)} must be alike and hold "
                              f"{p - window.start} rows, for [{window.start}, {p})")
    # exactly [0, P): more rows would mean the window is stale (or the new token's KV is already appended)
    stored = as_layer_kv(global_kv, spec, p, _model_device(model), exact_rows=True)
    tok = torch.as_tensor(token, dtype=torch.long).reshape(1)
    out = model.forward_span(tok, ReplayPast(p, stored, window.kv), logits=True)
    assert out.logits is not None
    # rows the query at P + 1 reads: at most W - 1, none without a sliding layer
    keep = p + 1 - max(window.start, window_start(spec.window, len(spec.sliding_layers), p + 1))
    kv = tuple((torch.cat((wk, k), 0)[len(wk) + 1 - keep:], torch.cat((wv, v), 0)[len(wv) + 1 - keep:])
               for (wk, wv), (k, v) in zip(window.kv, out.swa_kv, strict=True))
    return DecodeStep(out.logits[-1], out.global_kv, SwaWindow(p + 1, p + 1 - keep, kv))


def window_error(rebuilt: SwaWindow, reference: SwaWindow) -> float:
    """Largest |rebuilt - reference| over every sliding layer's K and V, relative to the reference's largest |x|."""
    if rebuilt.start != reference.start or rebuilt.prefix_len != reference.prefix_len:
        raise ReplayError(f"windows cover different positions: [{rebuilt.start}, {rebuilt.prefix_len}) vs "
                          f"[{reference.start}, {reference.prefix_len})")
    err, scale = 0.0, 0.0
    for (rk, rv), (fk, fv) in zip(rebuilt.kv, reference.kv, strict=True):
        for a, b in ((rk, fk), (rv, fv)):
            if a.numel():
                err = max(err, (a.double() - b.to(a.device).double()).abs().max().item())
                scale = max(scale, b.double().abs().max().item())
    return err / scale if scale else err
