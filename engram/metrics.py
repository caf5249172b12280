"""Prometheus metrics for a daemon: an HTTP /metrics endpoint (prometheus-client), per-RPC counters and
latency histograms (a grpc.aio server interceptor), and the store's own counters read at scrape time.

Nothing is added to the per-block hot path: tier, replay and corruption figures are the counters the
store already keeps (engram/store/counters.py), turned into metric families by a custom Collector when Prometheus
scrapes. Each daemon has its own CollectorRegistry, so two daemons in one process (tests) never mix.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from engram import eviction
from engram.sessions import SessionManager
from engram.store import BlockStore
from engram.wire.stream import answered

if TYPE_CHECKING:
    from engram.cluster import ClusterIndex

ANY_FREE_PORT = -1  # server.metrics_port = -1: bind any free port (tests); 0 turns metrics off


class StoreCollector(Collector):
    """Tier occupancy, hits, misses, evictions, bytes moved, replays and corrupt blocks, at scrape time."""

    def __init__(self, store: BlockStore, sessions: SessionManager) -> None:
        self.store = store
        self.sessions = sessions

    def collect(self) -> Iterator[Metric]:
        store = self.store
        label = ["tier"]
        fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "capacity": GaugeMetricFamily("engram_tier_capacity_bytes", "Tier budget in bytes.", labels=label),
            "used": GaugeMetricFamily("engram_tier_used_bytes", "Bytes held or reserved in the tier.", labels=label),
            "blocks": GaugeMetricFamily("engram_tier_blocks", "Blocks with a copy in the tier.", labels=label),
            "degraded": GaugeMetricFamily("engram_tier_degraded", "1 while the tier is degraded (e.g. ENOSPC).",
                                          labels=label),
            "hits": CounterMetricFamily("engram_tier_hits", "Reads served by the tier.", labels=label),
            "misses": CounterMetricFamily("engram_tier_misses", "Reads a lower tier served instead.", labels=label),
            "evictions": CounterMetricFamily("engram_tier_evictions", "Blocks evicted for room.", labels=label),
            "demoted": CounterMetricFamily("engram_tier_demoted_bytes", "Payload bytes copied down out of the tier.",
                                           labels=label),
            "promoted": CounterMetricFamily("engram_tier_promoted_bytes", "Payload bytes copied up into the tier.",
                                            labels=label),
            "corrupt": CounterMetricFamily("engram_tier_corrupt_blocks", "Copies that failed their checksum.",
                                           labels=label),
            "io_errors": CounterMetricFamily("engram_tier_io_errors", "I/O errors on the tier.", labels=label),
            # the blocks beside the bytes, and a full disk's refusals: only Stats had them (an audit, session 48)
            "demotions": CounterMetricFamily("engram_tier_demotions", "Blocks copied down out of the tier.",
                                             labels=label),
            "promotions": CounterMetricFamily("engram_tier_promotions", "Blocks copied up into the tier.",
                                              labels=label),
            "enospc": CounterMetricFamily("engram_tier_enospc", "Writes the tier failed for a full disk (ENOSPC).",
                                          labels=label),
        }
        e = eviction.stats(store.placement.model)
        yield GaugeMetricFamily("engram_eviction_learned", "1 once eviction ranks by learned hit density too.",
                                value=int(e.learned))
        yield GaugeMetricFamily("engram_eviction_recency_weight",
                                "Chance a victim search picks by recency (by hit density otherwise).",
                                value=e.recency_weight)
        yield GaugeMetricFamily("engram_eviction_hint_weight",
                                "Chance a victim search picks by sessions' expect_back_ms hints (0 until one is sent).",
                                value=e.hint_weight)
        yield CounterMetricFamily("engram_eviction_comebacks", "Comebacks and gones the eviction model counted.",
                                  value=e.comebacks)
        yield GaugeMetricFamily("engram_eviction_ghosts", "Deleted blocks the eviction model remembers.",
                                value=e.ghosts)
        for t in store.tier_stats():
            values = {"capacity": t.capacity_bytes, "used": t.used_bytes, "blocks": t.blocks,
                      "degraded": int(t.state != "ok"), "hits": t.hits, "misses": t.misses, "evictions": t.evictions,
                      "demoted": t.demoted_bytes, "promoted": t.promoted_bytes, "corrupt": t.corrupt_blocks,
                      "io_errors": t.io_errors, "demotions": t.demotions, "promotions": t.promotions,
                      "enospc": t.enospc}
            for name, fam in fams.items():
                fam.add_metric([t.name], values[name])
        yield from fams.values()
        c = store.counters
        yield CounterMetricFamily("engram_lookups", "Lookup calls.", value=c.lookups)
        yield CounterMetricFamily("engram_lookup_hit_tokens", "Tokens found cached by lookups.",
                                  value=c.lookup_hit_tokens)
        yield CounterMetricFamily("engram_lookup_miss_tokens", "Tokens not found by lookups.",
                                  value=c.lookup_miss_tokens)
        for name, doc, value in (
            ("engram_blocks_put", "Blocks newly stored.", c.blocks_put),
            ("engram_blocks_deduplicated", "Blocks put that were already stored.", c.blocks_deduplicated),
            ("engram_blocks_served", "Blocks read out.", c.blocks_served),
            ("engram_bytes_served", "Payload bytes read out.", c.bytes_served),
            ("engram_corrupt_blocks", "Stored copies found corrupt (any tier).", c.corrupt_blocks),
            ("engram_blocks_evicted_on_request", "Blocks removed by Evict.", c.blocks_evicted_on_request),
            ("engram_blocks_not_durable", "Write-through blocks acknowledged without a durable copy.",
             c.blocks_not_durable),
            ("engram_blocks_flushed", "Blocks copied to NVMe by the background flusher.", c.blocks_flushed),
            ("engram_blocks_prefetched", "Blocks copied up before their session was due back.", c.blocks_prefetched),
            ("engram_sessions_closed_idle", "Sessions closed after server.session_idle_s without a call.",
             self.sessions.closed_idle),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        pending = store.write_back_pending()  # write-back's loss window: what a crash now would lose
        yield GaugeMetricFamily("engram_write_back_pending_blocks", "Blocks held only in DRAM/HBM (write-back).",
                                value=pending.blocks)
        yield GaugeMetricFamily("engram_write_back_pending_bytes", "Bytes held only in DRAM/HBM (write-back).",
                                value=pending.bytes)
        yield GaugeMetricFamily("engram_write_back_oldest_seconds", "Age of the oldest block held only in DRAM/HBM.",
                                value=pending.oldest_s)
        yield from codec_error_metrics(store)
        rc = self.sessions.runtime.counters
        yield SummaryMetricFamily("engram_replay_seconds", "SWA window rebuilds and their time.",
                                  count_value=rc.replays, sum_value=rc.seconds)
        yield CounterMetricFamily("engram_replayed_tokens", "Tokens re-run by replays.", value=rc.replayed_tokens)
        yield CounterMetricFamily("engram_windows_dropped_cold", "Rebuilt windows dropped as their blocks left memory.",
                                  value=self.sessions.windows_dropped_cold)
        yield GaugeMetricFamily("engram_sessions", "Open sessions.", value=len(self.sessions))
        yield GaugeMetricFamily("engram_hot_sessions", "Sessions holding a rebuilt window.",
                                value=self.sessions.hot_count())
        yield GaugeMetricFamily("engram_session_tokens", "Tokens live sessions hold (4 bytes each; bounded by "
                                "server.max_live_session_tokens).", value=self.sessions.live_tokens.held)


class ClusterCollector(Collector):
    """The cluster tier's state and counters (what Stats' ClusterStats says), at scrape time: a daemon that never
    reached Redis, or whose Redis refused its password, showed nothing here (an audit, session 48)."""

    def __init__(self, cluster: ClusterIndex) -> None:
        self.cluster = cluster

    def collect(self) -> Iterator[Metric]:
        cl = self.cluster
        yield GaugeMetricFamily("engram_cluster_degraded", "1 while the cluster tier is not in the cluster (Redis "
                                "unreachable or refusing the password, not joined yet, a shared node id; Stats "
                                "says why): the daemon serves its own tiers only.", value=int(cl.state != "ok"))
        c = cl.counters
        for name, doc, value in (
            ("engram_cluster_remote_hits", "Blocks fetched from peers.", c.remote_hits),
            ("engram_cluster_remote_bytes", "Payload bytes fetched from peers.", c.remote_bytes),
            ("engram_cluster_remote_failures", "Fetches from peers that failed.", c.remote_failures),
            ("engram_cluster_published", "Index entries written to Redis.", c.published),
            ("engram_cluster_joins", "Times the daemon joined the cluster (the first, and after each outage).",
             c.reconnects),
            ("engram_cluster_untrusted_records", "Records in Redis ignored: their signature did not verify.",
             c.untrusted_records),
            ("engram_cluster_stale_entries_removed", "Holder entries removed as no longer true.",
             c.stale_entries_removed),
        ):
            yield CounterMetricFamily(name, doc, value=value)


def codec_error_metrics(store: BlockStore) -> Iterator[Metric]:
    """The sampled dequantization error of blocks the daemon encoded (engram/store/quality.py): a gauge per
    (codec, tier, layer kind, part) and stat (rel_mean, rel_max, max_abs_mean, max_abs_max), the layers
    measured, and the blocks stored lossless by the fallback."""
    q = store.quality
    labels = ["codec", "tier", "layer_kind", "part"]
    error = GaugeMetricFamily("engram_codec_error", "Sampled dequantization error of blocks the daemon encoded: "
                              "rel = ||x - dq(x)|| / ||x||, max_abs = max|x - dq(x)| / max|x|, per layer.",
                              labels=[*labels, "stat"])
    samples = CounterMetricFamily("engram_codec_error_samples", "Layers whose dequantization error was measured.",
                                  labels=labels)
    for e in q.codec_errors():
        key = [e.codec, e.tier, e.layer_kind, e.part]
        for stat, value in (("rel_mean", e.rel_mean), ("rel_max", e.rel_max), ("max_abs_mean", e.max_abs_mean),
                            ("max_abs_max", e.max_abs_max)):
            error.add_metric([*key, stat], value)
        samples.add_metric(key, e.samples)
    fallback = CounterMetricFamily("engram_codec_fallback_blocks", "Blocks stored lossless because their codec's "
                                   "measured error on a layer kind passed codec.max_error.",
                                   labels=["codec", "layer_kind"])
    for f in q.codec_fallbacks():
        fallback.add_metric([f.codec, f.layer_kind], f.blocks)
    yield error
    yield samples
    yield fallback


class RpcMetrics(grpc.aio.ServerInterceptor):
    """Counts every RPC and times it, labelled by method and final status code."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter("engram_rpcs", "RPCs handled.", ["method", "code"], registry=registry)
        self.latency = Histogram("engram_rpc_duration_seconds", "RPC time from call to last response.",
                                 ["method", "code"], registry=registry,
                                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                          5, 10))

        self.data_calls = Counter("engram_data_requests", "Data-channel requests (Put/Get payloads beside gRPC).",
                                  ["op", "code"], registry=registry)
        self.data_latency = Histogram("engram_data_request_duration_seconds",
                                      "Data-channel request time, from its frame header to the last byte answered.",
                                      ["op", "code"], registry=registry, buckets=self.latency._upper_bounds[:-1])

    def data_done(self, op: str, code: str, seconds: float) -> None:
        """One data-channel request (engram/server/dataport.py), with the gRPC status name it ended with."""
        self.data_calls.labels(op, code).inc()
        self.data_latency.labels(op, code).observe(seconds)

    def _done(self, method: str, context: Any, t0: float, failed: type[BaseException] | None) -> None:
        """`failed`: the class of what the handler raised. Not the exception: kept in a local of the wrapper's
        frame, which its traceback holds, it made a reference cycle of every failed call (engram/collector.py)."""
        code = context.code()
        went = failed is not None and issubclass(failed, asyncio.CancelledError | GeneratorExit)
        if code is None and (went or context.cancelled()):
            # the client went (a stream it stopped reading is closed with GeneratorExit): not a server failure
            # (UNKNOWN), nor a success (OK)
            code = grpc.StatusCode.CANCELLED
        if code is None:
            code = grpc.StatusCode.UNKNOWN if failed is not None and not issubclass(failed, grpc.aio.AbortError) \
                else grpc.StatusCode.OK
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        self.calls.labels(method, name).inc()
        self.latency.labels(method, name).observe(time.perf_counter() - t0)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        kind = next(k for k in ("unary_unary", "stream_unary", "unary_stream", "stream_stream")
                    if getattr(handler, k) is not None)
        if not inspect.isasyncgenfunction(getattr(handler, kind)):
            # one response returned, or a stream written with context.write (health's Watch, the open services'
            # share in server/openrpcs.py): `async for` over its coroutine failed every Watch UNKNOWN, with a
            # traceback logged, whenever metrics were on
            inner = getattr(handler, kind)

            async def unary(request: Any, context: Any) -> Any:
                t0, failed = time.perf_counter(), None
                try:
                    return await answered(inner(request, context), context)  # a generator too (behind a partial)
                except BaseException as exc:
                    failed = type(exc)
                    raise
                finally:
                    self._done(method, context, t0, failed)

            return handler._replace(**{kind: unary})
        inner_stream = getattr(handler, kind)

        async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
            t0, failed = time.perf_counter(), None
            try:
                async for item in inner_stream(request, context):
                    yield item
            except BaseException as exc:
                failed = type(exc)
                raise
            finally:
                self._done(method, context, t0, failed)

        return handler._replace(**{kind: streaming})


