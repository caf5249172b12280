from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]
    DTYPE_FP16: _ClassVar[DType]
    DTYPE_FP32: _ClassVar[DType]
    DTYPE_FP64: _ClassVar[DType]

class LayerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYER_KIND_UNSPECIFIED: _ClassVar[LayerKind]
    LAYER_KIND_GLOBAL: _ClassVar[LayerKind]
    LAYER_KIND_SLIDING: _ClassVar[LayerKind]
    LAYER_KIND_SHARED: _ClassVar[LayerKind]
    LAYER_KIND_REINDEX: _ClassVar[LayerKind]
    LAYER_KIND_REUSE: _ClassVar[LayerKind]

class GroupAxis(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_AXIS_UNSPECIFIED: _ClassVar[GroupAxis]
    GROUP_AXIS_CHANNEL: _ClassVar[GroupAxis]
    GROUP_AXIS_TOKEN: _ClassVar[GroupAxis]

class ReplayModeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLAY_MODE_UNSPECIFIED: _ClassVar[ReplayModeKind]
    REPLAY_MODE_EXACT: _ClassVar[ReplayModeKind]
    REPLAY_MODE_APPROX: _ClassVar[ReplayModeKind]
    REPLAY_MODE_PERSIST: _ClassVar[ReplayModeKind]
    REPLAY_MODE_AUTO: _ClassVar[ReplayModeKind]
DTYPE_UNSPECIFIED: DType
DTYPE_BF16: DType
DTYPE_FP16: DType
DTYPE_FP32: DType
DTYPE_FP64: DType
LAYER_KIND_UNSPECIFIED: LayerKind
LAYER_KIND_GLOBAL: LayerKind
LAYER_KIND_SLIDING: LayerKind
LAYER_KIND_SHARED: LayerKind
LAYER_KIND_REINDEX: LayerKind
LAYER_KIND_REUSE: LayerKind
GROUP_AXIS_UNSPECIFIED: GroupAxis
GROUP_AXIS_CHANNEL: GroupAxis
GROUP_AXIS_TOKEN: GroupAxis
REPLAY_MODE_UNSPECIFIED: ReplayModeKind
REPLAY_MODE_EXACT: ReplayModeKind
REPLAY_MODE_APPROX: ReplayModeKind
REPLAY_MODE_PERSIST: ReplayModeKind
REPLAY_MODE_AUTO: ReplayModeKind

class StreamSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "codec", "axis", "compress")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    AXIS_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    codec: str
    axis: GroupAxis
    compress: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., codec: _Optional[str] = ..., axis: _Optional[_Union[GroupAxis, str]] = ..., compress: _Optional[int] = ...) -> None: ...

class LayerSpec(_message.Message):
    __slots__ = ("kind", "window")
    KIND_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    kind: LayerKind
    window: int
    def __init__(self, kind: _Optional[_Union[LayerKind, str]] = ..., window: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("layers", "num_kv_heads", "head_dim", "dtype", "block_tokens", "streams", "window_streams")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STREAMS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    num_kv_heads: int
    head_dim: int
    dtype: DType
    block_tokens: int
    streams: _containers.RepeatedCompositeFieldContainer[StreamSpec]
    window_streams: _containers.RepeatedCompositeFieldContainer[StreamSpec]
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., block_tokens: _Optional[int] = ..., streams: _Optional[_Iterable[_Union[StreamSpec, _Mapping]]] = ..., window_streams: _Optional[_Iterable[_Union[StreamSpec, _Mapping]]] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("name", "weights_id", "layout", "codec")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    name: str
    weights_id: str
    layout: KVLayout
    codec: str
    def __init__(self, name: _Optional[str] = ..., weights_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., codec: _Optional[str] = ...) -> None: ...

class RegisterModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelSpec
    def __init__(self, model: _Optional[_Union[ModelSpec, _Mapping]] = ...) -> None: ...

class RegisterModelResponse(_message.Message):
    __slots__ = ("model_fingerprint", "codec", "max_blocks_per_request", "max_message_bytes", "max_tokens_per_request")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: bytes
    codec: str
    max_blocks_per_request: int
    max_message_bytes: int
    max_tokens_per_request: int
    def __init__(self, model_fingerprint: _Optional[bytes] = ..., codec: _Optional[str] = ..., max_blocks_per_request: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_tokens_per_request: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "tokens", "probe")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: bytes
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probe: bool
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., tokens: _Optional[_Iterable[int]] = ..., probe: _Optional[bool] = ...) -> None: ...

