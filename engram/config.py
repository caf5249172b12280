"""One typed configuration tree, filled from (lowest to highest precedence) the defaults, a TOML file,
ENGRAM_* environment variables and command-line overrides. Unknown keys are errors everywhere, so a typo
never silently falls back to a default.

Environment variables name a key with double underscores between levels:
ENGRAM_SERVER__PORT=7000 sets server.port; ENGRAM_TIERS__DRAM__CAPACITY=8GiB sets tiers.dram.capacity.
Only names with a double underscore are config variables (every key lives in a section), and an unknown one
is an error; an error about a value a variable set leads with NAME=value (secrets redacted), since no config
file shows it. Other ENGRAM_* names are not read here: ENGRAM_CONFIG names the TOML file, ENGRAM_TOKEN and
ENGRAM_TLS_CA are the CLI's, and secrets referenced as env:VAR (env:ENGRAM_SALT) may use the prefix too. Byte sizes accept plain integers or units (KiB, MiB, GiB, TiB, KB, MB, GB).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engram.errors import ConfigError
from engram.tomlfile import read_toml

ENV_PREFIX = "ENGRAM_"
ENV_CONFIG_FILE = "ENGRAM_CONFIG"


class ByteSize(int):
    """An int that the loader also accepts as '4GiB', '512MB', ..."""


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: object) -> ByteSize:
    if isinstance(value, int) and not isinstance(value, bool):
        return ByteSize(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return ByteSize(int(float(m.group(1)) * _UNITS[m.group(2).lower()]))
    raise ConfigError(f"{value!r} is not a byte size; write e.g. 1073741824, '1GiB' or '512MB'")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # TCP address; loopback by default: expose it on purpose, not by accident
    port: int = 50051  # 0 picks a free port (tests)
    unix_socket: str = ""  # when set, listen on this unix socket path instead of TCP
    unix_socket_group: str = ""  # the socket is 0600 (the daemon's user); a group here makes it 0660 for it, and, where the same-host paths are on (auth.same_host_paths), the shared pool's segment too, so its workers map it
    # gRPC's send and receive limit per message, for every method (a Put's chunk, its block's header included; an
    # AppendSession's whole SWA window; a Lookup's tokens). grpc reads a message whole before the handler sees it,
    # growing the stream's window to fit, so each gRPC Put stream takes this much of receive_buffer_bytes (as
    # metadata, at most half of it or of a tenant's share) for the life of the call: at 64 MiB, outside the
    # budget, one tenant's 128 streams made the daemon hold 8 GiB. Twice a client's default chunks (8 MiB), which
    # its chunks (the daemon's own too) stay under.
    max_message_bytes: ByteSize = ByteSize(16 * 2**20)
    # Payload bytes per message the daemon streams (a gRPC Get's, a peer's FetchBlocks, a Resume's; < max_message_bytes).
    # Each message is built and handed to gRPC in one step of the event loop, every other call waiting: at 8 MiB a
    # step of 8-13 ms of the loop's CPU (most of it inside gRPC's send), at 1 MiB under 2, the block sent no slower
    # (benchmarks/RESULTS.md, put_get, session 53).
    chunk_bytes: ByteSize = ByteSize(2**20)
    max_concurrent_rpcs: int = 512  # beyond this, RPCs are refused with RESOURCE_EXHAUSTED
    # With tenancy on, the calls one tenant's token may have in flight (admins: no bound; each cluster peer has its
    # own); past it its calls are RESOURCE_EXHAUSTED, so one tenant (idle Put streams, say) cannot take every slot
    # from the others. 0: no bound.
    max_concurrent_rpcs_per_tenant: int = 128
    # Calls to the health and reflection services (anyone's, no token) in flight at once; past it they are
    # RESOURCE_EXHAUSTED, so open Health/Watch streams cannot take the slots of max_concurrent_rpcs from tenants.
    # Their requests are at most 4 KiB each (longer: RESOURCE_EXHAUSTED, unparsed).
    max_concurrent_open_rpcs: int = 32
    max_blocks_per_request: int = 4096  # blocks (or keys) one Put, Get, ReservePut, DescribeBlocks or Evict may name
    max_tokens_per_request: int = 1 << 21  # also the longest a session may grow
    max_block_bytes: ByteSize = ByteSize(256 * 2**20)  # a model whose raw block is larger is refused at register
    # Registered models (each is a file and an entry in memory), kept across restarts. A registration of a new model
    # at the bound first forgets models no tenant registered (any model, with tenancy off) that hold no block,
    # session, reservation or put in flight, least recently used first; refused only when too few do. With
    # tenancy on, a full registry refuses a tenant every model it has not registered itself, whether or not another
    # tenant has (so it tells no one which).
    max_models: int = 1024
    # With tenancy on, the models one tenant's token has registered at once, kept across restarts: registering one of
    # its own again is free, one only another tenant registered counts too (a tenant sees only the models it
    # registered). Past it, its registrations that hold nothing in its namespaces (no block, session, reservation
    # or put in flight) are dropped, least recently registered or used first; a worker whose model was dropped
    # registers it again on the UnknownModel. One tenant filled max_models in a second, refusing every other's.
    max_models_per_tenant: int = 64
    # Live sessions one owner may hold in a namespace: each tenant its own (its max_sessions, when set, overrides
    # it), in a namespace tenants share too; the admins' together (a namespace's tenants' smallest max_sessions)
    max_sessions_per_namespace: int = 4096
    # The tokens every live session holds together, in daemon memory (4 bytes each) until the session is closed or
    # idle past session_idle_s; a fork sharing its parent's counts once. Past it OpenSession, ForkSession and
    # AppendSession are RESOURCE_EXHAUSTED. The default (4 GiB) holds 10,000 agents of 100k-token contexts. 0: no
    # bound (a tenant's quota, 0 by default, still counts them).
    max_live_session_tokens: int = 1 << 30
    # With tenancy on, the share of max_live_session_tokens one tenant's token may hold (the sessions it opened or
    # forked, and what its appends added; admins: no bound), so one tenant's abandoned sessions cannot take the
    # bound from the others (the default, 1 GiB: 2,500 agents of 100k-token contexts). 0: no bound.
    max_live_session_tokens_per_tenant: int = 1 << 28
    # A session no call has touched for this long is closed, its blocks' references dropped (an agent that crashed
    # or was abandoned never closes its sessions; they would hold blocks and count against max_sessions forever);
    # a session whose client said it is back later (expect_back_ms) is kept until then. 0: never.
    session_idle_s: float = 86400.0
    # Every gc_freeze_s what survived the young generations is frozen (engram/collector.py), so the collector's
    # full passes do not walk the whole index (pauses that grow with the stored blocks); every gc_full_s the
    # heap is collected whole once. 0: CPython's own schedule.
    gc_freeze_s: float = 1.0
    gc_full_s: float = 3600.0  # the whole heap collected once this often (bounds cyclic garbage frozen alive)
    shutdown_grace_s: float = 5.0  # in-flight RPCs get this long to finish on SIGTERM
    lease_s: float = 30.0  # a zero-copy Get's descriptors keep their slots this long unless released sooner
    # Blocks one namespace's live leases may name (a lease per load, ended by the next: about 18 bytes a block),
    # counted per tenant in a namespace tenants share; past it a call that leases is RESOURCE_EXHAUSTED. 0: no bound.
    max_leased_blocks_per_namespace: int = 1 << 20
    # In-place puts' slots reserved and not yet committed (ReservePut) are not blocks, and no eviction frees them
    # (one never committed is held up to two lease_s terms): all reservations together hold at most this fraction
    # of the shared DRAM pool, the rest kept for other puts. A ReservePut past it reserves what fits (the client
    # commits that and goes on in rounds) or, with nothing reserved, is RESOURCE_EXHAUSTED (the client then puts
    # as bytes).
    max_reserved_pool_fraction: float = 0.75
    # With tenancy on, the fraction of the shared pool one tenant's reservations (all its namespaces') may hold, at
    # most max_reserved_pool_fraction; an admin's count in the total only, as everyone's do with tenancy off.
    max_reserved_pool_fraction_per_tenant: float = 0.5
    # With tenancy on, the bytes one tenant's namespaces may hold pinned together (each pinned block and the blocks it
    # extends, which a pin keeps too), as a fraction of the store's largest tier: below 1, that tier keeps room for
    # the others' puts however much one tenant pins. Past it a Pin, or a put with pin, is RESOURCE_EXHAUSTED. Admins,
    # and every caller with tenancy off, have no bound (docs/ARCHITECTURE.md: tenants' shares).
    max_pinned_fraction_per_tenant: float = 0.5
    tls_cert: str = ""  # PEM certificate chain: with tls_key, TCP is served over TLS
    tls_key: str = ""  # PEM private key of tls_cert
    metrics_port: int = 0  # Prometheus /metrics over HTTP on this port; 0 = off, -1 = any free port (tests)
    metrics_host: str = "127.0.0.1"  # where /metrics listens (0.0.0.0 in a container)
    # A bearer token /metrics requires (Prometheus: `authorization: {credentials: ...}`), a secret as tokens are
    # (env:VAR, file:PATH). Required with tenancy on: /metrics shows every tenant's activity (the tiers' used
    # bytes, bytes served and lookup tokens after a call tell its prompt length), which a tenant's Stats does not;
    # so it may be no tenant's token (refused at start; an admin token may be it).
    metrics_token: str = ""
    # The data channel: Put/Get payloads as raw bytes on a socket beside gRPC's (docs/API.md), several times
    # faster than gRPC's bytes for workers that cannot map the shared pool; off: payloads over gRPC only.
    data_channel: bool = True
    data_port: int = 0  # its TCP port on server.host (0: a free one, which clients learn from DataEndpoint); on a unix socket it is <unix_socket>.data
    data_max_request_bytes: ByteSize = ByteSize(64 * 2**30)  # payload bytes one data-channel Put may carry
    # A data-channel frame begun (a request's header, metadata or payload) that sends nothing for this long has its
    # connection closed, with what it had sent, and so has one whose client takes nothing of an answer for this long
    # (as the kernel's send queue tells, which moves in steps of a window or a socket buffer's segment, up to about
    # 64 KiB: a client reading at least that much per data_stall_s is not cut); a connection idle between requests
    # is not a stall (clients pool them): data_idle_s bounds it.
    data_stall_s: float = 30.0
    # A data-channel connection that sends no request for this long is closed (a client dials anew, unnoticed by its
    # calls): one tenant's abandoned connections held its share of them, and their buffers, for as long as the
    # client kept them; 0: idle connections stay open. A peer gone without a FIN is found sooner, by TCP keepalive (in about 90 s).
    data_idle_s: float = 300.0
    # The bytes every put's receive buffers may hold together, on the data channel and in gRPC Put streams (a
    # request's metadata, a block's payload buffer kept between blocks, a block's chunks being reassembled), taken
    # before they are buffered: 512 data connections sending large puts held up to 64 MiB each (32 GiB), 512 Put
    # streams up to a block of max_block_bytes each. A connection or stream that finds it spent reads nothing more
    # (TCP's, HTTP/2's flow control slows its sender) until room comes, for receive_buffer_wait_s at most. A fixed
    # size, not a share of the host's memory: what a fast put needs is a few block buffers per busy connection, not
    # more on a larger host (1 GiB: 16 connections each receiving 64 MiB blocks at once). At least twice
    # max_block_bytes (a connection may buffer half of it); 0: no bound.
    receive_buffer_bytes: ByteSize = ByteSize(2**30)
    # With tenancy on, the share of receive_buffer_bytes one tenant's puts may hold (admins: the total only), so one
    # tenant's slow senders cannot take every byte from the others.
    receive_buffer_fraction_per_tenant: float = 0.5
    # How long a put (a data-channel request, a Put stream's block) waits for room in receive_buffer_bytes before it
    # is refused RESOURCE_EXHAUSTED (on the data channel its body drained, the connection kept): below a client's
    # timeout_s (30 s by default), which would otherwise cut the connection it sees taking nothing.
    receive_buffer_wait_s: float = 10.0
    # The HTTP/2 receive window of each gRPC stream to the daemon: what a client may send on a call ahead of what the
    # daemon has read, held in grpc's own buffers, outside receive_buffer_bytes. Fixed, so a Put stream waiting for
    # room in that budget holds at most this much unread (plus the message it had read): all streams together about
    # max_concurrent_rpcs times it (2 GiB), where grpc's BDP probing grew each stalled stream's window to a whole
    # block (96 stalled streams grew a daemon by up to 3 GiB). 4 MiB is the window grpc itself picks on a link whose
    # bandwidth-delay product is up to 2 MiB (10 Gbit/s at 1.6 ms); a client sending over a longer, faster link
    # may need more. 0: grpc's BDP probing sizes it (up to 1 GiB a stream).
    grpc_stream_window_bytes: ByteSize = ByteSize(4 * 2**20)
    # A gRPC stream (Get, Resume, FetchBlocks) whose client takes none of its messages for this long is ended
    # DEADLINE_EXCEEDED and what it held (the block being sent, the blocks' read holds, the tenant's call share) is
    # let go. HTTP/2's flow control shows only whole messages taken, each once the client has read about a window
    # (a few MiB) ahead of it: a client must read that much within this time. The same bound holds for what a
    # client sends: a call's request message (a Put stream's next message) must arrive within it of the call's
    # headers (of the message before), or the call ends DEADLINE_EXCEEDED and frees its slot.
    stream_stall_s: float = 30.0


@dataclass
class DramConfig:
    capacity: ByteSize = ByteSize(4 * 2**30)  # the DRAM tier's budget; checked against MemAvailable and shm_dir
    # shared: one segment in shm_dir that a co-located worker maps (zero-copy Get), pinned when CUDA is
    # present; private: payloads as bytes objects in the daemon's own memory (no zero-copy).
    pool: str = "shared"
    shm_dir: str = "/dev/shm"  # where the shared pool's segment file lives (a tmpfs; docker: raise --shm-size)
    page_bytes: ByteSize = ByteSize(0)  # allocation unit of the pool; 0: capacity / 64Ki, in [16 B, 64 KiB]
    pin: bool = True  # register the shared pool with CUDA (cudaHostRegister) when a GPU is present
    # populate the shared pool's pages in the background at start (pinning does it on a GPU host), so puts into
    # a cold pool do not pay a page fault per 4 KiB; its memory is then taken from the start
    prefault: bool = True


@dataclass
class HbmConfig:
    capacity: ByteSize = ByteSize(0)  # 0: no HBM tier; else one preallocated device buffer of this size
    device: str = "cuda"  # a torch device; "cpu" runs the same pool logic without a GPU (tests)
    page_bytes: ByteSize = ByteSize(0)  # as tiers.dram.page_bytes


@dataclass
class NvmeConfig:
    path: str = ""  # a directory, new or empty or Engram's (any other is refused); empty: no NVMe tier
    capacity: ByteSize = ByteSize(64 * 2**30)  # bytes of block files kept; beyond, the coldest are evicted
    compression: bool = False  # lz4 per block, kept only where it saves >= 10% (rarely, on FP4 payloads)
    io_threads: int = 4  # concurrent file operations
    fsync: bool = True  # fsync each block file and its directory before the block counts as written
    verify_on_start: bool = False  # read every payload during recovery (headers are always verified)


@dataclass
class TiersConfig:
    hbm: HbmConfig = field(default_factory=HbmConfig)
    dram: DramConfig = field(default_factory=DramConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    write_policy: str = "write-back"  # or "write-through": a put is acknowledged once it is on NVMe too
    retry_s: float = 5.0  # a tier degraded by a full disk is tried again after this long
    # Write-through when the NVMe copy cannot be made (disk full, I/O error, tier degraded): "fail" refuses the
    # put (UNAVAILABLE, nothing acknowledged); "degrade" acknowledges it as not durable (PutResponse.not_durable,
    # Stats.blocks_not_durable, a warning) and copies it to NVMe in the background once it recovers.
    on_nvme_failure: str = "fail"
    # Write-back's loss window (docs/RELIABILITY.md): blocks held only in DRAM/HBM are copied to NVMe in the
    # background once older than write_back_window_s (0: only when evicted), and puts wait while more than
    # write_back_window_bytes are held so (0: no bound but the DRAM tier's). A crash loses at most that.
    write_back_window_s: float = 5.0
    write_back_window_bytes: ByteSize = ByteSize(2**30)  # bytes held only in DRAM/HBM before puts wait
    shutdown_flush_s: float = 30.0  # on SIGTERM, time to copy blocks held only in DRAM/HBM to NVMe (0: none)
    # Which block a full tier gives up (engram/eviction.py), after the held classes (no live session, one,
    # several): "learned" draws between least recently used and a learned hit density by which order's victims
    # come back less; "lru": least recently used only.
    eviction: str = "learned"
    # A session whose client said when it is back (AppendSession expect_back_ms) has its blocks below the top
    # tier copied up this long before it is due, head first, up to half the top tier (0: never): its turn is
    # then served from memory.
    prefetch_lead_ms: float = 1000.0


@dataclass
class CodecConfig:
    # for models registered without a codec: raw, fp8_e4m3, nvfp4, mxfp4, or auto: nvfp4 where the daemon encodes
    # fast (a GPU, or the compiled CPU codec), raw where it could only use the slow PyTorch reference
    default: str = "auto"
    backend: str = "auto"  # where the daemon encodes and decodes: auto (triton on CUDA, else cpu), cpu, reference, triton
    # Error telemetry (Stats, /metrics): every quality_sample-th block the daemon stores from raw elements (a raw put)
    # is decoded again off the put path and compared with them, per layer (0: off); a raw model's, stored as sent, is
    # counted with error 0 without a measurement. Blocks a worker encoded are not measured: the daemon never sees
    # their raw elements.
    quality_sample: int = 64
    # Lossless fallback: once a lossy codec's mean relative error on a layer kind exceeds max_error in a namespace
    # (its own samples), whole blocks of that namespace the daemon would encode with it that hold such layers are
    # stored bit-exact instead (a v1 block of the raw codec) until restart; 0: off. NVFP4 measures about 0.1 on Gaussian data, FP8 E4M3 a few hundredths.
    max_error: float = 0.0


@dataclass
class ReplayConfig:
    # comma-separated models the daemon can replay with: HF checkpoint directories (config.json + safetensors
    # shards: gpt-oss, Gemma 2/3, Ministral and Qwen2/3 with sliding layers beside full-attention ones) or decoder
    # files (save_decoder). A model whose every layer slides (Mistral v0.1: sliding_window, no layer_types) has no
    # global KV to replay from: refused at start-up
    models: str = ""
    device: str = "auto"  # auto (cuda when present), cpu, cuda
    dtype: str = "auto"  # a checkpoint's: auto (bfloat16 on cuda, float32 on cpu), bfloat16, float16, float32, float64
    max_hot_windows: int = 64  # rebuilt SWA windows kept in memory; beyond, the least recent of the tenant holding most goes
    # Replays run this many at once, on threads of their own (decodes and encodes keep theirs); more Resumes wait
    # their turn, round-robin between tenants (each tenant's in order). A Resume cancelled while it waits never
    # runs; one cancelled while it runs holds its turn until it ends.
    max_concurrent: int = 2
    max_queued: int = 64  # Resumes waiting for a replay's turn; one more is refused (RESOURCE_EXHAUSTED: prefill)
    # With tenancy on, the Resumes of one tenant's token that may wait for a turn (admins: no bound); past it its
    # Resumes are RESOURCE_EXHAUSTED, so one tenant's burst cannot fill max_queued for every other. 0: no bound.
    max_queued_per_tenant: int = 16
    max_persisted_window_bytes: ByteSize = ByteSize(2**30)  # persisted windows (persist mode, auto's), all together
    # With tenancy on, the bytes of persisted windows one tenant's token kept (sent, forked or, auto mode, had kept,
    # on its own sessions; admins: no bound), so one tenant cannot take max_persisted_window_bytes from the others.
    # 0: no bound.
    max_persisted_window_bytes_per_tenant: ByteSize = ByteSize(256 * 2**20)
    # auto-mode sessions: calibrations written by `engram bench replay --calibrate DIR` (one per model and
    # machine; none: auto behaves as exact), and the fidelity floor an approximate replay must have measured
    calibrations: str = ""
    min_top1: float = 0.99  # next-token top-1 agreement with the exact window over the benchmark's prompts
    max_kl: float = 0.01  # next-token KL divergence (nats); 0 = no bound


@dataclass
class TenantConfig:
    token: str = ""  # its bearer token; or env:VAR / file:PATH, read when the daemon starts
    namespaces: str = ""  # comma-separated namespaces it may act in; empty: the tenant's own name
    quota: ByteSize = ByteSize(0)  # bytes each of its namespaces may hold (blocks, persisted windows); 0: unlimited
    max_sessions: int = 0  # its own live sessions in each of its namespaces; 0: server.max_sessions_per_namespace


@dataclass
class AuthConfig:
    """Tenancy is on as soon as a tenant or an admin token is configured (engram/tenancy.py)."""

    # [auth.tenants.NAME] tables; "", peer, peer:<anything> and admin-<number> are reserved (the daemon's own callers)
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    tenants_file: str = ""  # a TOML file of [tenants.NAME] tables and admin_tokens: secrets out of the config
    admin_tokens: str = ""  # comma-separated; each may be env:VAR or file:PATH
    salt_secret: str = ""  # derives every namespace's key salt (env:VAR / file:PATH); the same on every node
    # Same-host zero-copy hits and in-place puts map the one shared DRAM pool, which holds every tenant's blocks:
    # "auto" allows them without tenancy and refuses them with it (hits and puts then travel as bytes); "on"
    # trusts this host's workers with every tenant's blocks; "off" refuses them always.
    same_host_paths: str = "auto"

    @property
    def enabled(self) -> bool:
        return bool(self.tenants or self.tenants_file or self.admin_tokens)

    @property
    def same_host_allowed(self) -> bool:
        return self.same_host_paths == "on" or (self.same_host_paths == "auto" and not self.enabled)


@dataclass
class ClusterConfig:
    redis_url: str = ""  # redis://host:6379/0, rediss:// for TLS (a password may sit in it); empty: no cluster tier
    redis_password: str = ""  # Redis AUTH password (env:VAR / file:PATH), instead of one in redis_url
    redis_ca_cert: str = ""  # PEM CA that signed Redis's certificate (rediss://); empty: the system's CAs
    redis_client_cert: str = ""  # PEM certificate this daemon shows Redis (with redis_client_key), if it asks
    redis_client_key: str = ""  # PEM private key of redis_client_cert
    redis_cluster: bool = False  # redis_url names a node of a Redis Cluster (redis-py's cluster client)
    secret: str = ""  # signs records in Redis and MACs blocks between peers (env:VAR / file:PATH); every node
    node_id: str = ""  # unique per daemon; empty: the advertised address
    advertise: str = ""  # the address peers dial to fetch blocks; empty: the address the daemon bound
    heartbeat_s: float = 2.0  # how often a node refreshes its liveness key
    ttl_s: float = 10.0  # a node whose key is older than this is dead: its blocks are ignored
    peer_token: str = ""  # bearer token daemons present to each other (env:VAR / file:PATH); empty: from secret
    peer_root_cert: str = ""  # PEM root certificate to verify peers that serve TLS
    fetch_timeout_s: float = 5.0  # one peer fetch; past it the block counts as a miss
    # The most one call's copying from peers may take in all (a Get's keys, a Lookup's fill), or the call's own
    # deadline (less a second, or a quarter of its time, for the answer) where that is sooner: past it a Get is DEADLINE_EXCEEDED, a Lookup answers what it holds by then.
    # Below a client's default timeout_s (30 s), so that the client hears why
    fill_timeout_s: float = 20.0
    # The most blocks one Get or Lookup copies from peers (a Get's keys with the ancestors this daemon lacks): a
    # Get of keys deeper than this below anything held here is NOT_FOUND at once, nothing copied
    max_fetch_blocks: int = 4096
    # A block's record of holders in Redis expires this long after a holder last wrote it; every node writes all
    # of its own again each third of it, so only records no live node holds go (a crashed node's, a stopped one's)
    record_ttl_s: float = 3600.0
    # Whose blocks a daemon shares, given that a tenant reads, through the daemon it calls, peers' blocks of the
    # namespaces that daemon grants it: "same" serves FetchBlocks to, and fetches from, only peers whose [auth]
    # (tenants' tokens and namespaces, admin tokens, salt_secret) is this daemon's, as each publishes it (others
    # are misses); "any" shares with every member, trusting each peer's grants as its own
    peer_grants: str = "same"


@dataclass
class LoggingConfig:
    level: str = "info"  # debug, info, warning or error
    json: bool = False  # one JSON object per line: time, level, logger, event, fields
    summary_s: float = 10.0  # evictions, corrupt blocks and tier health are summarized this often


@dataclass
class EngramConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def validate(self) -> EngramConfig:
        s = self.server
        if not 0 <= s.port <= 65535:
            raise ConfigError(f"server.port must be in 0..65535, got {s.port}")
        if not 0 <= s.data_port <= 65535:
            raise ConfigError(f"server.data_port must be in 0..65535 (0: a free port), got {s.data_port}")
        if s.data_max_request_bytes <= 0:
            raise ConfigError("server.data_max_request_bytes must be positive")
        if not 0 < s.receive_buffer_fraction_per_tenant <= 1:  # NaN too
            raise ConfigError("server.receive_buffer_fraction_per_tenant must be a fraction of "
                              f"server.receive_buffer_bytes in (0, 1], got {s.receive_buffer_fraction_per_tenant}")
        if s.receive_buffer_bytes < 0:
            raise ConfigError(f"server.receive_buffer_bytes must be >= 0 (0: no bound), got {s.receive_buffer_bytes}")
        receive_share = s.receive_buffer_fraction_per_tenant if self.auth.enabled else 1.0
        self._receive_room(receive_share, "max_block_bytes", int(s.max_block_bytes),
                           "a put buffers at most half of it, and a block of the largest model must fit")
        for key, zero in DURATIONS:
            _check_duration(key, _get(self, key), zero)
        if not -1 <= s.metrics_port <= 65535:
            raise ConfigError(f"server.metrics_port must be 0 (off), -1 (any free port) or 1..65535, got {s.metrics_port}")
        if s.metrics_port and not s.metrics_token and self.auth.enabled:
            raise ConfigError(
                "server.metrics_port is set with tenancy on but server.metrics_token is not: /metrics shows every "
                "tenant's activity (tier bytes, bytes served, lookup tokens: another tenant's prompt lengths) to "
                "whoever can reach it. Set server.metrics_token (a secret: env:VAR or file:PATH) and send it from "
                "Prometheus (authorization: credentials_file), or set server.metrics_port = 0")
        if s.chunk_bytes <= 0 or s.chunk_bytes + 4096 > s.max_message_bytes:
            raise ConfigError(
                f"server.chunk_bytes ({s.chunk_bytes}) must be positive and leave room for headers "
                f"under server.max_message_bytes ({s.max_message_bytes})"
            )
        if self.tiers.dram.capacity <= 0:
            raise ConfigError("tiers.dram.capacity must be positive")
        self._validate_pools()
        if self.tiers.write_policy not in {"write-back", "write-through"}:
            raise ConfigError(f"tiers.write_policy must be write-back or write-through, got {self.tiers.write_policy!r}")
        if self.tiers.write_policy == "write-through" and not self.tiers.nvme.path:
            raise ConfigError("tiers.write_policy = write-through needs an NVMe tier: set tiers.nvme.path")
        t = self.tiers
        if t.eviction not in {"learned", "lru"}:
            raise ConfigError(f"tiers.eviction must be learned or lru, got {t.eviction!r}")
        if not 0 <= t.prefetch_lead_ms <= 3_600_000:
            raise ConfigError(f"tiers.prefetch_lead_ms must be between 0 and an hour, got {t.prefetch_lead_ms}")
        if t.on_nvme_failure not in {"fail", "degrade"}:
            raise ConfigError(f"tiers.on_nvme_failure must be fail or degrade, got {t.on_nvme_failure!r}")
        if t.write_back_window_bytes < 0:
            raise ConfigError("tiers.write_back_window_bytes must be >= 0 (0: no bound but the DRAM tier's)")
        if self.tiers.nvme.path and (self.tiers.nvme.capacity <= 0 or self.tiers.nvme.io_threads < 1):
            raise ConfigError("tiers.nvme.capacity must be positive and tiers.nvme.io_threads >= 1")
        if self.codec.default not in {"auto", "raw", "fp8_e4m3", "nvfp4", "mxfp4"}:
            raise ConfigError(f"codec.default must be auto, raw, fp8_e4m3, nvfp4 or mxfp4, got {self.codec.default!r}")
        if self.codec.backend not in {"auto", "cpu", "reference", "triton"}:
            raise ConfigError(f"codec.backend must be auto, cpu, reference or triton, got {self.codec.backend!r}")
        if self.codec.quality_sample < 0:
            raise ConfigError(f"codec.quality_sample must be >= 0 (0: off), got {self.codec.quality_sample}")
        if not self.codec.max_error >= 0:  # NaN too
            raise ConfigError(f"codec.max_error must be >= 0 (0: off), got {self.codec.max_error}")
        if s.max_leased_blocks_per_namespace < 0:
            raise ConfigError("server.max_leased_blocks_per_namespace must be >= 0 (0: no bound), got "
                              f"{s.max_leased_blocks_per_namespace}")
        for key, fraction in (("server.max_reserved_pool_fraction", s.max_reserved_pool_fraction),
                              ("server.max_reserved_pool_fraction_per_tenant", s.max_reserved_pool_fraction_per_tenant)):
            if not 0 < fraction <= 1:  # NaN too
                raise ConfigError(f"{key} must be a fraction of the shared pool in (0, 1], got {fraction}")
        if not 0 < s.max_pinned_fraction_per_tenant <= 1:  # NaN too
            raise ConfigError("server.max_pinned_fraction_per_tenant must be a fraction of the largest tier in (0, 1], "
                              f"got {s.max_pinned_fraction_per_tenant}")
        if s.max_reserved_pool_fraction_per_tenant > s.max_reserved_pool_fraction:
            raise ConfigError("server.max_reserved_pool_fraction_per_tenant must be at most "
                              f"server.max_reserved_pool_fraction ({s.max_reserved_pool_fraction}), got "
                              f"{s.max_reserved_pool_fraction_per_tenant}")
        if s.max_concurrent_rpcs_per_tenant < 0:
            raise ConfigError("server.max_concurrent_rpcs_per_tenant must be >= 0 (0: no bound), got "
                              f"{s.max_concurrent_rpcs_per_tenant}")
        if s.max_message_bytes > 2**31 - 1:
            raise ConfigError(f"server.max_message_bytes is at most 2 GiB - 1 (gRPC's int32), got {s.max_message_bytes}")
        self._receive_room(receive_share, "max_message_bytes", int(s.max_message_bytes),
                           "each gRPC Put stream holds that much of it as metadata, which may take at most half")
        if s.grpc_stream_window_bytes and not 2**16 <= s.grpc_stream_window_bytes <= 2**30:
            raise ConfigError("server.grpc_stream_window_bytes must be 0 (grpc's BDP probing) or from 64 KiB to 1 GiB "
                              f"(grpc's largest), got {s.grpc_stream_window_bytes}")
        for key, value in (("server.max_block_bytes", s.max_block_bytes), ("server.max_models", s.max_models),
                           ("server.max_models_per_tenant", s.max_models_per_tenant),
                           ("server.max_concurrent_rpcs", s.max_concurrent_rpcs),
                           ("server.max_concurrent_open_rpcs", s.max_concurrent_open_rpcs),
                           ("server.max_blocks_per_request", s.max_blocks_per_request),
                           ("server.max_tokens_per_request", s.max_tokens_per_request),
                           ("server.max_sessions_per_namespace", s.max_sessions_per_namespace),
                           ("replay.max_persisted_window_bytes", self.replay.max_persisted_window_bytes),
                           ("cluster.max_fetch_blocks", self.cluster.max_fetch_blocks)):
            if value <= 0:
                raise ConfigError(f"{key} must be positive, got {value}")
        if not s.gc_full_s >= s.gc_freeze_s:
            raise ConfigError(f"server.gc_full_s must be at least as long as server.gc_freeze_s, got {s.gc_full_s} and "
                              f"{s.gc_freeze_s}")
        if self.replay.max_hot_windows < 0:
            raise ConfigError("replay.max_hot_windows must be >= 0")
        if self.replay.max_concurrent < 1 or self.replay.max_queued < 0:
            raise ConfigError(f"replay.max_concurrent must be >= 1 and replay.max_queued >= 0, got "
                              f"{self.replay.max_concurrent} and {self.replay.max_queued}")
        for key, value in (("server.max_live_session_tokens", s.max_live_session_tokens),
                           ("server.max_live_session_tokens_per_tenant", s.max_live_session_tokens_per_tenant),
                           ("replay.max_queued_per_tenant", self.replay.max_queued_per_tenant),
                           ("replay.max_persisted_window_bytes_per_tenant",
                            self.replay.max_persisted_window_bytes_per_tenant)):
            if value < 0:
                raise ConfigError(f"{key} must be >= 0 (0: no bound), got {value}")
        for path in filter(None, (p.strip() for p in self.replay.models.split(","))):
            if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
                raise ConfigError(f"replay.models: {path} is a directory without config.json (an HF checkpoint "
                                  "directory has config.json and *.safetensors shards)")
            if not Path(path).exists():
                raise ConfigError(f"replay.models: {path} does not exist (an HF checkpoint directory, or a decoder "
                                  "file saved with engram.replay.save_decoder)")
        if not 0.0 <= self.replay.min_top1 <= 1.0 or self.replay.max_kl < 0:
            raise ConfigError("replay.min_top1 must be within [0, 1] and replay.max_kl >= 0")
        if self.replay.calibrations and not Path(self.replay.calibrations).is_dir():
            raise ConfigError(f"replay.calibrations: {self.replay.calibrations} is not a directory (write one with "
                              "engram bench replay --calibrate DIR)")
        if self.replay.dtype not in ("auto", "bfloat16", "float16", "float32", "float64"):
            raise ConfigError(f"replay.dtype must be auto, bfloat16, float16, float32 or float64, not "
                              f"{self.replay.dtype!r}")
        _validate_tls(s)
        _refuse_redacted(self)
        _validate_auth(self.auth)
        _validate_cluster(self.cluster, self.auth)
        if self.logging.level.lower() not in {"debug", "info", "warning", "error"}:
            raise ConfigError(f"logging.level must be debug, info, warning or error, got {self.logging.level!r}")
        return self

    def _receive_room(self, share: float, key: str, n: int, why: str) -> None:
        """server.receive_buffer_bytes (times a tenant's share) must hold twice `n`, server.<key> (0: no bound)."""
        total = int(self.server.receive_buffer_bytes)
        if total and total * share < 2 * n:
            raise ConfigError(
                f"server.receive_buffer_bytes ({total}"
                f"{' x server.receive_buffer_fraction_per_tenant' if self.auth.enabled else ''}) must be at least twice "
                f"server.{key} ({n}): {why} (0: no bound)")

    def _validate_pools(self) -> None:
        d, h = self.tiers.dram, self.tiers.hbm
        if d.pool not in {"shared", "private"}:
            raise ConfigError(f"tiers.dram.pool must be shared or private, got {d.pool!r}")
        for key, page in (("tiers.dram.page_bytes", d.page_bytes), ("tiers.hbm.page_bytes", h.page_bytes)):
            if page < 0 or (page and page & (page - 1)):
                raise ConfigError(f"{key} must be 0 (auto) or a power of two, got {page}")
        if h.capacity < 0:
            raise ConfigError("tiers.hbm.capacity must be >= 0 (0: no HBM tier)")
        if h.capacity:
            import torch

            try:
                dev = torch.device(h.device)
            except RuntimeError:
                raise ConfigError(f"tiers.hbm.device {h.device!r} is not a torch device (cuda, cuda:1, cpu)") from None
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ConfigError("tiers.hbm.capacity is set but no CUDA device is present; set tiers.hbm.capacity "
                                  "= 0 (or tiers.hbm.device = cpu to exercise the tier without a GPU)")


# Every time setting, with what 0 means where 0 is allowed (None: it must be positive). Each must be finite: inf
# passed every bound (`> 0`, `>= 0`) and meant a stall cut, lease or flush that never comes, or a wait threading
# refuses (OverflowError); a key with an "off" says so with 0. (NaN is refused as it is read: _coerce.)
DURATIONS: tuple[tuple[str, str | None], ...] = (
    ("server.session_idle_s", "sessions never close idle"), ("server.gc_freeze_s", "CPython's schedule"),
    ("server.gc_full_s", "CPython's schedule"), ("server.shutdown_grace_s", "in-flight calls are cut at once"),
    ("server.lease_s", None), ("server.data_stall_s", None),
    ("server.data_idle_s", "idle data-channel connections stay open"), ("server.stream_stall_s", None),
    ("server.receive_buffer_wait_s", "refused at once when the buffers are full"),
    ("tiers.retry_s", "tried again at once"), ("tiers.write_back_window_s", "only when evicted"),
    ("tiers.shutdown_flush_s", "none copied"), ("tiers.prefetch_lead_ms", "never"),
    ("cluster.heartbeat_s", None), ("cluster.ttl_s", None), ("cluster.fetch_timeout_s", None),
    ("cluster.fill_timeout_s", None),
    ("cluster.record_ttl_s", None), ("logging.summary_s", None),
)


def _get(node: object, key: str) -> Any:
    """The value of a dotted key."""
    for name in key.split("."):
        node = getattr(node, name)
    return node


def _check_duration(key: str, value: float, zero: str | None) -> None:
    unit = "milliseconds" if key.endswith("_ms") else "seconds"
    if not math.isfinite(value) or value < 0 or (zero is None and value == 0):
        bound = f">= 0 (0: {zero})" if zero is not None else "> 0"
        raise ConfigError(f"{key} must be a finite number of {unit} {bound}, got {value}")


def _validate_tls(s: ServerConfig) -> None:
    if bool(s.tls_cert) != bool(s.tls_key):
        raise ConfigError("server.tls_cert and server.tls_key go together: set both (PEM files) or neither")
    for key in ("tls_cert", "tls_key"):
        path = getattr(s, key)
        if path and not Path(path).is_file():
            raise ConfigError(f"server.{key}: {path} is not a file")
    if s.unix_socket_group:
        from engram.private import group_id

        group_id(s.unix_socket_group)  # a group that does not exist is a config error now, not at bind time
    if s.tls_cert and s.unix_socket:
        raise ConfigError("server.tls_cert: TLS is for TCP; a unix socket is protected by its file permissions")


RESERVED_TENANT_NAMES = "the empty name, peer, peer:<anything> and admin-<number>"


def check_tenant_name(name: str, where: str) -> None:
    """Refuse the names the daemon gives its own callers (engram/tenancy.py: the peer daemons of a cluster, the
    admin tokens): a tenant so named would share their count of calls in flight, and their models added. The empty
    name is every admin's (engram/server/auth.py tenant_of): a tenant so named was one to every per-tenant check,
    seeing every model and the admins' sessions, in no share."""
    if not name or name == "peer" or name.startswith("peer:") or re.fullmatch(r"admin-[0-9]+", name):
        raise ConfigError(f"{where}: the tenant name {name!r} is reserved ({RESERVED_TENANT_NAMES} are the "
                          "daemon's names for its peers and admin tokens); give the tenant another name")


def check_tenant(name: str, t: TenantConfig, where: str) -> None:
    """A tenant's table, from the config or from auth.tenants_file (`where` names it)."""
    check_tenant_name(name, where)
    if not t.token:
        raise ConfigError(f"{where}.token is empty: give the tenant a bearer token (or env:VAR)")
    if t.quota < 0:
        raise ConfigError(f"{where}.quota must be >= 0 (0: unlimited)")
    if t.max_sessions < 0:
        raise ConfigError(f"{where}.max_sessions must be >= 0 (0: server.max_sessions_per_namespace)")


def _validate_auth(a: AuthConfig) -> None:
    for name, t in a.tenants.items():
        check_tenant(name, t, f"auth.tenants.{name}")
    if a.tenants_file and not Path(a.tenants_file).is_file():
        raise ConfigError(f"auth.tenants_file: {a.tenants_file} is not a file")
    if a.same_host_paths not in ("auto", "on", "off"):
        raise ConfigError(f"auth.same_host_paths must be auto, on or off, got {a.same_host_paths!r}")
    if a.enabled and not a.salt_secret:
        raise ConfigError("auth.salt_secret is empty: tenancy salts every namespace's keys with it; set a secret "
                          "(or env:VAR / file:PATH), the same on every daemon of a cluster")


def _validate_cluster(c: ClusterConfig, a: AuthConfig) -> None:
    if not c.redis_url:
        return
    shown = _redact("cluster.redis_url", c.redis_url)  # a password in the URL stays out of the error
    if not c.redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"cluster.redis_url must start with redis://, rediss:// or unix://, got {shown!r}")
    from urllib.parse import urlsplit

    try:
        url = urlsplit(c.redis_url)
        url.port  # noqa: B018 (a port that is not a number raises here, not at the first connect)
    except ValueError as exc:
        raise ConfigError(f"cluster.redis_url {shown!r}: {exc}") from None
    db = url.path.lstrip("/")
    if url.scheme != "unix" and db and not db.isdigit():
        raise ConfigError(f"cluster.redis_url {shown!r}: the database after the last / is a number, got {db!r}")
    if not c.record_ttl_s > 3 * c.ttl_s:
        raise ConfigError(f"cluster.record_ttl_s ({c.record_ttl_s}) must exceed 3 x cluster.ttl_s ({c.ttl_s})")
    if c.ttl_s <= c.heartbeat_s:
        raise ConfigError(f"cluster.ttl_s ({c.ttl_s}) must exceed cluster.heartbeat_s ({c.heartbeat_s})")
    if not c.secret:
        raise ConfigError("cluster.secret is empty: Redis is not trusted, so daemons sign what they publish there "
                          "and MAC the blocks they send each other with a secret; set the same one on every node "
                          "(env:VAR or file:PATH keep it out of the config)")
    if c.peer_grants not in ("same", "any"):
        raise ConfigError(f"cluster.peer_grants must be same (share blocks only with daemons whose [auth] grants are "
                          f"this one's) or any (with every member, trusting its grants), got {c.peer_grants!r}")
    if bool(c.redis_client_cert) != bool(c.redis_client_key):
        raise ConfigError("cluster.redis_client_cert and cluster.redis_client_key go together: set both or neither")
    for key in ("redis_ca_cert", "redis_client_cert", "redis_client_key", "peer_root_cert"):
        path = getattr(c, key)
        if path and not Path(path).is_file():
            raise ConfigError(f"cluster.{key}: {path} is not a file")
    if (c.redis_ca_cert or c.redis_client_cert) and not c.redis_url.startswith("rediss://"):
        raise ConfigError("cluster.redis_ca_cert / cluster.redis_client_cert are for TLS: write the URL as rediss://")


