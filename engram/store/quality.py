"""Quality telemetry of the blocks the daemon encodes, and the lossless fallback it drives.

Which blocks: those the daemon stores from raw elements. A raw put of a model whose codec quantizes is
encoded here (the store's `_stored_form`), and measured; a raw put of a raw model is stored as sent, and
measures 0. A block the worker encoded on its GPU (`put(..., encode=True)`, in-place puts through the pool)
reaches the daemon without its raw elements, so its error cannot be measured here and is not: the figures
describe the daemon's own encodes only.

What it costs the put: one counter per block. Every `every`-th block is sampled; its raw elements and its
stored form are kept and compared after the block is stored, in the watch's own worker thread, by a task the
put does not wait for. That thread's torch ops run on it alone (engram/onethread.py), not on torch's OpenMP
team: a team takes every core of a small host while it runs, the event loop's included, and each of its ops
waits for its slowest thread when other processes are busy. A raw model's block, stored as sent, is counted with error 0 at once: its
decode is its raw elements bit for bit, so comparing them (a copy of the block on the event loop, and
float32 passes over twice its bytes in a thread that took both cores of a small host for 100 ms at 16 MiB)
could only say 0. One measurement runs at a time (one core at most, beside the encodes); the
samples waiting for it hold at most `max_pending_bytes` of raw elements (always one), and a sample past
that is skipped (counted), so a burst of puts never queues unbounded work or memory behind itself.

The fallback (`max_error` > 0): once the mean relative error of a codec on a layer kind passes the limit,
later blocks whose layers of that kind the codec would encode are stored lossless instead. Block format v1
carries one codec per block (docs/FORMAT.md), so the whole block is stored as a v1 block of the raw codec
(bit-exact) when any of its layer kinds is over its limit. It lasts until the daemon restarts (no lossy block
of that codec and kind is sampled any more to say otherwise); the daemon logs it once when it starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engram.api import CodecError, CodecFallback
from engram.block import Payload
from engram.codec import stored
from engram.codec.quality import PARTS, ErrorAccumulator, LayerError, kv_errors
from engram.layout import DType, KVLayout, LayerKind
from engram.onethread import executor

log = logging.getLogger("engram.store.quality")


@dataclass
class Fallback:
    """A (codec, layer kind) whose measured error passed `max_error`: its blocks are stored lossless."""

    codec: str
    layer_kind: str
    rel_mean: float  # the mean relative error that started it
    samples: int
    blocks: int = 0  # blocks stored lossless because of it


@dataclass(frozen=True)
class Sample:
    """A sampled block: its raw elements, the codec it was stored in (what its error is counted under) and the
    model's stored codec (what its stored form decodes as: a block kept lossless is a v1 block of the raw codec
    under a quantizing model's codec)."""

    kv: torch.Tensor | None  # None: stored as sent (a raw model's block), its error 0 without measuring
    codec: str
    layer_kinds: tuple[str, ...]
    model_codec: str
    namespace: str = ""  # whose block: the fallback is decided per namespace


def persisted_kinds(layout: KVLayout) -> tuple[str, ...]:
    """The kind of each layer whose KV a block holds, in block order ("global" for every one today)."""
    return tuple(layer.kind.name.lower() for layer in layout.layers if layer.kind == LayerKind.GLOBAL)