class BlockRef(_message.Message):
    __slots__ = ("key", "num_tokens", "tier", "nbytes", "not_durable")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    NOT_DURABLE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    num_tokens: int
    tier: str
    nbytes: int
    not_durable: bool
    def __init__(self, key: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., tier: _Optional[str] = ..., nbytes: _Optional[int] = ..., not_durable: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matched_tokens", "blocks")
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    matched_tokens: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    def __init__(self, matched_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ...) -> None: ...

class BlockHeader(_message.Message):
    __slots__ = ("tokens", "dtype", "shape", "payload_nbytes", "checksum", "codec")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload_nbytes: int
    checksum: int
    codec: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., payload_nbytes: _Optional[int] = ..., checksum: _Optional[int] = ..., codec: _Optional[str] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("header", "data", "last", "key")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    data: bytes
    last: bool
    key: bytes
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., key: _Optional[bytes] = ...) -> None: ...

class DataEndpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataEndpointResponse(_message.Message):
    __slots__ = ("tcp_port", "unix_path", "tls", "max_request_bytes")
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    UNIX_PATH_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    tcp_port: int
    unix_path: str
    tls: bool
    max_request_bytes: int
    def __init__(self, tcp_port: _Optional[int] = ..., unix_path: _Optional[str] = ..., tls: _Optional[bool] = ..., max_request_bytes: _Optional[int] = ...) -> None: ...

class DataPut(_message.Message):
    __slots__ = ("header", "blocks", "progress_every_ms")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_EVERY_MS_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    blocks: _containers.RepeatedCompositeFieldContainer[BlockHeader]
    progress_every_ms: int
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[BlockHeader, _Mapping]]] = ..., progress_every_ms: _Optional[int] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "parent_key", "pin")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: bytes
    parent_key: bytes
    pin: bool
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., pin: _Optional[bool] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    chunk: BlockChunk
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., chunk: _Optional[_Union[BlockChunk, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("keys", "stored", "deduplicated", "not_durable")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    NOT_DURABLE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    stored: int
    deduplicated: int
    not_durable: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., stored: _Optional[int] = ..., deduplicated: _Optional[int] = ..., not_durable: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "keys", "decode", "zero_copy", "cuda_ipc", "release_lease_ids", "answer_within_ms")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    ZERO_COPY_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_WITHIN_MS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    decode: bool
    zero_copy: bool
    cuda_ipc: bool
    release_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    answer_within_ms: int
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., decode: _Optional[bool] = ..., zero_copy: _Optional[bool] = ..., cuda_ipc: _Optional[bool] = ..., release_lease_ids: _Optional[_Iterable[int]] = ..., answer_within_ms: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("chunk", "descriptor")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    chunk: BlockChunk
    descriptor: BlockDescriptor
    def __init__(self, chunk: _Optional[_Union[BlockChunk, _Mapping]] = ..., descriptor: _Optional[_Union[BlockDescriptor, _Mapping]] = ...) -> None: ...

class GetPrefixRequest(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "tokens", "zero_copy", "cuda_ipc", "release_lease_ids", "hold_for_get", "answer_within_ms")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ZERO_COPY_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    HOLD_FOR_GET_FIELD_NUMBER: _ClassVar[int]
    ANSWER_WITHIN_MS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: bytes
    tokens: _containers.RepeatedScalarFieldContainer[int]
    zero_copy: bool
    cuda_ipc: bool
    release_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    hold_for_get: bool
    answer_within_ms: int
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., tokens: _Optional[_Iterable[int]] = ..., zero_copy: _Optional[bool] = ..., cuda_ipc: _Optional[bool] = ..., release_lease_ids: _Optional[_Iterable[int]] = ..., hold_for_get: _Optional[bool] = ..., answer_within_ms: _Optional[int] = ...) -> None: ...

class PrefixHeader(_message.Message):
    __slots__ = ("matched_tokens", "blocks", "lease_id", "lease_expires_in_s", "descriptors")
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    matched_tokens: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    lease_id: int
    lease_expires_in_s: float
    descriptors: _containers.RepeatedCompositeFieldContainer[BlockDescriptor]
    def __init__(self, matched_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ..., lease_id: _Optional[int] = ..., lease_expires_in_s: _Optional[float] = ..., descriptors: _Optional[_Iterable[_Union[BlockDescriptor, _Mapping]]] = ...) -> None: ...

