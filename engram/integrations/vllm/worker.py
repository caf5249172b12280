"""The worker side of the vLLM connector: loads into vLLM's paged KV cache before a forward, saves out of it
after.

`register_kv_caches` takes vLLM's per-layer cache tensors once; each step's EngramMetadata (scheduler.py) says
what to load and save. A load is one `load_prefix_into` per request (the client's hit path: one GetPrefix round
trip, blocks copied out of the daemon's mapped pool straight into the request's pages, FP4 decoded on the GPU),
done in start_load_kv before the forward reads the KV: the writes are queued on the current CUDA stream, so
wait_for_layer_load has nothing to wait for. A save gathers the prompt's KV out of its blocks into one buffer
(layer by layer as vLLM's save_kv_layer hooks come, any layer they skipped in wait_for_save), queued on vLLM's
stream within the step: the blocks are never read after vLLM may reuse them. The put of that buffer runs
in a background thread (`async_saves`, the default) on its own client, after the gathers' CUDA event, so the
step does not wait for it; that client gives way to this worker's loads (engram/loadgate.py: a put waits, up
to 0.1 s a time, while a load is in flight). The buffers of puts queued or running (on the cache's device, outside vLLM's memory
profile) are bounded by `max_pending_bytes`: a save waits for the oldest until its own fits, or none is left
(a prompt larger than the bound goes alone). With async_saves off the step puts it.

What a failure does: a load that finds fewer tokens than the scheduler planned (evicted in between, daemon
down) reports the blocks it did not fill (`take_load_errors`, vLLM's get_block_ids_with_load_errors) so vLLM
recomputes them (kv_load_failure_policy="recompute") or fails the request ("fail"), never reads them as they
are. A failed save is logged and counted: the next request with that prefix misses. A daemon that restarted
without a model registry has the model registered again by the first load or save it refuses for not knowing it
(the client does so: engram/reregister.py), as for the scheduler's lookups.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

from engram.errors import EngramError, InvalidArgument
from engram.integrations.registration import Registration
from engram.integrations.vllm.config import LATENT, VllmLayers
from engram.integrations.vllm.paged import as_destination, gather, kv_pages, latent_pages, page_table
from engram.integrations.vllm.scheduler import EngramMetadata, LoadSpec, SaveSpec
from engram.loadgate import LoadGate

log = logging.getLogger("engram.integrations.vllm")


class EngramWorker:
    """Worker-side state: one instance per vLLM worker process."""

    def __init__(self, model: Registration, layers: VllmLayers, *, namespace: str | None = None,
                 save_client: Any = None, max_pending_bytes: int = 2 << 30) -> None:
        """model: the model, registered through the SyncEngramClient loads run on (registered again, through the
        client whose call the daemon refused, if the daemon forgets it). save_client: a second client the puts
        run on, in a background thread (its own event loop, so a put in flight never holds up the next step's
        loads); None: puts run within the step on the model's client."""
        self.model = model
        self.client = model.client
        self.save_client = save_client
        self.max_pending_bytes = max_pending_bytes
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="engram-save") if save_client is not None else None
        # Background puts give way to this worker's loads (engram/loadgate.py): a load is on a request's
        # critical path, a save is not.
        self.gate = LoadGate()
        if save_client is not None:
            save_client.give_way_to(self.gate)
        self._pending: deque[tuple[Future[None], int]] = deque()  # puts queued or running and their buffers' bytes
        self._pending_bytes = 0
        self.layers = layers
        self.namespace = namespace
        self._index = {name: i for i, name in enumerate(layers.names)}
        # Per stream, per layer pages: [K, V] for full attention, [latent] for MLA (its stream in the model spec).
        self.pages: list[list[Tensor]] = []
        self.streams = layers.streams
        self.pages_per_block = 0
        # request -> (L, 2, T, H, D) buffer ((L, T, width) for MLA), layers gathered
        self._saving: dict[str, tuple[Tensor, set[int]]] = {}
        self._load_errors: set[int] = set()
        self._short: set[str] = set()  # requests whose load this step came up short: not saved this step
        self.loaded_tokens = 0  # written into vLLM's blocks since start (the tests and logs read these)
        self.saved_tokens = 0
        self.save_failures = 0

    @property
    def fingerprint(self) -> bytes:
        return self.model.fingerprint

    def register_kv_caches(self, kv_caches: Mapping[str, Tensor]) -> None:
        lay = self.layers
        missing = [name for name in lay.names if name not in kv_caches]
        if missing:
            raise InvalidArgument(f"vLLM registered no KV cache for layers {missing[:4]} of its KV cache config")
        if lay.mla:
            self.pages = [[latent_pages(kv_caches[name], lay.head_dim) for name in lay.names]]
        else:
            kv = [kv_pages(kv_caches[name], lay.num_kv_heads, lay.head_dim) for name in lay.names]
            self.pages = [[k for k, _ in kv], [v for _, v in kv]]
        page_tokens = int(self.pages[0][0].shape[1])
        if lay.block_size % page_tokens:
            raise InvalidArgument(f"vLLM's cache pages hold {page_tokens} tokens, which does not divide its block "
                                  f"size {lay.block_size}")
        self.pages_per_block = lay.block_size // page_tokens

    # ---- before the forward -----------------------------------------------------------------------

    def start_load(self, meta: EngramMetadata) -> None:
        self._short.clear()
        if not meta.loads:
            return
        with self.gate.loading():  # background puts wait (a while) until the loads' copies are done
            for spec in meta.loads:
                self._load(spec)
            self._sync()  # the client queued its writes on its own thread's stream; vLLM's may be another

    def _sync(self) -> None:
        """Wait for the device's queued work: the client's threads and vLLM's use their own CUDA streams."""
        device = self.pages[0][0].device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _load(self, spec: LoadSpec) -> None:
        bs = self.layers.block_size
        table = page_table(spec.block_ids, self.pages_per_block)
        dest = as_destination(self.pages, table, spec.first_token, self.streams)
        want = len(spec.token_ids)
        try:
            res = self.model.call(
                lambda fp: self.client.load_prefix_into(fp, spec.token_ids, dest, namespace=self.namespace))
            got = res.loaded_tokens
        except EngramError as exc:
            log.warning("Engram load for request %r failed: %s", spec.req_id, exc)
            got = 0
        if got < want:  # the blocks not (wholly) written: vLLM must not read them as computed
            first_bad = max(got, spec.first_token) // bs
            self._load_errors.update(spec.block_ids[first_bad:])
            # This step's forward ran over those blocks as they were (another request's KV): vLLM recomputes
            # the request, but a save planned for this step would store them as the prompt's.
            self._short.add(spec.req_id)
            log.warning("Engram held %d of the %d tokens planned for request %r; %d blocks reported to vLLM",
                        got, want, spec.req_id, len(spec.block_ids) - first_bad)
        self.loaded_tokens += max(0, min(got, want) - spec.first_token)

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM's get_block_ids_with_load_errors)."""
        out, self._load_errors = self._load_errors, set()
        return out

    # ---- after the forward ------------------------------------------------------------------------

    def save_layer(self, layer_name: str, meta: EngramMetadata) -> None:
        """vLLM computed this layer's KV for the step: gather it for the prompts being saved."""
        i = self._index.get(layer_name)
        if i is None:  # a layer outside the KV cache config (a draft model's): not Engram's
            return
        for spec in meta.saves:
            if spec.req_id in self._short:
                continue
            buf, done = self._buffer(spec)
            if i not in done:
                self._gather(i, spec, buf)
                done.add(i)

    def wait_for_save(self, meta: EngramMetadata) -> None:
        """Gather what save_layer did not (every layer has run by now), then put each prompt's KV."""
        for spec in meta.saves:
            if spec.req_id in self._short:
                log.warning("Engram save of request %r skipped: its load this step came up short", spec.req_id)
                continue
            buf, done = self._buffer(spec)
            for i in range(len(self.layers.names)):
                if i not in done:
                    self._gather(i, spec, buf)
            del self._saving[spec.req_id]
            if self._saver is None:
                self._sync()  # the gathers ran on vLLM's stream; the put reads buf from the client's threads
                self._put(self.client, spec, buf, None)
                continue
            gathered = None
            if buf.device.type == "cuda":
                gathered = torch.cuda.Event()
                gathered.record(torch.cuda.current_stream(buf.device))
            nbytes = buf.numel() * buf.element_size()
            while self._pending and (self._pending[0][0].done()  # each holds a buffer on the device: bounded
                                     or self._pending_bytes + nbytes > self.max_pending_bytes):
                self._wait_oldest()
            self._pending.append((self._saver.submit(self._put_in_background, spec, buf, gathered), nbytes))
            self._pending_bytes += nbytes

    def _wait_oldest(self) -> None:
        future, nbytes = self._pending.popleft()
        future.result()  # never raises: _put_in_background logs what failed
        self._pending_bytes -= nbytes

    def _put_in_background(self, spec: SaveSpec, buf: Tensor, gathered: torch.cuda.Event | None) -> None:
        try:
            self._put(self.save_client, spec, buf, gathered)
        except Exception:  # raised in a later step it would fail vLLM's step for an earlier request's save
            self.save_failures += 1
            log.exception("Engram save of request %r (%d tokens) failed", spec.req_id, len(spec.token_ids))

    def _put(self, client: Any, spec: SaveSpec, buf: Tensor, gathered: torch.cuda.Event | None) -> None:
        if gathered is not None:
            gathered.synchronize()  # the gathers vLLM's stream queued have run
        tokens = np.asarray(spec.token_ids, dtype=np.int32)
        kv = {LATENT: buf} if self.layers.mla else buf
        try:
            self.model.call(lambda fp: client.put(fp, tokens, kv, namespace=self.namespace), client)
            self.saved_tokens += len(spec.token_ids)
        except EngramError as exc:
            self.save_failures += 1
            log.warning("Engram save of request %r (%d tokens) failed: %s", spec.req_id, len(spec.token_ids), exc)

    def flush(self) -> None:
        """Wait until every save handed to the background thread is stored (or has failed)."""
        while self._pending:
            self._wait_oldest()

    def close(self) -> None:
        """Finish the saves in flight, then stop the background thread and close the save client."""
        self.flush()
        if self._saver is not None:
            self._saver.shutdown()
            self.save_client.close()
            self._saver = None

    def _buffer(self, spec: SaveSpec) -> tuple[Tensor, set[int]]:
        got = self._saving.get(spec.req_id)
        if got is None:
            lay = self.layers
            n = len(spec.token_ids)
            shape = (len(lay.names), n, lay.head_dim) if lay.mla else \
                (len(lay.names), 2, n, lay.num_kv_heads, lay.head_dim)
            device = self.pages[0][0].device
            got = self._saving[spec.req_id] = (torch.empty(shape, dtype=lay.dtype, device=device), set())
        return got

    def _gather(self, layer: int, spec: SaveSpec, buf: Tensor) -> None:
        table = page_table(spec.block_ids, self.pages_per_block)
        n = len(spec.token_ids)
        if self.layers.mla:
            gather(self.pages[0][layer], table, n, buf[layer])
            return
        gather(self.pages[0][layer], table, n, buf[layer, 0])
        gather(self.pages[1][layer], table, n, buf[layer, 1])
