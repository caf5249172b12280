"""KV layout and model identity: what a block of a given model must look like.

A block carries, for `num_tokens` consecutive tokens, what the model's *persisting* layers produce. Two kinds of
layout describe it:

- The K/V layout (no `streams`; every layout made before streams existed): K and V of every GLOBAL layer, one
  tensor (persisted_layers, 2, num_tokens, num_kv_heads, head_dim) in the layout's dtype. Its blocks are raw
  elements or block format v1 (engram/codec/blockformat.py), and its fingerprint is what it always was.
- A stream layout (`streams` given): named streams per persisting layer, each with its own per-entry shape,
  dtype, codec, grouping axis and token compression: "k" and "v" (MHA/GQA), "latent" (MLA: kv_lora_rank +
  rope dims, no K/V split), "index_k" (a sparse-attention indexer key), ... A block holds, per stream, a tensor
  (layers producing it, entries, *shape) where entries = tokens // compress; its stored form is block format
  v2 (engram/codec/streamformat.py), each stream's payload in its codec.

Layers, by kind: GLOBAL layers produce every stream of the layout (a "Full" layer in cross-layer sharing);
SHARED, REINDEX and REUSE layers read an earlier GLOBAL layer's streams and store nothing (REINDEX re-scores
with its own indexer query, REUSE also reuses the top-K; the difference is the model's, recorded so the
fingerprint sees it); SLIDING layers' KV is not stored per block: bounded replay rebuilds it (engram/replay).
In a stream layout a non-sliding layer may also carry a sliding-window branch of its own (`window` > 0, as
DeepSeek-V4's layers do); `window_streams` describes what each such branch or sliding layer keeps per token,
so the bytes a cache that persisted every layer would hold can be counted.

What it does not describe: a layer that produces only some of the streams (every GLOBAL layer produces all).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from engram import limits
from engram.errors import InvalidArgument, brief

FINGERPRINT_BYTES = 16
MAX_STREAMS = 16  # block format v2 counts streams in one byte; a real model has 1-3
STREAM_NAME = re.compile(r"[a-z][a-z0-9_]{0,7}")  # v2 holds a stream's name in 8 bytes (fullmatch: no "\n")


class LayerKind(enum.IntEnum):
    GLOBAL = 1  # full attention; its KV (its streams) is persisted per block: a "Full" layer when sharing
    SLIDING = 2  # sliding-window attention; its KV is rebuilt by replay (or persisted per session)
    SHARED = 3  # cross-layer sharing: reuses an earlier global layer's KV, has none of its own
    REINDEX = 4  # reuses an earlier global layer's streams (KV and indexer keys), re-scores with its own query
    REUSE = 5  # reuses an earlier global layer's streams and the top-K index of the layer before it


STORES_NOTHING = frozenset({LayerKind.SHARED, LayerKind.REINDEX, LayerKind.REUSE})


class DType(enum.IntEnum):
    """Element types a layout may use; values match the proto enum."""

    BF16 = 1
    FP16 = 2
    FP32 = 3
    FP64 = 4  # exactness tests of replay on the CPU (bit-identical logits); stored raw only

    @property
    def torch_dtype(self) -> torch.dtype:
        return _torch_dtypes()[self]

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> DType:
        for member, td in _torch_dtypes().items():
            if td == dtype:
                return member
        raise InvalidArgument(f"unsupported KV dtype {dtype}; use one of bfloat16, float16, float32, float64")


_ITEMSIZE = {DType.BF16: 2, DType.FP16: 2, DType.FP32: 4, DType.FP64: 8}


@functools.cache
def _torch_dtypes() -> dict[DType, torch.dtype]:
    """Imported on first use: the CLI's inspection commands read layouts without loading torch (seconds)."""
    import torch

    return {DType.BF16: torch.bfloat16, DType.FP16: torch.float16, DType.FP32: torch.float32,
            DType.FP64: torch.float64}


class Axis(enum.IntEnum):
    """Along which axis a quantizing codec's groups (the elements sharing one scale) run."""

    CHANNEL = 0  # groups of consecutive entries (tokens) within one (layer, channel): outlier channels (K)
    TOKEN = 1  # groups along the entry's last dimension within one (layer, entry, ...): V, latents, index keys