class ReservePutRequest(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "parent_key", "pin", "blocks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: bytes
    parent_key: bytes
    pin: bool
    blocks: _containers.RepeatedCompositeFieldContainer[BlockHeader]
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., pin: _Optional[bool] = ..., blocks: _Optional[_Iterable[_Union[BlockHeader, _Mapping]]] = ...) -> None: ...

class ReservePutResponse(_message.Message):
    __slots__ = ("reservation_id", "keys", "slots", "cached", "expires_in_s", "refused")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    slots: _containers.RepeatedCompositeFieldContainer[BlockDescriptor]
    cached: _containers.RepeatedScalarFieldContainer[bool]
    expires_in_s: float
    refused: str
    def __init__(self, reservation_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., slots: _Optional[_Iterable[_Union[BlockDescriptor, _Mapping]]] = ..., cached: _Optional[_Iterable[bool]] = ..., expires_in_s: _Optional[float] = ..., refused: _Optional[str] = ...) -> None: ...

class CommitPutRequest(_message.Message):
    __slots__ = ("namespace", "reservation_id", "blocks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    reservation_id: int
    blocks: int
    def __init__(self, namespace: _Optional[str] = ..., reservation_id: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "keys", "unpin")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    UNPIN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    unpin: bool
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., unpin: _Optional[bool] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: int
    def __init__(self, changed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "blocks", "hits", "misses", "evictions", "pinned_blocks", "state", "state_reason", "demotions", "promotions", "io_errors", "corrupt_blocks", "enospc", "tokens", "demoted_bytes", "promoted_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    IO_ERRORS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENOSPC_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    pinned_blocks: int
    state: str
    state_reason: str
    demotions: int
    promotions: int
    io_errors: int
    corrupt_blocks: int
    enospc: int
    tokens: int
    demoted_bytes: int
    promoted_bytes: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., state: _Optional[str] = ..., state_reason: _Optional[str] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., io_errors: _Optional[int] = ..., corrupt_blocks: _Optional[int] = ..., enospc: _Optional[int] = ..., tokens: _Optional[int] = ..., demoted_bytes: _Optional[int] = ..., promoted_bytes: _Optional[int] = ...) -> None: ...

class ModelStats(_message.Message):
    __slots__ = ("model_fingerprint", "name", "blocks", "stored_bytes", "tokens", "codec", "raw_bytes", "all_layers_bytes", "replayable")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALL_LAYERS_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLAYABLE_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: bytes
    name: str
    blocks: int
    stored_bytes: int
    tokens: int
    codec: str
    raw_bytes: int
    all_layers_bytes: int
    replayable: bool
    def __init__(self, model_fingerprint: _Optional[bytes] = ..., name: _Optional[str] = ..., blocks: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., tokens: _Optional[int] = ..., codec: _Optional[str] = ..., raw_bytes: _Optional[int] = ..., all_layers_bytes: _Optional[int] = ..., replayable: _Optional[bool] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_message_bytes", "chunk_bytes", "max_blocks_per_request", "max_tokens_per_request")
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    max_message_bytes: int
    chunk_bytes: int
    max_blocks_per_request: int
    max_tokens_per_request: int
    def __init__(self, max_message_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., max_blocks_per_request: _Optional[int] = ..., max_tokens_per_request: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "models", "lookups", "lookup_hit_tokens", "lookup_miss_tokens", "blocks_put", "blocks_deduplicated", "blocks_served", "bytes_served", "limits", "version", "uptime_s", "write_policy", "corrupt_blocks", "replay", "namespaces", "cluster", "blocks_evicted_on_request", "blocks_not_durable", "write_back_pending_blocks", "write_back_pending_bytes", "write_back_oldest_s", "blocks_flushed", "leases", "default_codec", "default_codec_reason", "codec_backend", "codec_errors", "codec_error_blocks", "codec_error_skipped", "codec_fallbacks", "eviction", "blocks_prefetched", "sessions_closed_idle", "scoped")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SERVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_EVICTED_ON_REQUEST_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_NOT_DURABLE_FIELD_NUMBER: _ClassVar[int]
    WRITE_BACK_PENDING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITE_BACK_PENDING_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BACK_OLDEST_S_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FLUSHED_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_CODEC_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_CODEC_REASON_FIELD_NUMBER: _ClassVar[int]
    CODEC_BACKEND_FIELD_NUMBER: _ClassVar[int]
    CODEC_ERRORS_FIELD_NUMBER: _ClassVar[int]
    CODEC_ERROR_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CODEC_ERROR_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    CODEC_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_CLOSED_IDLE_FIELD_NUMBER: _ClassVar[int]
    SCOPED_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    models: _containers.RepeatedCompositeFieldContainer[ModelStats]
    lookups: int
    lookup_hit_tokens: int
    lookup_miss_tokens: int
    blocks_put: int
    blocks_deduplicated: int
    blocks_served: int
    bytes_served: int
    limits: Limits
    version: str
    uptime_s: float
    write_policy: str
    corrupt_blocks: int
    replay: ReplayStats
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    cluster: ClusterStats
    blocks_evicted_on_request: int
    blocks_not_durable: int
    write_back_pending_blocks: int
    write_back_pending_bytes: int
    write_back_oldest_s: float
    blocks_flushed: int
    leases: int
    default_codec: str
    default_codec_reason: str
    codec_backend: str
    codec_errors: _containers.RepeatedCompositeFieldContainer[CodecError]
    codec_error_blocks: int
    codec_error_skipped: int
    codec_fallbacks: _containers.RepeatedCompositeFieldContainer[CodecFallback]
    eviction: EvictionStats
    blocks_prefetched: int
    sessions_closed_idle: int
    scoped: bool
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[ModelStats, _Mapping]]] = ..., lookups: _Optional[int] = ..., lookup_hit_tokens: _Optional[int] = ..., lookup_miss_tokens: _Optional[int] = ..., blocks_put: _Optional[int] = ..., blocks_deduplicated: _Optional[int] = ..., blocks_served: _Optional[int] = ..., bytes_served: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., write_policy: _Optional[str] = ..., corrupt_blocks: _Optional[int] = ..., replay: _Optional[_Union[ReplayStats, _Mapping]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., cluster: _Optional[_Union[ClusterStats, _Mapping]] = ..., blocks_evicted_on_request: _Optional[int] = ..., blocks_not_durable: _Optional[int] = ..., write_back_pending_blocks: _Optional[int] = ..., write_back_pending_bytes: _Optional[int] = ..., write_back_oldest_s: _Optional[float] = ..., blocks_flushed: _Optional[int] = ..., leases: _Optional[int] = ..., default_codec: _Optional[str] = ..., default_codec_reason: _Optional[str] = ..., codec_backend: _Optional[str] = ..., codec_errors: _Optional[_Iterable[_Union[CodecError, _Mapping]]] = ..., codec_error_blocks: _Optional[int] = ..., codec_error_skipped: _Optional[int] = ..., codec_fallbacks: _Optional[_Iterable[_Union[CodecFallback, _Mapping]]] = ..., eviction: _Optional[_Union[EvictionStats, _Mapping]] = ..., blocks_prefetched: _Optional[int] = ..., sessions_closed_idle: _Optional[int] = ..., scoped: _Optional[bool] = ...) -> None: ...

