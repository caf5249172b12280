"""KV layout and model identity: what a block of a given model must look like.

A block carries, for `num_tokens` consecutive tokens, the K and V of every *global* layer of the model:
a tensor of shape (persisted_layers, 2, num_tokens, num_kv_heads, head_dim) in the layout's dtype.
Sliding-window layers are not stored per block: their KV is rebuilt by bounded replay (engram/replay).
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from engram import limits
from engram.errors import InvalidArgument

FINGERPRINT_BYTES = 16


class LayerKind(enum.IntEnum):
    GLOBAL = 1  # full attention; its KV is persisted per block
    SLIDING = 2  # sliding-window attention; its KV is rebuilt by replay (or persisted per session)
    SHARED = 3  # cross-layer sharing: reuses an earlier global layer's KV, has none of its own


class DType(enum.IntEnum):
    """Element types a layout may use; values match the proto enum."""

    BF16 = 1
    FP16 = 2
    FP32 = 3

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self]

    @property
    def itemsize(self) -> int:
        return _TORCH_DTYPES[self].itemsize

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> DType:
        for member, td in _TORCH_DTYPES.items():
            if td == dtype:
                return member
        raise InvalidArgument(f"unsupported KV dtype {dtype}; use one of bfloat16, float16, float32")


_TORCH_DTYPES = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16, DType.FP32: torch.float32}


@dataclass(frozen=True)
class LayerSpec:
    kind: LayerKind
    window: int = 0  # keys a sliding query sees, its own included; 0 for global layers

    def __post_init__(self) -> None:
        if self.kind == LayerKind.SLIDING and self.window < 1:
            raise InvalidArgument("a sliding layer needs window >= 1 (keys seen, the query's own included)")
        if self.window > limits.MAX_WINDOW:
            raise InvalidArgument(f"a sliding window of {self.window} keys exceeds the bound of {limits.MAX_WINDOW}")
        if self.kind != LayerKind.SLIDING and self.window != 0:
            raise InvalidArgument(f"a {self.kind.name.lower()} layer has no window; leave window at 0")


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerSpec, ...]
    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.BF16
    block_tokens: int = 256

    def __post_init__(self) -> None:
        if not self.layers:
            raise InvalidArgument("a layout needs at least one layer")
        limits.check_dimension("a layout's number of layers", len(self.layers), 1, limits.MAX_LAYERS)
        if self.persisted_layers == 0:
            raise InvalidArgument("the layout has no global layer, so a block would carry no KV; "
                                  "mark at least one layer LAYER_KIND_GLOBAL")
        limits.check_dimension("num_kv_heads", self.num_kv_heads, 1, limits.MAX_KV_HEADS)
        limits.check_dimension("head_dim", self.head_dim, 1, limits.MAX_HEAD_DIM)
        bt = self.block_tokens
        if bt < 16 or bt & (bt - 1) or bt > limits.MAX_BLOCK_TOKENS:
            raise InvalidArgument(f"block_tokens must be a power of two in [16, {limits.MAX_BLOCK_TOKENS}], got {bt}")

    @property
    def persisted_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == LayerKind.GLOBAL)

    def block_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        # (persisted layers, K/V, tokens, kv heads, head dim)
        return (self.persisted_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    def block_nbytes(self, num_tokens: int) -> int:
        return self.persisted_layers * 2 * num_tokens * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def bytes_per_token(self) -> int:
        return self.block_nbytes(1)

    def all_layers_bytes_per_token(self) -> int:
        """What a cache that keeps every layer's KV (sliding ones too, as LMCache does) stores per token."""
        own = sum(1 for layer in self.layers if layer.kind != LayerKind.SHARED)
        return own * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def canonical(self) -> bytes:
        """A stable byte form for fingerprints: independent of Python and protobuf versions."""
        parts = [f"dtype={self.dtype.name}", f"kvh={self.num_kv_heads}", f"hd={self.head_dim}",
                 f"bt={self.block_tokens}"]
        parts += [f"{layer.kind.name}:{layer.window}" for layer in self.layers]
        return ";".join(parts).encode()


@dataclass(frozen=True)
class ModelSpec:
    """A model as the daemon knows it. A change to any field gives a new fingerprint, so blocks of
    old weights (or another codec) never match new requests."""

    name: str
    weights_id: str
    layout: KVLayout
    codec: str = ""  # "" = the daemon's default codec (the registry fills it in)

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgument("a model needs a name")
        if not self.weights_id:
            raise InvalidArgument("a model needs a weights_id (a checkpoint hash or revision)")
        limits.check_length("the model's name", self.name, limits.MAX_NAME_BYTES)
        limits.check_length("the model's weights_id", self.weights_id, limits.MAX_NAME_BYTES)

    def to_dict(self) -> dict[str, object]:
        lay = self.layout
        return {"name": self.name, "weights_id": self.weights_id, "codec": self.codec, "layout": {
            "layers": [[layer.kind.name, layer.window] for layer in lay.layers], "num_kv_heads": lay.num_kv_heads,
            "head_dim": lay.head_dim, "dtype": lay.dtype.name, "block_tokens": lay.block_tokens}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        lay = d["layout"]
        layout = KVLayout(layers=tuple(LayerSpec(LayerKind[k], w) for k, w in lay["layers"]),
                          num_kv_heads=lay["num_kv_heads"], head_dim=lay["head_dim"], dtype=DType[lay["dtype"]],
                          block_tokens=lay["block_tokens"])
        return cls(d["name"], d["weights_id"], layout, d.get("codec", "raw"))

    @property
    def fingerprint(self) -> bytes:
        h = hashlib.blake2b(b"engram/model-fingerprint/v1", digest_size=FINGERPRINT_BYTES)
        for field in (self.name.encode(), self.weights_id.encode(), self.layout.canonical(), self.codec.encode()):
            h.update(len(field).to_bytes(4, "little"))
            h.update(field)
        return h.digest()
