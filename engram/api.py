"""What the daemon answers, as plain frozen dataclasses: the client returns these, the CLI renders them,
and the server builds them from the store before engram/wire/convert.py turns them into protobuf.

Field names follow the protobuf messages of proto/engram/v1/engram.proto one for one, so the conversion is
one generic function and a reader can look a field up in either place. Nothing here imports the daemon or
grpc: a worker that imports engram.client loads this, the wire, and the codecs, nothing more.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # ResumeResult.window only; the CLI reads these replies without loading torch
    import torch


class SessionMode(enum.StrEnum):
    """How a session's sliding-window KV comes back on Resume (docs/REPLAY.md)."""

    EXACT = "exact"  # the daemon replays R = L_swa * (W - 1) tokens: bit-exact with the stored global KV
    APPROX = "approx"  # the daemon replays R = approx_k * W tokens
    PERSIST = "persist"  # the worker uploads the window; no replay
    AUTO = "auto"  # the daemon's cost model chooses per session: keep its window, or replay exact or approx

    @classmethod
    def parse(cls, value: str | SessionMode) -> SessionMode:
        from engram.errors import InvalidArgument

        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(f"mode must be one of {[m.value for m in cls]}, got {value!r}") from None


@dataclass(frozen=True)
class BlockRef:
    """A stored block as a lookup reports it."""

    key: bytes
    num_tokens: int
    # the fastest tier holding a copy now; a tenant's call in a namespace tenants share: its home, the slowest (the
    # fastest moved with the other tenants' reads: docs/ARCHITECTURE.md, Tenancy, "Tiers in a namespace tenants share")
    tier: str
    nbytes: int
    # Under write-through, it has no durable (NVMe) copy yet: a put sends it again, not skipped (BlockRef.not_durable)
    not_durable: bool = False


@dataclass(frozen=True)
class LookupResult:
    matched_tokens: int  # tokens covered by `blocks`, a prefix of the query
    blocks: tuple[BlockRef, ...]  # in chain order


@dataclass(frozen=True)
class LoadResult:
    """What `EngramClient.load_prefix_into` did: how much of the prefix was cached and written, and how."""

    matched_tokens: int  # the cached prefix the daemon found
    loaded_tokens: int  # written into the destination: min(matched_tokens, its capacity)
    blocks: tuple[BlockRef, ...]
    mapped_blocks: int  # copied out of a pool this process maps (DRAM, or HBM by CUDA IPC)
    bytes_blocks: int  # that came over the socket (on NVMe only, another host, or refetched)
    refetched_blocks: int  # whose slot was reused while it was copied, fetched again as bytes
    rpc_ms: float = 0.0  # the GetPrefix round trip (lookup, descriptors, bytes of unmapped blocks)
    copy_ms: float = 0.0  # copies, decode and writes into the destination, until the pool was read


@dataclass(frozen=True)
class PutReply:
    """What the daemon says about one Put stream."""

    keys: tuple[bytes, ...]  # every block's key, in the order sent
    stored: int  # newly stored
    deduplicated: int  # already present: the payload was dropped
    not_durable: int = 0  # acknowledged without a durable copy (write-through, tiers.on_nvme_failure = degrade)


@dataclass(frozen=True)
class PutResult:
    """What `EngramClient.put` did with a whole sequence."""

    keys: tuple[bytes, ...]  # every block of the sequence, cached ones included
    stored: int
    deduplicated: int
    skipped: int  # blocks not sent because a Lookup (in place: ReservePut) showed them cached; never deduplicated
    # An in-place put's time: reserving slots, encoding and writing them, the daemon's sealing and publishing.
    reserve_ms: float = 0.0
    write_ms: float = 0.0
    commit_ms: float = 0.0
    not_durable: int = 0  # acknowledged without a durable copy (write-through, tiers.on_nvme_failure = degrade)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    namespace: str
    model_fingerprint: bytes
    tokens: int
    mode: SessionMode
    approx_k: float
    hot: bool  # the daemon holds an SWA window for it
    window_prefix_len: int
    parent: str
    created_s: float
    persisted: bool = False  # its window is kept through going cold (persist mode, or auto's choice)
    decision: str = ""  # auto mode: the cost model's last choice and why
    expect_back_ms: int = 0  # what its last append said of its next turn (0: nothing)
    owner: str = ""  # the tenant that opened (or forked) it; "": an admin's, or tenancy off

    @property
    def state(self) -> str:
        """hot: the daemon holds a rebuilt window; persisted: a window kept through going cold (persist mode,
        or auto's choice); cold: a Resume replays (or, persist mode without a window, cannot resume yet)."""
        if self.mode == SessionMode.PERSIST or self.persisted:
            return "persisted" if self.hot else "cold"
        return "hot" if self.hot else "cold"