def _coerce(value: object, typ: Any, where: str) -> object:
    if typ is ByteSize:
        try:
            return parse_bytes(value)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in {"1", "true", "yes", "on", "0", "false", "no", "off"}:
            return value.lower() in {"1", "true", "yes", "on"}
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            return int(value)
    elif typ is float:
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is not None:
            if math.isnan(number):  # passes every `< 0` check and compares false with anything after
                raise ConfigError(f"{where}: expected a number, got NaN")
            return number
    elif typ is str and isinstance(value, str):
        return value
    raise ConfigError(f"{where}: expected {getattr(typ, '__name__', typ)}, got {value!r}")


def _set(node: object, path: list[str], value: object, full: str) -> None:
    hints = typing.get_type_hints(type(node))
    names = {f.name for f in dataclasses.fields(node)}  # type: ignore[arg-type]
    head = path[0]
    if head not in names:
        raise ConfigError(f"unknown config key {full!r}: {type(node).__name__} has {sorted(names)}")
    if typing.get_origin(hints[head]) is dict:  # a table of named sections: [auth.tenants.NAME]
        if len(path) < 3:
            raise ConfigError(f"config key {full!r}: write {head}.NAME.KEY (e.g. auth.tenants.alice.token)")
        entry_type = typing.get_args(hints[head])[1]
        entry = getattr(node, head).setdefault(path[1], entry_type())
        _set(entry, path[2:], value, full)
        return
    if len(path) == 1:
        if dataclasses.is_dataclass(hints[head]):
            raise ConfigError(f"config key {full!r} is a section; set one of its keys")
        setattr(node, head, _coerce(value, hints[head], full))
    else:
        child = getattr(node, head)
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"unknown config key {full!r}: {'.'.join(path[:1])} is not a section")
        _set(child, path[1:], value, full)