@dataclass(frozen=True)
class LayerSpec:
    kind: LayerKind
    window: int = 0  # keys a sliding query sees, its own included; on a non-sliding layer, its own SWA branch

    def __post_init__(self) -> None:
        if self.kind == LayerKind.SLIDING and self.window < 1:
            raise InvalidArgument("a sliding layer needs window >= 1 (keys seen, the query's own included)")
        if self.window > limits.MAX_WINDOW:
            raise InvalidArgument(f"a sliding window of {self.window} keys exceeds the bound of {limits.MAX_WINDOW}")
        if self.window < 0 or (self.kind == LayerKind.SHARED and self.window != 0):
            raise InvalidArgument(f"a {self.kind.name.lower()} layer has no window; leave window at 0")

    @property
    def windowed(self) -> bool:
        """Whether the layer keeps sliding-window KV of its own (rebuilt by replay, never stored per block)."""
        return self.window > 0


@dataclass(frozen=True)
class StreamSpec:
    """One named stream of a stream layout: what a persisting layer keeps per entry (one entry per `compress`
    tokens), decoded to `dtype`, stored in `codec` ("" = the model's codec; "raw" keeps it bit for bit) with the
    codec's groups along `axis`."""

    name: str
    shape: tuple[int, ...]  # per entry: (kv_heads, head_dim) for K or V, (576,) for an MLA latent, (128,) ...
    dtype: DType = DType.BF16
    codec: str = ""
    axis: Axis = Axis.TOKEN
    compress: int = 1  # tokens per entry: 1, or a compressed-attention ratio (DeepSeek-V4's CSA: 4)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "axis", Axis(self.axis))
        object.__setattr__(self, "dtype", DType(self.dtype))
        if not STREAM_NAME.fullmatch(self.name):
            raise InvalidArgument(f"stream name {brief(self.name)!r}: use 1-8 characters a-z, 0-9, _ starting with a letter")
        if not 1 <= len(self.shape) <= 3 or any(d < 1 for d in self.shape):
            raise InvalidArgument(f"stream {self.name}: shape {self.shape} must have 1-3 dimensions, each >= 1")
        # the K/V layout's bound per token (MAX_KV_HEADS heads of MAX_HEAD_DIM), per stream
        limits.check_dimension(f"stream {self.name}'s elements per entry", self.width, 1,
                               limits.MAX_KV_HEADS * limits.MAX_HEAD_DIM)
        c = self.compress
        if c < 1 or c & (c - 1):
            raise InvalidArgument(f"stream {self.name}: compress={c} must be a power of two >= 1 (tokens per entry)")

    @property
    def width(self) -> int:
        """Elements per entry."""
        return math.prod(self.shape)

    def entries(self, num_tokens: int) -> int:
        """Entries a block of num_tokens holds: a compressed entry exists once all its tokens do."""
        return num_tokens // self.compress

    def resolved(self, model_codec: str) -> StreamSpec:
        """This stream with its codec filled in from the model's ("" there too: raw)."""
        if self.codec:
            return self
        return StreamSpec(self.name, self.shape, self.dtype, model_codec or "raw", self.axis, self.compress)

    def canonical(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        return f"{self.name}:{dims}:{self.dtype.name}:{self.codec}:{self.axis.name}:{self.compress}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype.name, "codec": self.codec,
                "axis": self.axis.name, "compress": self.compress}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StreamSpec:
        return cls(d["name"], tuple(d["shape"]), DType[d["dtype"]], d.get("codec", ""), Axis[d["axis"]],
                   d.get("compress", 1))