class CodecError(_message.Message):
    __slots__ = ("codec", "tier", "layer_kind", "part", "samples", "rel_mean", "rel_max", "max_abs_mean", "max_abs_max")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LAYER_KIND_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REL_MEAN_FIELD_NUMBER: _ClassVar[int]
    REL_MAX_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_MEAN_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_MAX_FIELD_NUMBER: _ClassVar[int]
    codec: str
    tier: str
    layer_kind: str
    part: str
    samples: int
    rel_mean: float
    rel_max: float
    max_abs_mean: float
    max_abs_max: float
    def __init__(self, codec: _Optional[str] = ..., tier: _Optional[str] = ..., layer_kind: _Optional[str] = ..., part: _Optional[str] = ..., samples: _Optional[int] = ..., rel_mean: _Optional[float] = ..., rel_max: _Optional[float] = ..., max_abs_mean: _Optional[float] = ..., max_abs_max: _Optional[float] = ...) -> None: ...

class CodecFallback(_message.Message):
    __slots__ = ("codec", "layer_kind", "rel_mean", "samples", "max_error", "blocks")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    LAYER_KIND_FIELD_NUMBER: _ClassVar[int]
    REL_MEAN_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    codec: str
    layer_kind: str
    rel_mean: float
    samples: int
    max_error: float
    blocks: int
    def __init__(self, codec: _Optional[str] = ..., layer_kind: _Optional[str] = ..., rel_mean: _Optional[float] = ..., samples: _Optional[int] = ..., max_error: _Optional[float] = ..., blocks: _Optional[int] = ...) -> None: ...