def _apply_tree(cfg: EngramConfig, tree: Mapping[str, object], prefix: str = "") -> None:
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _apply_tree(cfg, value, f"{full}.")
        else:
            _set(cfg, full.split("."), value, full)


def is_config_variable(name: str) -> bool:
    """ENGRAM_<SECTION>__<KEY>: the prefix, then a double underscore somewhere (every key is in a section).
    ENGRAM_CONFIG, the CLI's ENGRAM_TOKEN, and secrets such as ENGRAM_SALT that a config names by env:VAR
    have none, so they never collide with a key."""
    return name.startswith(ENV_PREFIX) and "__" in name[len(ENV_PREFIX):]


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> EngramConfig:
    """Build the configuration: defaults < TOML file < ENGRAM_* environment < overrides (CLI flags)."""
    env = os.environ if env is None else env
    cfg = EngramConfig()
    path = path or env.get(ENV_CONFIG_FILE) or None
    if path is not None:
        _apply_tree(cfg, read_toml(path, f"config file {path}"))
    from_env: dict[str, str] = {}  # dotted key -> the variable that set it, as an error names it
    for name, value in sorted(env.items()):
        if not is_config_variable(name):
            continue
        dotted = name[len(ENV_PREFIX):].lower().replace("__", ".")
        from_env[dotted] = f"{name}={_shown(dotted, value)}"
        try:
            _set(cfg, dotted.split("."), value, dotted)
        except ConfigError as exc:
            raise ConfigError(f"{from_env[dotted]}: {exc}") from None
    for key, override in (overrides or {}).items():
        _set(cfg, key.split("."), override, key)
        from_env.pop(key, None)  # the flag's value is the one in force
    try:
        return cfg.validate()
    except ConfigError as exc:
        raise _naming_variables(exc, from_env) from None


