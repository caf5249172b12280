"""How much a lossy codec loses, measured: the dequantization error of a block against the elements it was
encoded from, and an accumulator of those errors per (codec, tier, layer kind, part).

Two figures per persisted layer and part (K or V), both relative so that they compare across models:
- `rel`: ||x - dq(x)||_2 / ||x||_2, the relative RMS error (NVFP4 on Gaussian data: about 0.1);
- `max_abs`: max |x - dq(x)| / max |x|, the worst element against the block's range.

Only a block whose raw elements the daemon holds can be measured: one it encodes itself (a raw put of a model
with a quantizing codec). A block a worker encoded on its GPU arrives without its raw elements, so nothing is
measured for it (engram/store/quality.py samples only what the daemon encodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

PARTS = ("k", "v")  # a K/V layout's block (L, 2, T, H, D): K at [:, 0], V at [:, 1]


@dataclass(frozen=True)
class LayerError:
    """The error of one persisted layer's part of one block."""

    layer_kind: str  # "global": the only kind whose KV a block holds (engram/layout.py)
    part: str
    rel: float
    max_abs: float


def kv_errors(x: Tensor, dq: Tensor, layer_kinds: Sequence[str]) -> list[LayerError]:
    """Per-layer, per-part errors of a decoded K/V block `dq` against its raw elements `x` (L, 2, T, H, D).
    A part of all zeros that decodes to zeros has no error (0, not NaN)."""
    if x.shape != dq.shape or x.dim() != 5 or x.shape[1] != 2 or len(layer_kinds) != x.shape[0]:
        raise ValueError(f"cannot compare a decoded block {tuple(dq.shape)} with {tuple(x.shape)} "
                         f"({len(layer_kinds)} layer kinds)")
    a = x.detach().to("cpu", torch.float32).flatten(2)  # (L, 2, T*H*D)
    diff = (dq.detach().to("cpu", torch.float32).flatten(2) - a)
    num, den = diff.norm(dim=2), a.norm(dim=2)
    worst, scale = diff.abs().amax(dim=2), a.abs().amax(dim=2)
    rel = torch.where(den > 0, num / den.clamp_min(1e-30), (num > 0).float())
    max_abs = torch.where(scale > 0, worst / scale.clamp_min(1e-30), (worst > 0).float())
    return [LayerError(layer_kinds[layer], PARTS[p], float(rel[layer, p]), float(max_abs[layer, p]))
            for layer in range(a.shape[0]) for p in range(2)]


@dataclass
class ErrorSummary:
    """count, mean and max of both figures over the samples of one (codec, tier, layer kind, part)."""

    samples: int = 0
    rel_sum: float = 0.0
    rel_max: float = 0.0
    max_abs_sum: float = 0.0
    max_abs_max: float = 0.0

    def add(self, e: LayerError) -> None:
        self.samples += 1
        self.rel_sum += e.rel
        self.rel_max = max(self.rel_max, e.rel)
        self.max_abs_sum += e.max_abs
        self.max_abs_max = max(self.max_abs_max, e.max_abs)

    @property
    def rel_mean(self) -> float:
        return self.rel_sum / self.samples if self.samples else 0.0

    @property
    def max_abs_mean(self) -> float:
        return self.max_abs_sum / self.samples if self.samples else 0.0


Key = tuple[str, str, str, str]  # codec, tier, layer kind, part


class ErrorAccumulator:
    """Every measured error, summed per (codec, tier, layer kind, part); the mean per (codec, layer kind) is
    what the lossless fallback compares with its limit."""

    def __init__(self) -> None:
        self.summaries: dict[Key, ErrorSummary] = {}
        self.blocks = 0  # blocks measured

    def add(self, codec: str, tier: str, errors: Sequence[LayerError]) -> None:
        self.blocks += 1
        for e in errors:
            self.summaries.setdefault((codec, tier, e.layer_kind, e.part), ErrorSummary()).add(e)

    def rel_mean(self, codec: str, layer_kind: str) -> tuple[float, int]:
        """The mean relative error of `codec` on layers of `layer_kind`, over every tier and part, and the
        number of samples it is the mean of."""
        total, n = 0.0, 0
        for (c, _, kind, _), s in self.summaries.items():
            if c == codec and kind == layer_kind:
                total += s.rel_sum
                n += s.samples
        return (total / n if n else 0.0), n

    def items(self) -> list[tuple[Key, ErrorSummary]]:
        return sorted(self.summaries.items())
