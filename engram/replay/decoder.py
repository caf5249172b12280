"""`HybridDecoder`: a reference hybrid (global + sliding-window) decoder in pure PyTorch that implements
ReplayModel (model.py), with the sharing patterns of gpt-oss, Gemma 3 and DeepSeek-style REINDEX/REUSE layers,
and global layers of GQA or of MLA (one cached latent per token: DeepSeek-V2/V3).
One sequence per call; the global KV it reads and returns is in the stored layout (T, n_kv, d_h).

What this module does not do: batching several sequences, paged KV, sampling, training. Its arithmetic is in
numerics.py (batch-invariant by default, so a prefill, a replay and a decode step agree bit for bit); its
weights are a pure function of (config, seed) until weights.py loads saved ones.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor, nn

from engram.replay.config import HybridConfig
from engram.replay.model import (
    KV,
    AttentionKind,
    PrefillResult,
    ReplayError,
    ReplayPast,
    ReplaySpec,
    SpanOutput,
)
from engram.replay.numerics import (
    Numerics,
    acc_dtype,
    attend_global,
    attend_sliding,
    linear,
    rope,
    rope_tables,
    silu,
)

GlobalKVTransform = Callable[[Tensor], Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        acc = acc_dtype(x.dtype)
        xa = x.to(acc)
        return (xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    """Pre-norm attention + SwiGLU MLP. REINDEX/REUSE layers have no K/V projections: they read shared KV.
    In an MLA model a non-sliding layer's query is (nope_dim + rope_dim) per head and its output v_head_dim; a
    GLOBAL one compresses into the latent (kv_a: c and k_pe; kv_norm) and decompresses it (kv_b)."""

    def __init__(self, cfg: HybridConfig, kind: AttentionKind) -> None:
        super().__init__()
        self.kind = kind
        self.mla = cfg.mla and kind is not AttentionKind.SLIDING
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        q_dim, o_dim = (cfg.nope_dim + cfg.rope_dim, cfg.v_head_dim) if self.mla else (cfg.head_dim, cfg.head_dim)
        self.q_proj = nn.Parameter(torch.empty(cfg.n_heads * q_dim, cfg.d_model))
        if self.mla and kind is AttentionKind.GLOBAL:
            self.kv_a = nn.Parameter(torch.empty(cfg.kv_lora_rank + cfg.rope_dim, cfg.d_model))
            self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
            self.kv_b = nn.Parameter(torch.empty(cfg.n_heads * (cfg.nope_dim + cfg.v_head_dim), cfg.kv_lora_rank))
        elif kind in (AttentionKind.GLOBAL, AttentionKind.SLIDING):
            self.k_proj = nn.Parameter(torch.empty(cfg.n_kv_heads * cfg.head_dim, cfg.d_model))
            self.v_proj = nn.Parameter(torch.empty(cfg.n_kv_heads * cfg.head_dim, cfg.d_model))
        self.o_proj = nn.Parameter(torch.empty(cfg.d_model, cfg.n_heads * o_dim))
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
        empty = tuple(self._empty_global() for _ in self.config.replay_spec().stored_layers)
        sliding = tuple((self._empty_kv(), self._empty_kv()) for _ in self.config.replay_spec().sliding_layers)
        out = self.forward_span(tokens, ReplayPast(0, empty, sliding), logits=logits)
        return PrefillResult(out.logits, out.global_kv, out.swa_kv, self.config.window)

    def _empty_kv(self) -> Tensor:
        return torch.empty(0, self.config.n_kv_heads, self.config.head_dim, dtype=self.config.dtype,
                           device=self.device)

    def _empty_global(self) -> KV:
        """A stored layer's (K, V) of no tokens: (0, n_kv, d_h) each, or an MLA layer's (c, k_pe)."""
        spec = self.config.replay_spec()
        return tuple(torch.empty(0, *shape, dtype=self.config.dtype, device=self.device)  # type: ignore[return-value]
                     for shape in (spec.global_k_shape, spec.global_v_shape))

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
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.dtype, self.numerics)  # (T, d_h / 2) each
        mla_rope = (rope_tables(positions, cfg.rope_dim, cfg.rope_theta, cfg.dtype, self.numerics) if cfg.mla
                    else (cos, sin))  # (T, rope_dim / 2) each: the MLA layers' decoupled RoPE
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
            c, sn = mla_rope if block.mla else (cos, sin)
            attn = self._attention(block, h, s_in, s_out, end, c[s_in - start:], sn[s_in - start:],
                                   stored, stored_len, swa_past, shared, swa_kv)
            x = x[:, s_out - s_in:] + linear(attn, block.o_proj, self.numerics)  # (1, T_out, d_model)
            hm = block.mlp_norm(x)
            gate = silu(linear(hm, block.gate_proj, self.numerics), self.numerics)
            x = x + linear(gate * linear(hm, block.up_proj, self.numerics), block.down_proj, self.numerics)
        out_logits = None
        if logits:
            out_logits = linear(self.norm(x), self.lm_head, self.numerics)[0]  # (end - starts[-1], vocab)
        return SpanOutput(tuple(swa_kv), tuple(starts[i] for i in spec.sliding_layers), tuple(shared.new_global),
                          out_logits, token_layers)

    def _attention(self, block: Block, h: Tensor, s_in: int, s_out: int, end: int, cos: Tensor, sin: Tensor,
                   stored: KV | None, stored_len: int, swa_past: KV | None, shared: _SharedState,
                   swa_kv: list[KV]) -> Tensor:
        """h (1, T_in, d_model) for positions [s_in, end) -> attention output (1, T_out, H * d_h) for [s_out, end)."""
        cfg, nx = self.config, self.numerics
        if block.mla:
            return self._mla_attention(block, h, s_in, s_out, end, cos, sin, stored, stored_len, shared)
        n_rep = cfg.n_heads // cfg.n_kv_heads
        q = linear(h[:, s_out - s_in:], block.q_proj, nx).view(1, -1, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        q = rope(q, cos[s_out - s_in:], sin[s_out - s_in:])  # (1, H, T_out, d_h)

        def kv_rows(rows: Tensor, c: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
            k = linear(rows, block.k_proj, nx).view(1, -1, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
            v = linear(rows, block.v_proj, nx).view(1, -1, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
            return rope(k, c, s), v  # (1, n_kv, T, d_h) each

        if block.kind is AttentionKind.SLIDING:
            assert swa_past is not None
            k, v = kv_rows(h, cos, sin)
            swa_kv.append((_to_stored(k), _to_stored(v)))
            if q.shape[2] == 0:  # only this layer's KV is needed (the top sliding layer of a cone replay)
                return q.new_empty(1, 0, cfg.n_heads * cfg.head_dim)
            k_all = torch.cat((_from_stored(swa_past[0]), k), dim=2)  # (1, n_kv, n + T_in, d_h)
            v_all = torch.cat((_from_stored(swa_past[1]), v), dim=2)
            out = attend_sliding(q, k_all.repeat_interleave(n_rep, 1), v_all.repeat_interleave(n_rep, 1),
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
        out, new_index = attend_global(q, k_all.repeat_interleave(n_rep, 1), v_all.repeat_interleave(n_rep, 1),
                                        sinks=block.sinks, top_k=cfg.top_k, index=index, numerics=nx)
        if block.kind is not AttentionKind.REUSE:
            shared.index = new_index
        return out.transpose(1, 2).reshape(1, -1, cfg.n_heads * cfg.head_dim)

    def _mla_attention(self, block: Block, h: Tensor, s_in: int, s_out: int, end: int, cos: Tensor, sin: Tensor,
                       stored: KV | None, stored_len: int, shared: _SharedState) -> Tensor:
        """An MLA layer (DeepSeek-V2/V3, the naive form): h (1, T_in, d_model) for [s_in, end) -> (1, T_out,
        H * v_head_dim) for [s_out, end). A GLOBAL layer reads the stored latent (c, k_pe) of every position,
        adds the latent of the positions past it, and decompresses all of it into per-head keys and values
        (what REINDEX/REUSE layers then share); cos, sin are the rope_dim tables."""
        cfg, nx = self.config, self.numerics
        heads, nope, rdim, r = cfg.n_heads, cfg.nope_dim, cfg.rope_dim, cfg.kv_lora_rank
        q = linear(h[:, s_out - s_in:], block.q_proj, nx).view(1, -1, heads, nope + rdim).transpose(1, 2)
        q = torch.cat((q[..., :nope], rope(q[..., nope:], cos[s_out - s_in:], sin[s_out - s_in:])), dim=-1)
        if block.kind is AttentionKind.GLOBAL:
            assert stored is not None
            c_all, pe_all = stored[0][:min(stored_len, end)], stored[1][:min(stored_len, end)]  # (S, 1, r), (S, 1, rope)
            if stored_len < end:
                a = linear(h[:, stored_len - s_in:], block.kv_a, nx)  # (1, T_new, r + rope)
                c = block.kv_norm(a[..., :r])[0].unsqueeze(1)  # (T_new, 1, r)
                pe = rope(a[..., r:].unsqueeze(1), cos[stored_len - s_in:], sin[stored_len - s_in:])  # (1, 1, T_new, rope)
                c, pe = self._transform(c), self._transform(pe[0].transpose(0, 1).contiguous())
                shared.new_global.append((c, pe))
                c_all, pe_all = torch.cat((c_all, c)), torch.cat((pe_all, pe))
            else:
                shared.new_global.append(self._empty_global())
            s = c_all.shape[0]
            kv = linear(c_all[:, 0].unsqueeze(0), block.kv_b, nx).view(1, s, heads, nope + cfg.v_head_dim)
            kv = kv.transpose(1, 2)  # (1, H, S, nope + v)
            k = torch.cat((kv[..., :nope], pe_all[:, 0].view(1, 1, s, rdim).expand(1, heads, s, rdim)), dim=-1)
            shared.kv = (k, kv[..., nope:])
            shared.index = None
        assert shared.kv is not None
        k_all, v_all = shared.kv
        index = None
        if block.kind is AttentionKind.REUSE and shared.index is not None:
            index = shared.index[:, :, -q.shape[2]:]
        out, new_index = attend_global(q, k_all, v_all, sinks=block.sinks, top_k=cfg.top_k, index=index, numerics=nx)
        if block.kind is not AttentionKind.REUSE:
            shared.index = new_index
        return out.transpose(1, 2).reshape(1, -1, heads * cfg.v_head_dim)

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
        swa_shape = (cfg.n_kv_heads, cfg.head_dim)
        for what, kvs, shapes in (("global", past.global_kv, (spec.global_k_shape, spec.global_v_shape)),
                                  ("SWA", past.swa_kv, (swa_shape, swa_shape))):
            for i, (k, v) in enumerate(kvs):
                if (k.ndim != 3 or v.ndim != 3 or k.shape[0] != v.shape[0] or tuple(k.shape[1:]) != shapes[0]
                        or tuple(v.shape[1:]) != shapes[1]):
                    if shapes[0] == shapes[1] == swa_shape:
                        want = f"must both be (T, n_kv_heads={cfg.n_kv_heads}, head_dim={cfg.head_dim})"
                    else:
                        want = f"must be (T, {', '.join(map(str, shapes[0]))}) and (T, {', '.join(map(str, shapes[1]))})"
                    raise ReplayError(f"{what} KV {i}: K {tuple(k.shape)} and V {tuple(v.shape)} {want}")
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