def _naming_variables(exc: ConfigError, from_env: Mapping[str, str]) -> ConfigError:
    """`exc` led by the ENGRAM_* variables that set a key it names: a value out of range from the environment
    said which key, and the key is nowhere in the config file to look for. Messages name keys in full."""
    named = [source for key, source in from_env.items() if re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", str(exc))]
    return type(exc)(f"{', '.join(named)}: {exc}") if named else exc


def config_keys(node: object | None = None, prefix: str = "") -> list[str]:
    """Every settable key, dotted: what `engram config` lists and tests check deployment files against."""
    node = EngramConfig() if node is None else node
    keys = []
    for f in dataclasses.fields(node):  # type: ignore[arg-type]
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            keys += config_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


REDACTED = "redacted:"  # what `engram config` prints for a literal secret; refused when a config is loaded


def _secret_fields(tree: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], str]]:
    """(dotted key, its table, field) of every secret in a config tree: tokens, salts, signing secrets,
    passwords (paths to key files are not secrets themselves)."""
    out = [(key, tree[section], name) for key in _SECRET_KEYS for section, name in [key.split(".")]]
    out += [(f"auth.tenants.{name}.token", t, "token") for name, t in tree["auth"]["tenants"].items()]
    return out


def secret_files(cfg: EngramConfig) -> list[tuple[str, str]]:
    """(setting, path) of each file the daemon reads secrets from: auth.tenants_file (every tenant's token) and
    every file:PATH reference of a secret setting, each file once."""
    files = {cfg.auth.tenants_file: "auth.tenants_file"} if cfg.auth.tenants_file else {}
    for key, table, name in _secret_fields(dataclasses.asdict(cfg)):
        value = table[name]
        for ref in (value.split(",") if key == "auth.admin_tokens" else [value]):
            if ref.strip().startswith("file:"):
                files.setdefault(ref.strip()[5:], key)
    return [(key, path) for path, key in files.items()]


