"""Protobuf messages <-> domain dataclasses. Protobuf stays at the gRPC edge (here and in the client)."""

from __future__ import annotations

import numpy as np

from engram.block import BlockHeader
from engram.errors import InvalidArgument
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.v1 import engram_pb2 as pb


def dtype_from_pb(value: int, where: str) -> DType:
    try:
        return DType(value)
    except ValueError:
        raise InvalidArgument(f"{where}: dtype must be DTYPE_BF16, DTYPE_FP16 or DTYPE_FP32, got {value}") from None


def layout_from_pb(msg: pb.KVLayout) -> KVLayout:
    layers = []
    for i, layer in enumerate(msg.layers):
        try:
            kind = LayerKind(layer.kind)
        except ValueError:
            raise InvalidArgument(f"layout layer {i}: kind must be LAYER_KIND_GLOBAL, LAYER_KIND_SLIDING or LAYER_KIND_SHARED") from None
        layers.append(LayerSpec(kind, layer.window))
    return KVLayout(
        layers=tuple(layers),
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        dtype=dtype_from_pb(msg.dtype, "layout"),
        block_tokens=msg.block_tokens,
    )


def layout_to_pb(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        layers=[pb.LayerSpec(kind=int(layer.kind), window=layer.window) for layer in layout.layers],  # type: ignore[arg-type]
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=int(layout.dtype),  # type: ignore[arg-type]
        block_tokens=layout.block_tokens,
    )


def model_from_pb(msg: pb.ModelSpec) -> ModelSpec:
    return ModelSpec(name=msg.name, weights_id=msg.weights_id, layout=layout_from_pb(msg.layout), codec=msg.codec)


def model_to_pb(spec: ModelSpec) -> pb.ModelSpec:
    return pb.ModelSpec(name=spec.name, weights_id=spec.weights_id, layout=layout_to_pb(spec.layout), codec=spec.codec)


def header_from_pb(msg: pb.BlockHeader, index: int) -> BlockHeader:
    return BlockHeader(
        tokens=np.asarray(msg.tokens, dtype="<i4"),
        dtype=dtype_from_pb(msg.dtype, f"block {index}"),
        shape=tuple(msg.shape),
        payload_nbytes=msg.payload_nbytes,
        checksum=msg.checksum,
        codec=msg.codec or "raw",
    )


def header_to_pb(header: BlockHeader) -> pb.BlockHeader:
    return pb.BlockHeader(
        tokens=header.tokens.tolist(),
        dtype=int(header.dtype),  # type: ignore[arg-type]
        shape=list(header.shape),
        payload_nbytes=header.payload_nbytes,
        checksum=header.checksum,
        codec=header.codec,
    )