def kv_streams(num_kv_heads: int, head_dim: int, dtype: DType) -> tuple[StreamSpec, StreamSpec]:
    """The K/V layout's two streams: K grouped per channel (outlier channels), V per token (KIVI)."""
    shape = (num_kv_heads, head_dim)
    return (StreamSpec("k", shape, dtype, "", Axis.CHANNEL), StreamSpec("v", shape, dtype, "", Axis.TOKEN))


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerSpec, ...]
    num_kv_heads: int = 0  # the K/V layout's; 0 in a stream layout
    head_dim: int = 0
    dtype: DType = DType.BF16  # the K/V layout's element type; a stream layout's blocks are labelled with it
    block_tokens: int = 256
    streams: tuple[StreamSpec, ...] = ()  # empty: the K/V layout
    window_streams: tuple[StreamSpec, ...] = ()  # a stream layout's per-token SWA KV, per windowed layer

    def __post_init__(self) -> None:
        object.__setattr__(self, "streams", tuple(self.streams))
        object.__setattr__(self, "window_streams", tuple(self.window_streams))
        if not self.layers:
            raise InvalidArgument("a layout needs at least one layer")
        limits.check_dimension("a layout's number of layers", len(self.layers), 1, limits.MAX_LAYERS)
        if self.persisted_layers == 0:
            raise InvalidArgument("the layout has no global layer, so a block would carry no KV; "
                                  "mark at least one layer LAYER_KIND_GLOBAL")
        bt = self.block_tokens
        if bt < 16 or bt & (bt - 1) or bt > limits.MAX_BLOCK_TOKENS:
            raise InvalidArgument(f"block_tokens must be a power of two in [16, {limits.MAX_BLOCK_TOKENS}], got {bt}")
        if not self.streams:
            limits.check_dimension("num_kv_heads", self.num_kv_heads, 1, limits.MAX_KV_HEADS)
            limits.check_dimension("head_dim", self.head_dim, 1, limits.MAX_HEAD_DIM)
            for i, layer in enumerate(self.layers):
                if layer.kind != LayerKind.SLIDING and layer.window:
                    raise InvalidArgument(f"layer {i}: a {layer.kind.name.lower()} layer has no window in a K/V "
                                          "layout; leave window at 0 (a sliding branch beside global attention "
                                          "needs a stream layout)")
            if self.window_streams:
                raise InvalidArgument("window_streams belong to a stream layout; a K/V layout's sliding layers "
                                      "keep K and V of its own shape")
            return
        if self.num_kv_heads or self.head_dim:
            raise InvalidArgument("a stream layout describes its KV in `streams`; leave num_kv_heads and head_dim 0")
        for what, group in (("streams", self.streams), ("window_streams", self.window_streams)):
            names = [s.name for s in group]
            if len(set(names)) != len(names):
                raise InvalidArgument(f"{what}: stream names {names} repeat; name each stream once")
            if len(group) > MAX_STREAMS:
                raise InvalidArgument(f"{what}: at most {MAX_STREAMS} streams, got {len(group)}")
            for s in group:
                if s.compress > bt:
                    raise InvalidArgument(f"stream {s.name}: compress={s.compress} exceeds block_tokens={bt}; a "
                                          "block must hold whole entries")
        if any(layer.windowed for layer in self.layers) and not self.window_streams:
            raise InvalidArgument("the layout has sliding windows; describe the KV each keeps per token in "
                                  "window_streams (e.g. k and v of (kv_heads, head_dim))")

    # ---- what a block holds -----------------------------------------------------------------------

    @property
    def has_streams(self) -> bool:
        """A stream layout (block format v2), rather than the K/V layout."""
        return bool(self.streams)

    @property
    def persisted_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == LayerKind.GLOBAL)

    @property
    def stream_specs(self) -> tuple[StreamSpec, ...]:
        """The streams a block holds: the K/V layout's are k and v of (num_kv_heads, head_dim)."""
        return self.streams or kv_streams(self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def window_stream_specs(self) -> tuple[StreamSpec, ...]:
        """What each windowed layer keeps per token (the K/V layout: K and V of its own shape)."""
        if self.streams:
            return self.window_streams
        return kv_streams(self.num_kv_heads, self.head_dim, self.dtype)

    def resolved_streams(self, model_codec: str) -> tuple[StreamSpec, ...]:
        """The streams with every codec named (a stream's "" is the model's codec)."""
        return tuple(s.resolved(model_codec) for s in self.stream_specs)

    def stream_shape(self, stream: StreamSpec, num_tokens: int) -> tuple[int, ...]:
        """A block's tensor of one stream: (persisted layers, entries, *shape)."""
        return (self.persisted_layers, stream.entries(num_tokens), *stream.shape)

    def block_shape(self, num_tokens: int) -> tuple[int, ...]:
        """The shape a BlockHeader announces: (persisted layers, K/V, tokens, kv heads, head dim) for the K/V
        layout; (persisted layers, streams, tokens) for a stream layout (each stream's shape is in the layout)."""
        if self.streams:
            return (self.persisted_layers, len(self.streams), num_tokens)
        return (self.persisted_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    def block_nbytes(self, num_tokens: int) -> int:
        """The decoded (raw) bytes of a block's elements."""
        if self.streams:
            return sum(self.persisted_layers * s.entries(num_tokens) * s.width * s.dtype.itemsize
                       for s in self.streams)
        return self.persisted_layers * 2 * num_tokens * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def bytes_per_token(self) -> int:
        """Raw bytes per token of the persisted streams (a compressed stream's entries spread over their tokens)."""
        if self.streams:
            return self.block_nbytes(self.block_tokens) // self.block_tokens
        return self.block_nbytes(1)

    @property
    def windowed_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.windowed)

    def all_layers_bytes_per_token(self) -> int:
        """What a cache that keeps every layer's KV (sliding ones too, as LMCache does) stores per token."""
        if self.streams:
            window = sum(s.width * s.dtype.itemsize for s in self.window_streams)
            return self.bytes_per_token() + self.windowed_layers * window
        own = sum(1 for layer in self.layers if layer.kind not in STORES_NOTHING)
        return own * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    # ---- identity ------------------------------------------------------------------------------------

    def canonical(self) -> bytes:
        """A stable byte form for fingerprints: independent of Python and protobuf versions. The K/V layout's
        is what it always was (its blocks keep their keys); a stream layout's adds its streams."""
        parts = [f"dtype={self.dtype.name}", f"kvh={self.num_kv_heads}", f"hd={self.head_dim}",
                 f"bt={self.block_tokens}"]
        parts += [f"{layer.kind.name}:{layer.window}" for layer in self.layers]
        if self.streams:
            parts.append("streams=" + "|".join(s.canonical() for s in self.streams))
            parts.append("window_streams=" + "|".join(s.canonical() for s in self.window_streams))
        return ";".join(parts).encode()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"layers": [[layer.kind.name, layer.window] for layer in self.layers],
                             "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "dtype": self.dtype.name,
                             "block_tokens": self.block_tokens}
        if self.streams:
            d["streams"] = [s.to_dict() for s in self.streams]
            d["window_streams"] = [s.to_dict() for s in self.window_streams]
        return d

    @classmethod
    def from_dict(cls, lay: dict[str, Any]) -> KVLayout:
        return cls(layers=tuple(LayerSpec(LayerKind[k], w) for k, w in lay["layers"]),
                   num_kv_heads=lay["num_kv_heads"], head_dim=lay["head_dim"], dtype=DType[lay["dtype"]],
                   block_tokens=lay["block_tokens"],
                   streams=tuple(StreamSpec.from_dict(s) for s in lay.get("streams", ())),
                   window_streams=tuple(StreamSpec.from_dict(s) for s in lay.get("window_streams", ())))


