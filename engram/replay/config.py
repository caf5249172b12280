"""`HybridConfig`: the shape of a reference HybridDecoder, checked on construction, and the layer patterns of the
models it mimics (gpt-oss, Gemma 3, Mistral, the seed's Full/Reindex/Reuse sharing; GQA or MLA global layers). Weights are a pure function of (config, seed), so a config
plus a seed names a model; a config is also what a saved decoder carries in its metadata (weights.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from engram.replay.model import AttentionKind, ReplayError, ReplaySpec


def gpt_oss_pattern(n_layers: int) -> tuple[AttentionKind, ...]:
    """gpt-oss: sliding and global layers alternate, starting with a sliding one."""
    return tuple(AttentionKind.SLIDING if i % 2 == 0 else AttentionKind.GLOBAL for i in range(n_layers))


def gemma3_pattern(n_layers: int) -> tuple[AttentionKind, ...]:
    """Gemma 3: five sliding layers, then one global, repeated."""
    return tuple(AttentionKind.GLOBAL if (i + 1) % 6 == 0 else AttentionKind.SLIDING for i in range(n_layers))


def all_sliding_pattern(n_layers: int) -> tuple[AttentionKind, ...]:
    """Mistral-7B-v0.1-like: every layer slides; nothing is stored, everything is replayed."""
    return (AttentionKind.SLIDING,) * n_layers


def csa_pattern(n_layers: int) -> tuple[AttentionKind, ...]:
    """The seed model's sharing (BRIEF section 1) beside sliding layers: sliding, Full (global), sliding,
    Reindex, sliding, Reuse, repeated. With `attention="mla"` the Full layers cache one latent per token."""
    cycle = (AttentionKind.SLIDING, AttentionKind.GLOBAL, AttentionKind.SLIDING, AttentionKind.REINDEX,
             AttentionKind.SLIDING, AttentionKind.REUSE)
    return tuple(cycle[i % len(cycle)] for i in range(n_layers))


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
    # "mla": the global layers are DeepSeek-V2/V3 multi-head latent attention: they cache, per token, a normalized
    # latent c (kv_lora_rank) and one RoPE key k_pe (rope_dim) shared by every head, and decompress them into
    # n_heads keys (nope_dim + rope_dim) and values (v_head_dim) for attention. Sliding layers stay GQA
    # (n_kv_heads x head_dim), as the sliding branches beside latent global layers in the seed's design.
    attention: str = "gqa"
    kv_lora_rank: int = 0
    rope_dim: int = 0
    nope_dim: int = 0
    v_head_dim: int = 0

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
        if self.attention not in ("gqa", "mla"):
            raise ReplayError(f"attention must be 'gqa' or 'mla', got {self.attention!r}")
        mla = (self.kv_lora_rank, self.rope_dim, self.nope_dim, self.v_head_dim)
        if self.attention == "mla" and (min(mla) < 1 or self.rope_dim % 2):
            raise ReplayError(f"an MLA model needs kv_lora_rank, rope_dim (even), nope_dim and v_head_dim >= 1, "
                              f"got {mla}")
        if self.attention == "gqa" and any(mla):
            raise ReplayError("kv_lora_rank, rope_dim, nope_dim and v_head_dim are MLA's: set attention='mla' "
                              "or leave them 0")
        seen_global = False
        for i, kind in enumerate(kinds):
            if kind in (AttentionKind.REINDEX, AttentionKind.REUSE) and not seen_global:
                raise ReplayError(f"layer {i} is {kind.value} but no global layer precedes it to share KV from; "
                                  "put a 'global' layer first")
            seen_global = seen_global or kind is AttentionKind.GLOBAL

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def mla(self) -> bool:
        return self.attention == "mla"

    def replay_spec(self) -> ReplaySpec:
        shapes = ((1, self.kv_lora_rank), (1, self.rope_dim)) if self.mla else None
        return ReplaySpec(self.layers, self.window, self.n_kv_heads, self.head_dim, self.dtype, global_shapes=shapes)

    def to_json(self) -> str:
        d = asdict(self)
        d["layers"] = [k.value for k in self.layers]
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        if not self.mla:  # a GQA model's JSON (and so its weights identity) is what it was before MLA existed
            for key in ("attention", "kv_lora_rank", "rope_dim", "nope_dim", "v_head_dim"):
                del d[key]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HybridConfig:
        d = json.loads(text)
        d["layers"] = tuple(d["layers"])
        d["dtype"] = _DTYPES[d["dtype"]]
        return cls(**d)