class EvictionStats(_message.Message):
    __slots__ = ("learned", "recency_weight", "comebacks", "ghosts", "recomputations", "hint_weight")
    LEARNED_FIELD_NUMBER: _ClassVar[int]
    RECENCY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    COMEBACKS_FIELD_NUMBER: _ClassVar[int]
    GHOSTS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTATIONS_FIELD_NUMBER: _ClassVar[int]
    HINT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    learned: bool
    recency_weight: float
    comebacks: int
    ghosts: int
    recomputations: int
    hint_weight: float
    def __init__(self, learned: _Optional[bool] = ..., recency_weight: _Optional[float] = ..., comebacks: _Optional[int] = ..., ghosts: _Optional[int] = ..., recomputations: _Optional[int] = ..., hint_weight: _Optional[float] = ...) -> None: ...

class ReplayStats(_message.Message):
    __slots__ = ("sessions", "hot_sessions", "persisted_window_bytes", "hot_window_bytes", "replays", "replayed_tokens", "replay_seconds", "windows_dropped_cold", "session_tokens", "session_tokens_bound")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HOT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_WINDOW_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOT_WINDOW_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_DROPPED_COLD_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKENS_BOUND_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    hot_sessions: int
    persisted_window_bytes: int
    hot_window_bytes: int
    replays: int
    replayed_tokens: int
    replay_seconds: float
    windows_dropped_cold: int
    session_tokens: int
    session_tokens_bound: int
    def __init__(self, sessions: _Optional[int] = ..., hot_sessions: _Optional[int] = ..., persisted_window_bytes: _Optional[int] = ..., hot_window_bytes: _Optional[int] = ..., replays: _Optional[int] = ..., replayed_tokens: _Optional[int] = ..., replay_seconds: _Optional[float] = ..., windows_dropped_cold: _Optional[int] = ..., session_tokens: _Optional[int] = ..., session_tokens_bound: _Optional[int] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("namespace", "session_id", "owner")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    session_id: str
    owner: str
    def __init__(self, namespace: _Optional[str] = ..., session_id: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "session_id", "mode", "approx_k", "tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    APPROX_K_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: bytes
    session_id: str
    mode: ReplayModeKind
    approx_k: float
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., session_id: _Optional[str] = ..., mode: _Optional[_Union[ReplayModeKind, str]] = ..., approx_k: _Optional[float] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SwaWindowData(_message.Message):
    __slots__ = ("prefix_len", "start", "dtype", "shape", "checksum", "data")
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    prefix_len: int
    start: int
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    data: bytes
    def __init__(self, prefix_len: _Optional[int] = ..., start: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class AppendSessionRequest(_message.Message):
    __slots__ = ("session", "tokens", "window", "expect_back_ms")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    EXPECT_BACK_MS_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    tokens: _containers.RepeatedScalarFieldContainer[int]
    window: SwaWindowData
    expect_back_ms: int
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., window: _Optional[_Union[SwaWindowData, _Mapping]] = ..., expect_back_ms: _Optional[int] = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("parent", "session_id", "position")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    parent: SessionRef
    session_id: str
    position: int
    def __init__(self, parent: _Optional[_Union[SessionRef, _Mapping]] = ..., session_id: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "namespace", "model_fingerprint", "tokens", "mode", "approx_k", "hot", "window_prefix_len", "parent", "created_s", "persisted", "decision", "expect_back_ms", "owner")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    APPROX_K_FIELD_NUMBER: _ClassVar[int]
    HOT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    CREATED_S_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    EXPECT_BACK_MS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace: str
    model_fingerprint: bytes
    tokens: int
    mode: ReplayModeKind
    approx_k: float
    hot: bool
    window_prefix_len: int
    parent: str
    created_s: float
    persisted: bool
    decision: str
    expect_back_ms: int
    owner: str
    def __init__(self, session_id: _Optional[str] = ..., namespace: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., tokens: _Optional[int] = ..., mode: _Optional[_Union[ReplayModeKind, str]] = ..., approx_k: _Optional[float] = ..., hot: _Optional[bool] = ..., window_prefix_len: _Optional[int] = ..., parent: _Optional[str] = ..., created_s: _Optional[float] = ..., persisted: _Optional[bool] = ..., decision: _Optional[str] = ..., expect_back_ms: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("session", "position", "with_global_kv", "global_kv_by_block", "progress_every_ms")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    WITH_GLOBAL_KV_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_KV_BY_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_EVERY_MS_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    position: int
    with_global_kv: bool
    global_kv_by_block: bool
    progress_every_ms: int
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., position: _Optional[int] = ..., with_global_kv: _Optional[bool] = ..., global_kv_by_block: _Optional[bool] = ..., progress_every_ms: _Optional[int] = ...) -> None: ...

class GlobalKVData(_message.Message):
    __slots__ = ("dtype", "shape", "checksum")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ...) -> None: ...

class GlobalKVBlock(_message.Message):
    __slots__ = ("tokens", "checksum")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    checksum: int
    def __init__(self, tokens: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class ResumeHeader(_message.Message):
    __slots__ = ("position", "blocks", "source", "replayed_tokens", "token_layers", "replay_s", "window", "global_kv")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_KV_FIELD_NUMBER: _ClassVar[int]
    position: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    source: str
    replayed_tokens: int
    token_layers: int
    replay_s: float
    window: SwaWindowData
    global_kv: GlobalKVData
    def __init__(self, position: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ..., source: _Optional[str] = ..., replayed_tokens: _Optional[int] = ..., token_layers: _Optional[int] = ..., replay_s: _Optional[float] = ..., window: _Optional[_Union[SwaWindowData, _Mapping]] = ..., global_kv: _Optional[_Union[GlobalKVData, _Mapping]] = ...) -> None: ...

class ResumeProgress(_message.Message):
    __slots__ = ("stage", "seconds")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    seconds: float
    def __init__(self, stage: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("header", "window_chunk", "global_kv_chunk", "global_kv_block", "progress")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    WINDOW_CHUNK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_KV_CHUNK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_KV_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    header: ResumeHeader
    window_chunk: bytes
    global_kv_chunk: bytes
    global_kv_block: GlobalKVBlock
    progress: ResumeProgress
    def __init__(self, header: _Optional[_Union[ResumeHeader, _Mapping]] = ..., window_chunk: _Optional[bytes] = ..., global_kv_chunk: _Optional[bytes] = ..., global_kv_block: _Optional[_Union[GlobalKVBlock, _Mapping]] = ..., progress: _Optional[_Union[ResumeProgress, _Mapping]] = ...) -> None: ...

class CheckRequest(_message.Message):
    __slots__ = ("fix",)
    FIX_FIELD_NUMBER: _ClassVar[int]
    fix: bool
    def __init__(self, fix: _Optional[bool] = ...) -> None: ...

class CheckFinding(_message.Message):
    __slots__ = ("path", "problem", "fixed")
    PATH_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    FIXED_FIELD_NUMBER: _ClassVar[int]
    path: str
    problem: str
    fixed: bool
    def __init__(self, path: _Optional[str] = ..., problem: _Optional[str] = ..., fixed: _Optional[bool] = ...) -> None: ...

class CheckResponse(_message.Message):
    __slots__ = ("scanned", "valid", "findings")
    SCANNED_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    scanned: int
    valid: int
    findings: _containers.RepeatedCompositeFieldContainer[CheckFinding]
    def __init__(self, scanned: _Optional[int] = ..., valid: _Optional[int] = ..., findings: _Optional[_Iterable[_Union[CheckFinding, _Mapping]]] = ...) -> None: ...

class BlockDescriptor(_message.Message):
    __slots__ = ("key", "header", "segment_path", "segment_id", "offset", "generation", "lease_id", "lease_expires_in_s", "cuda")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    header: BlockHeader
    segment_path: str
    segment_id: bytes
    offset: int
    generation: int
    lease_id: int
    lease_expires_in_s: float
    cuda: CudaIpcHandle
    def __init__(self, key: _Optional[bytes] = ..., header: _Optional[_Union[BlockHeader, _Mapping]] = ..., segment_path: _Optional[str] = ..., segment_id: _Optional[bytes] = ..., offset: _Optional[int] = ..., generation: _Optional[int] = ..., lease_id: _Optional[int] = ..., lease_expires_in_s: _Optional[float] = ..., cuda: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_bytes", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class ReleaseLeasesRequest(_message.Message):
    __slots__ = ("namespace", "lease_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseLeasesResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class DescribeNamespaceRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "key_salt", "quota_bytes", "blocks", "physical_bytes", "logical_bytes", "referenced_blocks", "sessions")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_SALT_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFERENCED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key_salt: bytes
    quota_bytes: int
    blocks: int
    physical_bytes: int
    logical_bytes: int
    referenced_blocks: int
    sessions: int
    def __init__(self, namespace: _Optional[str] = ..., key_salt: _Optional[bytes] = ..., quota_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., physical_bytes: _Optional[int] = ..., logical_bytes: _Optional[int] = ..., referenced_blocks: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("keys", "namespace", "model_fingerprint", "ancestors")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ANCESTORS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    namespace: str
    model_fingerprint: bytes
    ancestors: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., namespace: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., ancestors: _Optional[int] = ...) -> None: ...

class FetchBlocksResponse(_message.Message):
    __slots__ = ("chunk", "parent_key", "namespace", "model_fingerprint", "mac", "ancestors", "ancestors_cut", "max_keys")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    ANCESTORS_FIELD_NUMBER: _ClassVar[int]
    ANCESTORS_CUT_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_FIELD_NUMBER: _ClassVar[int]
    chunk: BlockChunk
    parent_key: bytes
    namespace: str
    model_fingerprint: bytes
    mac: bytes
    ancestors: _containers.RepeatedScalarFieldContainer[bytes]
    ancestors_cut: bool
    max_keys: int
    def __init__(self, chunk: _Optional[_Union[BlockChunk, _Mapping]] = ..., parent_key: _Optional[bytes] = ..., namespace: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., mac: _Optional[bytes] = ..., ancestors: _Optional[_Iterable[bytes]] = ..., ancestors_cut: _Optional[bool] = ..., max_keys: _Optional[int] = ...) -> None: ...

class ClusterStats(_message.Message):
    __slots__ = ("state", "reason", "node_id", "live_nodes", "remote_hits", "remote_bytes", "remote_failures", "published", "reconnects", "untrusted_records", "stale_entries_removed")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LIVE_NODES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HITS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    RECONNECTS_FIELD_NUMBER: _ClassVar[int]
    UNTRUSTED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    STALE_ENTRIES_REMOVED_FIELD_NUMBER: _ClassVar[int]
    state: str
    reason: str
    node_id: str
    live_nodes: int
    remote_hits: int
    remote_bytes: int
    remote_failures: int
    published: int
    reconnects: int
    untrusted_records: int
    stale_entries_removed: int
    def __init__(self, state: _Optional[str] = ..., reason: _Optional[str] = ..., node_id: _Optional[str] = ..., live_nodes: _Optional[int] = ..., remote_hits: _Optional[int] = ..., remote_bytes: _Optional[int] = ..., remote_failures: _Optional[int] = ..., published: _Optional[int] = ..., reconnects: _Optional[int] = ..., untrusted_records: _Optional[int] = ..., stale_entries_removed: _Optional[int] = ...) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceSummary(_message.Message):
    __slots__ = ("namespace", "blocks", "stored_bytes", "tokens", "pinned_blocks", "sessions")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    blocks: int
    stored_bytes: int
    tokens: int
    pinned_blocks: int
    sessions: int
    def __init__(self, namespace: _Optional[str] = ..., blocks: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., tokens: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceSummary]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceSummary, _Mapping]]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("namespace", "all_namespaces")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALL_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    all_namespaces: bool
    def __init__(self, namespace: _Optional[str] = ..., all_namespaces: _Optional[bool] = ...) -> None: ...

class SessionSummary(_message.Message):
    __slots__ = ("info", "cached_tokens", "blocks", "tiers", "stored_bytes", "age_s")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    info: SessionInfo
    cached_tokens: int
    blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    stored_bytes: int
    age_s: float
    def __init__(self, info: _Optional[_Union[SessionInfo, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., stored_bytes: _Optional[int] = ..., age_s: _Optional[float] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionSummary]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionSummary, _Mapping]]] = ...) -> None: ...

class DescribeBlocksRequest(_message.Message):
    __slots__ = ("namespace", "all_namespaces", "session_id", "key_prefixes", "session_owner")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALL_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    SESSION_OWNER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    all_namespaces: bool
    session_id: str
    key_prefixes: _containers.RepeatedScalarFieldContainer[str]
    session_owner: str
    def __init__(self, namespace: _Optional[str] = ..., all_namespaces: _Optional[bool] = ..., session_id: _Optional[str] = ..., key_prefixes: _Optional[_Iterable[str]] = ..., session_owner: _Optional[str] = ...) -> None: ...

class BlockDetail(_message.Message):
    __slots__ = ("key", "parent", "namespace", "model_fingerprint", "num_tokens", "full", "tiers", "codec", "checksum", "nbytes", "pins", "children", "sessions", "refcount", "leases", "hits", "age_s", "start_token")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REFCOUNT_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent: bytes
    namespace: str
    model_fingerprint: bytes
    num_tokens: int
    full: bool
    tiers: _containers.RepeatedScalarFieldContainer[str]
    codec: str
    checksum: int
    nbytes: int
    pins: int
    children: int
    sessions: int
    refcount: int
    leases: int
    hits: int
    age_s: float
    start_token: int
    def __init__(self, key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., namespace: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., full: _Optional[bool] = ..., tiers: _Optional[_Iterable[str]] = ..., codec: _Optional[str] = ..., checksum: _Optional[int] = ..., nbytes: _Optional[int] = ..., pins: _Optional[int] = ..., children: _Optional[int] = ..., sessions: _Optional[int] = ..., refcount: _Optional[int] = ..., leases: _Optional[int] = ..., hits: _Optional[int] = ..., age_s: _Optional[float] = ..., start_token: _Optional[int] = ...) -> None: ...

class DescribeBlocksResponse(_message.Message):
    __slots__ = ("blocks", "session")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockDetail]
    session: SessionSummary
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockDetail, _Mapping]]] = ..., session: _Optional[_Union[SessionSummary, _Mapping]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("namespace", "all_namespaces", "key_prefixes", "session_id", "whole_namespace", "force", "session_owner")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALL_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WHOLE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    SESSION_OWNER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    all_namespaces: bool
    key_prefixes: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    whole_namespace: bool
    force: bool
    session_owner: str
    def __init__(self, namespace: _Optional[str] = ..., all_namespaces: _Optional[bool] = ..., key_prefixes: _Optional[_Iterable[str]] = ..., session_id: _Optional[str] = ..., whole_namespace: _Optional[bool] = ..., force: _Optional[bool] = ..., session_owner: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted", "skipped", "unpinned", "operator_pinned", "in_use")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    UNPINNED_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_PINNED_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    evicted: _containers.RepeatedScalarFieldContainer[bytes]
    skipped: _containers.RepeatedScalarFieldContainer[bytes]
    unpinned: int
    operator_pinned: _containers.RepeatedScalarFieldContainer[bytes]
    in_use: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, evicted: _Optional[_Iterable[bytes]] = ..., skipped: _Optional[_Iterable[bytes]] = ..., unpinned: _Optional[int] = ..., operator_pinned: _Optional[_Iterable[bytes]] = ..., in_use: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ForgetModelRequest(_message.Message):
    __slots__ = ("model_fingerprint", "force")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: bytes
    force: bool
    def __init__(self, model_fingerprint: _Optional[bytes] = ..., force: _Optional[bool] = ...) -> None: ...

class ForgetModelResponse(_message.Message):
    __slots__ = ("model_fingerprint", "evicted", "unpinned", "sessions_closed", "tenants")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    UNPINNED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: bytes
    evicted: int
    unpinned: int
    sessions_closed: int
    tenants: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_fingerprint: _Optional[bytes] = ..., evicted: _Optional[int] = ..., unpinned: _Optional[int] = ..., sessions_closed: _Optional[int] = ..., tenants: _Optional[_Iterable[str]] = ...) -> None: ...