_SECRET_KEYS = ("auth.admin_tokens", "auth.salt_secret", "cluster.secret", "cluster.peer_token",
                "cluster.redis_password", "cluster.redis_url", "server.metrics_token")  # and each tenant's token


def _shown(key: str, value: str) -> str:
    """A value as an error shows it: a secret as `engram config` prints it, anything else as it is."""
    secret = key in _SECRET_KEYS or re.fullmatch(r"auth\.tenants\.[^.]+\.token", key)
    return _redact(key, value) if secret else value


def _redact(key: str, value: str) -> str:
    """A secret as printed: env:VAR and file:PATH references as they are (pointers, not secrets), a literal
    as REDACTED; a Redis URL keeps everything but its password."""
    if key == "cluster.redis_url":  # redis://user:PASSWORD@host, or ?password=PASSWORD
        value = re.sub(r"^(\w+://[^:@/]*:)[^@/]+@", lambda m: f"{m.group(1)}{REDACTED}@", value)
        return re.sub(r"([?&]password=)[^&]*", lambda m: f"{m.group(1)}{REDACTED}", value)
    if key == "auth.admin_tokens":
        return ",".join(_redact("", t.strip()) for t in value.split(",")) if value else value
    return value if not value or value.startswith(("env:", "file:")) else REDACTED