@dataclass(frozen=True)
class ResumeResult:
    """What Resume returns: the global KV blocks of [0, position) (fetch them with get) and the SWA window,
    (sliding layers, 2, position - window_start, kv heads, head dim), for a query at `position`."""

    position: int
    blocks: tuple[BlockRef, ...]
    window: torch.Tensor
    window_start: int
    source: str  # "replay", "hot" or "persisted"
    replayed_tokens: int
    replay_s: float
    global_kv: torch.Tensor | None = None  # with_global_kv: (stored layers, 2, position, kv heads, head dim)


@dataclass(frozen=True)
class NamespaceStats:
    namespace: str
    key_salt: bytes = b""  # DescribeNamespace only; empty when tenancy is off
    quota_bytes: int = 0  # 0: no quota
    blocks: int = 0
    physical_bytes: int = 0  # every stored block once
    logical_bytes: int = 0  # a block once per session holding it: what dedupe saves
    referenced_blocks: int = 0
    sessions: int = 0


@dataclass(frozen=True)
class TierStats:
    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    hits: int = 0
    misses: int = 0  # reads served by a lower tier because this one had no copy
    evictions: int = 0
    pinned_blocks: int = 0
    state: str = "ok"  # "ok" or "degraded"
    state_reason: str = ""
    demotions: int = 0
    promotions: int = 0
    io_errors: int = 0
    corrupt_blocks: int = 0
    enospc: int = 0
    tokens: int = 0  # tokens of the blocks with a copy here: used_bytes / tokens = bytes per token
    demoted_bytes: int = 0
    promoted_bytes: int = 0


@dataclass(frozen=True)
class ModelStats:
    model_fingerprint: bytes
    name: str
    blocks: int
    stored_bytes: int
    tokens: int
    codec: str
    raw_bytes: int  # the same blocks as raw elements
    all_layers_bytes: int  # keeping every layer's KV (sliding ones too), raw
    replayable: bool  # its sessions' windows can be rebuilt here: a replay model, or nothing to rebuild


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 0
    chunk_bytes: int = 0
    max_blocks_per_request: int = 0
    max_tokens_per_request: int = 0


@dataclass(frozen=True)
class ReplayStats:
    sessions: int = 0
    hot_sessions: int = 0
    persisted_window_bytes: int = 0
    hot_window_bytes: int = 0
    replays: int = 0
    replayed_tokens: int = 0
    replay_seconds: float = 0.0
    windows_dropped_cold: int = 0
    # Tokens live sessions hold: a tenant's own against its share, or every session's against the daemon's bound
    # (an admin's); a bound of 0: none (engram/sessiontokens.py).
    session_tokens: int = 0
    session_tokens_bound: int = 0


@dataclass(frozen=True)
class EvictionStats:
    learned: bool = False  # densities in use; False: plain least recently used (too few comebacks seen yet)
    recency_weight: float = 0.5  # the chance a victim search picks by recency; by density (or hint) otherwise
    comebacks: int = 0  # comebacks and gones the model has counted
    ghosts: int = 0  # deleted blocks remembered
    recomputations: int = 0
    hint_weight: float = 0.0  # the chance it picks by sessions' expect_back_ms (0 until a client sent one)

    def orders(self) -> str:
        """Each order's share of victim picks: "recency 10% / hit density 60% / hint 30%"."""
        density = 1 - self.recency_weight - self.hint_weight
        hint = f" / hint {self.hint_weight:.0%}" if self.hint_weight else ""
        return f"recency {self.recency_weight:.0%} / hit density {density:.0%}{hint}"


@dataclass(frozen=True)
class ClusterStats:
    state: str = "off"  # "off", "ok" or "degraded"
    reason: str = ""
    node_id: str = ""
    live_nodes: int = 0
    remote_hits: int = 0
    remote_bytes: int = 0
    remote_failures: int = 0
    published: int = 0
    reconnects: int = 0
    untrusted_records: int = 0  # records in Redis whose signature did not verify (ignored)
    stale_entries_removed: int = 0  # holder entries removed as no longer true (dead node, restarted, evicted)


@dataclass(frozen=True)
class CodecError:
    """A lossy codec's measured error on one part (k, v) of one layer kind, in one tier (first written)."""

    codec: str = ""
    tier: str = ""
    layer_kind: str = ""
    part: str = ""
    samples: int = 0  # layers measured
    rel_mean: float = 0.0  # ||x - dq(x)|| / ||x||
    rel_max: float = 0.0
    max_abs_mean: float = 0.0  # max |x - dq(x)| / max |x|
    max_abs_max: float = 0.0


@dataclass(frozen=True)
class CodecFallback:
    """A (codec, layer kind) stored lossless since its mean relative error passed codec.max_error."""

    codec: str = ""
    layer_kind: str = ""
    rel_mean: float = 0.0
    samples: int = 0
    max_error: float = 0.0
    blocks: int = 0  # stored lossless since


