"""The replay-model contract: what bounded replay (engram/replay/reconstruct.py) needs from a model, and the
types that cross that boundary.

`ReplayModel` is a model's layer pattern and window, and a forward over a span of tokens that reads a provided
past (the stored global KV of every position, and whatever SWA KV precedes the span). The reference
`HybridDecoder` (decoder.py) implements it; so does the HF adapter (hf.py).

Conventions (the daemon's; convert other engines' at the boundary):
- window W counts the keys a sliding query sees *including itself*: the query at t sees t-W+1 .. t.
- KV at this boundary is one sequence, laid out as stored: K and V of one layer are (T, n_kv, d_h), K after RoPE;
  an MLA global layer's pair is its latent c (T, 1, kv_lora_rank) and RoPE key k_pe (T, 1, rope_dim), which
  Engram stores concatenated as one "latent" stream (engram/layout.py), as transformers' DeepseekV3 caches them.
- "stored" layers are the GLOBAL ones; REINDEX/REUSE layers read the nearest preceding GLOBAL layer's KV and
  have none of their own; SLIDING layers' KV is never persisted (replay rebuilds it).

What this module does not do: run a model. The modules of this package, by job:
- model.py (this one): the contract and its types;
- config.py: `HybridConfig`, the reference decoder's shape, and the layer patterns of the models it mimics;
- numerics.py: the ops the decoder runs, batch-invariant or fast;
- decoder.py: `HybridDecoder`, the reference decoder;
- weights.py: saving and loading a decoder's weights with its config;
- reconstruct.py: bounded replay over any ReplayModel; runtime.py: the daemon's replay models; hf.py: the
  transformers adapter.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from engram.errors import InvalidArgument

KV = tuple[Tensor, Tensor]  # K, V of one layer: each (T, n_kv, d_h)


class ReplayError(InvalidArgument, ValueError):
    """Bad input to the replay path (shapes, positions, configs). A ValueError, and an InvalidArgument so the
    gRPC edge maps it like any other malformed request."""


class AttentionKind(enum.StrEnum):
    GLOBAL = "global"  # full causal attention; produces the stored global KV (the "full" layer when sharing)
    SLIDING = "sliding"  # sees the last W keys; KV rebuilt by replay, never stored
    REINDEX = "reindex"  # reads the nearest preceding GLOBAL layer's KV, scores with its own query and own top-K
    REUSE = "reuse"  # reads that KV and reuses the most recent top-K index (of a GLOBAL or REINDEX layer)


GLOBAL_READERS = frozenset({AttentionKind.GLOBAL, AttentionKind.REINDEX, AttentionKind.REUSE})

@dataclass(frozen=True)
class ReplaySpec:
    """What the reconstructor needs to know about a model, whatever implements it."""

    kinds: tuple[AttentionKind, ...]
    window: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    supports_cone: bool = True  # forward_span honours per-layer start positions
    # Per-token shapes of a stored (GLOBAL) layer's two tensors, where they are not the sliding layers'
    # (n_kv_heads, head_dim): an MLA layer stores its latent c (1, kv_lora_rank) and RoPE key k_pe (1, rope_dim).
    global_shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def global_k_shape(self) -> tuple[int, ...]:
        return self.global_shapes[0] if self.global_shapes else (self.n_kv_heads, self.head_dim)

    @property
    def global_v_shape(self) -> tuple[int, ...]:
        return self.global_shapes[1] if self.global_shapes else (self.n_kv_heads, self.head_dim)

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


def window_start(window: int, sliding_layers: int, prefix_len: int) -> int:
    """Where the SWA window of a query at `prefix_len` starts: it sees keys prefix_len-W+1 .. prefix_len and
    computes its own, so [max(0, P-W+1), P), W-1 rows. A model with no sliding layer has no window whatever its
    W: it starts at P (0 rows), as with W = 1. The daemon's Resume, a replay, a decode step and a prefill's
    reference all say so; a prefill's said P-W+1 for such a model, which no Resume ever answers."""
    return max(0, prefix_len - window + 1) if sliding_layers else prefix_len


@dataclass(frozen=True)
class SwaWindow:
    """The sliding layers' KV a query at position `prefix_len` needs: positions [start, prefix_len), where
    start = window_start(W, sliding layers, prefix_len) (its own key, at prefix_len, it computes itself)."""

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
        start = window_start(self.window, len(self.swa_kv), prefix_len)
        return SwaWindow(prefix_len, start, tuple((k[start:prefix_len], v[start:prefix_len]) for k, v in self.swa_kv))


@runtime_checkable
class ReplayModel(Protocol):
    @property
    def replay_spec(self) -> ReplaySpec: ...

    @property
    def device(self) -> torch.device:
        """Where its weights are: stored KV and tokens are moved there for a replay."""
        ...

    def forward_span(self, tokens: Tensor, past: ReplayPast, *, starts: Sequence[int] | None = None,
                     logits: bool = True) -> SpanOutput:
        """Run tokens (T,) for positions [past.start, past.start + T). `starts[l]` (L + 1 entries, non-
        decreasing, starts[0] == past.start) is the first position whose input to layer l is computed; the
        rows of layer l's output start at starts[l + 1]; None runs every row through every layer."""
        ...