def as_dict(cfg: EngramConfig, *, secrets: bool = False) -> dict[str, Any]:
    """The configuration as a tree; literal secrets replaced by REDACTED unless `secrets`."""
    tree = dataclasses.asdict(cfg)
    if not secrets:
        for key, table, name in _secret_fields(tree):
            table[name] = _redact(key, table[name])  # type: ignore[index]
    return tree


def _refuse_redacted(cfg: EngramConfig) -> None:
    for key, table, name in _secret_fields(dataclasses.asdict(cfg)):
        if REDACTED in table[name]:
            raise ConfigError(f"{key} holds {REDACTED!r}, what `engram config` prints in place of a secret: put the "
                              "secret back (better: env:VAR or file:PATH), or print the config with --show-secrets")


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value if not isinstance(value, int) else int(value))
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string (the same escapes)
    raise TypeError(f"no TOML form for {value!r}")


def _toml_tables(tree: Mapping[str, Any], name: str, out: list[str]) -> None:
    scalars = [(k, v) for k, v in tree.items() if not isinstance(v, Mapping)]
    if scalars:
        out.append(f"\n[{name}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in scalars]
    for key, value in tree.items():
        if isinstance(value, Mapping):
            quoted = key if _BARE_KEY.fullmatch(key) else json.dumps(key)
            if value:  # an empty table of named sections (no tenants) is left out
                _toml_tables(value, f"{name}.{quoted}", out)


def to_toml(cfg: EngramConfig, *, secrets: bool = False) -> str:
    """The whole tree as a TOML file that load_config reads back to the same configuration (`engram config`);
    without `secrets` literal secrets are REDACTED, which load_config refuses until they are put back."""
    out: list[str] = ["# engram config: the effective configuration; `engram serve --config FILE` loads it back"]
    if not secrets and as_dict(cfg) != dataclasses.asdict(cfg):
        out.append(f"# literal secrets are printed as {REDACTED!r}: put them back (or env:VAR / file:PATH) to load it")
    for section, tree in as_dict(cfg, secrets=secrets).items():
        _toml_tables(tree, section, out)
    return "\n".join(out).lstrip("\n") + "\n"