@dataclass(frozen=True)
class Stats:
    tiers: tuple[TierStats, ...] = ()
    models: tuple[ModelStats, ...] = ()
    lookups: int = 0
    lookup_hit_tokens: int = 0
    lookup_miss_tokens: int = 0
    blocks_put: int = 0
    blocks_deduplicated: int = 0
    blocks_served: int = 0
    bytes_served: int = 0
    limits: Limits = field(default_factory=Limits)
    version: str = ""
    uptime_s: float = 0.0
    write_policy: str = ""
    corrupt_blocks: int = 0
    replay: ReplayStats = field(default_factory=ReplayStats)
    namespaces: tuple[NamespaceStats, ...] = ()  # those the caller may see (all, for an admin)
    cluster: ClusterStats = field(default_factory=ClusterStats)
    blocks_evicted_on_request: int = 0
    blocks_not_durable: int = 0  # acknowledged without a durable copy (write-through, degrade)
    write_back_pending_blocks: int = 0  # only in volatile tiers: what a crash now would lose
    write_back_pending_bytes: int = 0
    write_back_oldest_s: float = 0.0
    blocks_flushed: int = 0  # copied to NVMe by the background flusher
    leases: int = 0  # zero-copy leases open
    default_codec: str = ""  # for models registered without a codec
    default_codec_reason: str = ""  # codec.default, or what auto found
    codec_backend: str = ""  # where the daemon encodes: triton (its GPU), cpu (compiled), reference (PyTorch)
    codec_errors: tuple[CodecError, ...] = ()  # sampled error of the blocks the daemon encoded (codec.quality_sample)
    codec_error_blocks: int = 0  # blocks measured
    codec_error_skipped: int = 0  # samples dropped while earlier measurements ran
    codec_fallbacks: tuple[CodecFallback, ...] = ()  # stored lossless since (codec.max_error)
    eviction: EvictionStats = field(default_factory=EvictionStats)
    blocks_prefetched: int = 0  # copied up before their session was due back (a client's expect_back_ms)
    sessions_closed_idle: int = 0  # closed by the daemon after server.session_idle_s without a call
    # A tenant's view: content and activity of its own namespaces only; the daemon-wide activity figures (which
    # move with other tenants' calls) are the admin's, 0 here (proto StatsResponse.scoped lists them)
    scoped: bool = False

    def tier(self, name: str) -> TierStats:
        return next(t for t in self.tiers if t.name == name)


@dataclass(frozen=True)
class CheckFinding:
    path: str  # a file, or tier:key for an in-memory copy
    problem: str
    fixed: bool


@dataclass(frozen=True)
class CheckReport:
    scanned: int = 0
    valid: int = 0
    findings: tuple[CheckFinding, ...] = ()


@dataclass(frozen=True)
class NamespaceSummary:
    namespace: str
    blocks: int
    stored_bytes: int
    tokens: int
    pinned_blocks: int
    sessions: int


@dataclass(frozen=True)
class SessionSummary:
    info: SessionInfo
    cached_tokens: int  # leading tokens whose global KV is stored now
    blocks: int
    # tiers holding at least one of its blocks, fastest first; a tenant's call in a namespace tenants share: the
    # blocks' homes alone (BlockDetail.tiers)
    tiers: tuple[str, ...]
    stored_bytes: int
    age_s: float


@dataclass(frozen=True)
class BlockDetail:
    key: bytes
    parent: bytes
    namespace: str
    model_fingerprint: bytes
    num_tokens: int
    full: bool
    # tiers holding a complete copy, fastest first; a tenant's call in a namespace tenants share: the block's home
    # alone, the slowest tier holding a copy (BlockRef.tier)
    tiers: tuple[str, ...]
    codec: str
    checksum: int
    nbytes: int
    pins: int
    children: int
    sessions: int
    refcount: int  # children + sessions + pins
    leases: int
    hits: int
    age_s: float
    start_token: int


@dataclass(frozen=True)
class BlockDescription:
    """DescribeBlocks: the blocks, and the session's summary when a session was asked for."""

    blocks: tuple[BlockDetail, ...]
    session: SessionSummary | None = None


@dataclass(frozen=True)
class ForgetResult:
    model_fingerprint: bytes
    evicted: int  # blocks removed, every namespace's
    unpinned: int  # pinned blocks among them (force)
    sessions_closed: int  # live sessions of the model closed (force)
    tenants: tuple[str, ...]  # whose registrations went with it


@dataclass(frozen=True)
class EvictResult:
    evicted: tuple[bytes, ...]  # descendants of the named blocks included
    skipped: tuple[bytes, ...]  # being read or moving right now (and their ancestors)
    unpinned: int  # pinned blocks evicted with force
    # kept by a tenant's force: a pin not its own (an admin's, another tenant's) holds them or a block extending them
    operator_pinned: tuple[bytes, ...] = ()
    # a tenant's evict in a namespace other tenants share: kept because another holds them (another owner's session,
    # a pin not its own) or a read or move is under way, not told apart; skipped and operator_pinned are empty there
    in_use: tuple[bytes, ...] = ()