class MetricsEndpoint:
    """The registry, the RPC interceptor and (once started) the HTTP server of one daemon."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.interceptor = RpcMetrics(self.registry)
        self.port = 0
        self._server: Any = None

    def watch(self, store: BlockStore, sessions: SessionManager) -> None:
        """The store's figures, every tenant's (config refuses /metrics without a token when tenants share)."""
        self.registry.register(StoreCollector(store, sessions))

    def watch_cluster(self, cluster: ClusterIndex) -> None:
        """The cluster tier's state and counters (server.cluster set)."""
        self.registry.register(ClusterCollector(cluster))

    def watch_data(self, buffered_bytes: Callable[[], int]) -> None:
        """The data channel's receive buffers (engram/server/dataport.py), read at scrape time."""
        Gauge("engram_data_buffered_bytes", "Bytes the data channel holds in receive buffers: frames being "
              "received and each connection's reused payload buffer.", registry=self.registry
              ).set_function(buffered_bytes)

    def watch_receive_budget(self, budget_held: Callable[[], int]) -> None:
        """What puts' receive buffers hold of server.receive_buffer_bytes (engram/server/recvbudget.py), read at
        scrape time."""
        Gauge("engram_receive_buffer_budget_held_bytes", "Bytes of server.receive_buffer_bytes puts hold: data "
              "connections' requests' metadata and payload buffers, Put streams' blocks being reassembled, taken "
              "before they are read.", registry=self.registry).set_function(budget_held)

    def start(self, host: str, port: int, token: str = "") -> int:
        """Serve /metrics, behind `Authorization: Bearer <token>` when a token is given (401 otherwise); returns
        the bound port (port -1: any free one)."""
        app = make_wsgi_app(self.registry)
        if token:
            app = _bearer(app, token)
        family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]

        class Server(ThreadingWSGIServer):
            address_family = family

        self._server = make_server(host, 0 if port == ANY_FREE_PORT else port, app, Server, handler_class=_Quiet)
        threading.Thread(target=self._server.serve_forever, name="engram-metrics", daemon=True).start()
        self.port = int(self._server.server_port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _bearer(app: Callable[..., Any], token: str) -> Callable[..., Any]:
    """The WSGI app behind a bearer token (compared in constant time)."""
    want = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if hmac.compare_digest(environ.get("HTTP_AUTHORIZATION", "").encode(), want):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer"), ("Content-Type", "text/plain")])
        return [b"/metrics needs server.metrics_token as a bearer token\n"]

    return guarded