STREAMS_CODEC = "streams"  # a stream layout's BlockHeader.codec: the payload is a v2 block, each stream in its codec


@dataclass(frozen=True)
class ModelSpec:
    """A model as the daemon knows it. A change to any field gives a new fingerprint, so blocks of
    old weights (or another codec) never match new requests."""

    name: str
    weights_id: str
    layout: KVLayout
    codec: str = ""  # "" = the daemon's default codec (the registry fills it in); a stream layout's default

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgument("a model needs a name")
        if not self.weights_id:
            raise InvalidArgument("a model needs a weights_id (a checkpoint hash or revision)")
        limits.check_length("the model's name", self.name, limits.MAX_NAME_BYTES)
        limits.check_length("the model's weights_id", self.weights_id, limits.MAX_NAME_BYTES)

    @property
    def stored_codec(self) -> str:
        """What its blocks' headers name: "streams" (block format v2) for a stream layout, else the codec."""
        return STREAMS_CODEC if self.layout.has_streams else (self.codec or "raw")

    @property
    def streams(self) -> tuple[StreamSpec, ...]:
        """The layout's streams with their codecs resolved against the model's."""
        return self.layout.resolved_streams(self.codec)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "weights_id": self.weights_id, "codec": self.codec,
                "layout": self.layout.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        return cls(d["name"], d["weights_id"], KVLayout.from_dict(d["layout"]), d.get("codec", "raw"))

    @property
    def fingerprint(self) -> bytes:
        h = hashlib.blake2b(b"engram/model-fingerprint/v1", digest_size=FINGERPRINT_BYTES)
        for field in (self.name.encode(), self.weights_id.encode(), self.layout.canonical(), self.codec.encode()):
            h.update(len(field).to_bytes(4, "little"))
            h.update(field)
        return h.digest()