class QualityWatch:
    def __init__(self, every: int = 64, max_error: float = 0.0, *, backend: str = "reference",
                 max_pending_bytes: int = 64 * 2**20) -> None:
        self.every = every  # sample every every-th block the daemon encodes; 0: never
        self.max_error = max_error  # relative error limit of the lossless fallback; 0: off
        self.backend = backend
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0  # raw elements held by samples not measured yet
        self._one_at_a_time = asyncio.Lock()
        self.errors = ErrorAccumulator()
        # The fallback, per (namespace, codec, layer kind), decided on that namespace's own samples: one tenant's
        # crafted KV (a codec's worst case) switched every tenant's blocks to raw, 2-3.5x their bytes (an audit).
        self.fallbacks: dict[tuple[str, str, str], Fallback] = {}
        self._rel: dict[tuple[str, str, str], list[float]] = {}  # the same keys: [sum of rel errors, samples]
        self.seen = 0  # blocks the daemon stored from raw elements (the sampling counter)
        self.skipped = 0  # samples dropped because max_pending_bytes were waiting to be measured
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = executor("engram-quality")  # started by the first measurement

    def sample(self, nbytes: int) -> bool:
        """Whether the block about to be stored from its `nbytes` of raw elements is measured (called once per
        such block)."""
        self.seen += 1
        if not self.every or self.seen % self.every:
            return False
        if self._tasks and self.pending_bytes + nbytes > self.max_pending_bytes:
            self.skipped += 1
            return False
        return True

    def lossless(self, namespace: str, codec: str, layer_kinds: Sequence[str]) -> Fallback | None:
        """The fallback that makes the namespace's block of these layer kinds go lossless instead of into `codec`,
        if any."""
        if not self.fallbacks:
            return None
        for kind in layer_kinds:
            fb = self.fallbacks.get((namespace, codec, kind))
            if fb is not None:
                return fb
        return None

    def measure_later(self, sample: Sample, blob: Payload, dtype: DType, shape: tuple[int, ...], tier: str) -> None:
        """Compare `blob` (the block as stored) with the sample's raw elements, off the event loop; the put
        that stored it does not wait (so a view of a buffer the put's caller reuses is copied first). A block
        stored as sent (no raw elements kept) is recorded at once with error 0."""
        if sample.kv is None:
            self._record(sample, tier, [LayerError(kind, part, 0.0, 0.0) for kind in sample.layer_kinds
                                        for part in PARTS])
            return
        nbytes = sample.kv.numel() * sample.kv.element_size()
        self.pending_bytes += nbytes
        blob = bytes(blob)
        task = asyncio.get_running_loop().create_task(self._measure(sample, blob, dtype, shape, tier))
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            self.pending_bytes -= nbytes

        task.add_done_callback(done)

    async def _measure(self, sample: Sample, blob: bytes, dtype: DType, shape: tuple[int, ...], tier: str) -> None:
        try:
            async with self._one_at_a_time:
                errors = await asyncio.get_running_loop().run_in_executor(self._thread, self._errors, sample, blob,
                                                                           dtype, shape)
        except Exception:  # telemetry never fails a put; a decode that fails here fails the Get loudly anyway
            log.exception("measuring a %s block's error failed", sample.codec)
            return
        self._record(sample, tier, errors)

    def _record(self, sample: Sample, tier: str, errors: list[LayerError]) -> None:
        self.errors.add(sample.codec, tier, errors)
        for e in errors:
            acc = self._rel.setdefault((sample.namespace, sample.codec, e.layer_kind), [0.0, 0])
            acc[0] += e.rel
            acc[1] += 1
        self._check_limit(sample.namespace, sample.codec, {e.layer_kind for e in errors})

    def _errors(self, sample: Sample, blob: bytes, dtype: DType, shape: tuple[int, ...]) -> list[LayerError]:
        assert sample.kv is not None
        dq = stored.decode(blob, sample.model_codec, dtype, shape, backend=self.backend, where="sampled block")
        return kv_errors(sample.kv, dq, sample.layer_kinds)

    def _check_limit(self, namespace: str, codec: str, kinds: set[str]) -> None:
        if not self.max_error or stored.is_raw(codec):
            return
        for kind in sorted(kinds):
            key = (namespace, codec, kind)
            if key in self.fallbacks or key not in self._rel:
                continue
            total, n = self._rel[key]
            mean = total / n
            if mean > self.max_error:
                self.fallbacks[key] = Fallback(codec, kind, mean, int(n))
                log.warning("codec fallback: %s on %s layers of namespace %r measured a mean relative error of %.4g "
                            "over %d samples, above codec.max_error = %g; its blocks with %s layers are stored "
                            "lossless (raw) from now on", codec, kind, namespace, mean, n, self.max_error, kind)

    # ---- figures -------------------------------------------------------------------------------------

    def codec_errors(self) -> tuple[CodecError, ...]:
        return tuple(CodecError(codec, tier, kind, part, e.samples, e.rel_mean, e.rel_max, e.max_abs_mean,
                                e.max_abs_max) for (codec, tier, kind, part), e in self.errors.items())

    def codec_fallbacks(self, namespaces: Sequence[str] | None = None) -> tuple[CodecFallback, ...]:
        """One line per (codec, layer kind) falling back in some namespace (of `namespaces`, when given): the
        highest mean error that started one, the samples and blocks of all of them."""
        merged: dict[tuple[str, str], CodecFallback] = {}
        for (ns, codec, kind), f in sorted(self.fallbacks.items()):
            if namespaces is not None and ns not in namespaces:
                continue
            was = merged.get((codec, kind))
            merged[(codec, kind)] = CodecFallback(codec, kind, f.rel_mean, f.samples, self.max_error, f.blocks) \
                if was is None else dataclasses.replace(was, rel_mean=max(was.rel_mean, f.rel_mean),
                                                        samples=was.samples + f.samples, blocks=was.blocks + f.blocks)
        return tuple(merged.values())

    async def drain(self) -> None:
        """Wait for the measurements running now (tests, and close)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._thread.shutdown(wait=False, cancel_futures=True)
