"""The vLLM KV connector (engram.integrations.vllm) against a real Engram daemon (an `engram serve` subprocess:
vLLM's connector hooks are synchronous, so the daemon runs outside the test's thread).

Without vLLM, `MiniVllm` drives the connector's scheduler and worker sides in vLLM's order with vLLM-shaped
arguments (a request with request_id and prompt_token_ids, KVCacheBlocks-like get_block_ids(), SchedulerOutput-
like scheduled requests) over per-layer paged caches in vLLM's standardized layout, shuffled block ids, and a
"forward" that writes each token's KV into its block and calls save_kv_layer per layer; `MiniMlaVllm` does the
same for an MLA model (one 576-wide latent a token and layer, stored as Engram's latent stream). The tests at the end
need vLLM (the scratch venv of scripts/vllm_venv.sh) and skip without it: they build the real EngramConnector
from a real VllmConfig and KVCacheConfig, drive it with vLLM's own Request, KVCacheBlocks and SchedulerOutput,
and load into the cache views vLLM's own allocator makes. No test runs a vLLM server or a model.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pickle
import random
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engram.client import SyncEngramClient
from engram.errors import InvalidArgument
from engram.integrations.registration import Registration
from engram.integrations.vllm import (
    ConnectorConfig,
    EngramScheduler,
    EngramWorker,
    LayerCache,
    VllmLayers,
    kv_pages,
    latent_pages,
)

from helpers import RestartingDaemon, engram_daemon

BS = 16  # vLLM's block size
BT = 32  # Engram's block_tokens: two vLLM blocks
LAYERS, HEADS, DIM = 2, 2, 16
NUM_BLOCKS = 24
NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with engram_daemon(tmp_path_factory.mktemp("vllm")) as (address, _):
        yield address


def reference_kv(tokens: list[int]) -> torch.Tensor:
    """The model's KV for a prompt, (L, 2, T, H, D) bf16: each token's a function of the tokens up to it, as a
    causal model's is, so prompts sharing a prefix share its KV."""
    out = torch.empty(LAYERS, 2, len(tokens), HEADS, DIM, dtype=torch.bfloat16)
    h = 0
    for t, tok in enumerate(tokens):
        h = (h * 1_000_003 + int(tok) + 1) % (2**61 - 1)
        out[:, :, t] = torch.randn(LAYERS, 2, HEADS, DIM, generator=torch.Generator().manual_seed(h))
    return out


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 32_000, n)]


# ---- vLLM-shaped arguments, and a miniature vLLM that drives the connector ------------------------------------


@dataclass
class Request:  # vllm.v1.request.Request: what the connector reads
    request_id: str
    prompt_token_ids: list[int]
    mm_features: list[Any] = field(default_factory=list)
    lora_request: Any = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # from the OpenAI request's body, as vLLM passes it on


@dataclass
class Blocks:  # vllm.v1.core.kv_cache_manager.KVCacheBlocks
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class NewRequestData:  # vllm.v1.core.sched.output.NewRequestData
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    mm_features: list[Any] = field(default_factory=list)
    lora_request: Any = None


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)  # their new_block_ids are all their blocks


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    finished_req_ids: set[str] = field(default_factory=set)


def layers(block_size: int = BS) -> VllmLayers:
    return VllmLayers.from_caches([LayerCache(n, "full", HEADS, DIM, DIM, torch.bfloat16, block_size) for n in NAMES])


def both_stacks(daemon: str, model: torch.nn.Module, path: str, engine_layers: VllmLayers) -> tuple[bytes, bytes]:
    """The fingerprints the vLLM connector (an engine serving `path` with the model's HF config) and the
    transformers integration give one model, both with the weights id "rev-1"."""
    from types import SimpleNamespace

    from engram.integrations.transformers import EngramPrefixCache

    with SyncEngramClient(daemon) as client:
        hf = EngramPrefixCache(model.to(torch.bfloat16), client, codec="raw", block_tokens=BT, weights_id="rev-1").spec
    engine = SimpleNamespace(model=path, revision=None, quantization=None, hf_config=model.config)
    ours = ConnectorConfig(address="unix:/x", codec="raw", block_tokens=BT, weights_id="rev-1").engine_model_spec(
        engine_layers, engine)
    return ours.fingerprint, hf.fingerprint


def config(address: str, namespace: str, **kw: Any) -> ConnectorConfig:
    return ConnectorConfig.from_extra({"address": address, "namespace": namespace, "codec": "raw",
                                       "block_tokens": BT, **kw})


class MiniVllm:
    """One engine: the connector's scheduler and worker sides (in one process here), per-layer caches in vLLM's
    standardized (num_blocks, H, block_size, 2 * D) layout filled with NaN (vLLM does not zero blocks), and block
    ids handed out in shuffled order, as a pool that has served other requests does."""

    def __init__(self, address: str, namespace: str, *, seed: int = 0, device: str = "cpu", **extra: Any) -> None:
        cfg = config(address, namespace, **extra)
        self.layers = layers()
        self.spec = cfg.model_spec(self.layers, name="tiny-llama", weights_id="seed-0")
        self.client = cfg.client()
        model = Registration(self.client, self.spec)  # as the connector makes them
        fp = model.register()
        self.scheduler = EngramScheduler(model, BS, namespace=namespace)
        self.worker = EngramWorker(model, self.layers, namespace=namespace, save_client=cfg.save_client(self.spec),
                                   max_pending_bytes=cfg.max_pending_bytes)
        self.caches = {n: torch.full((NUM_BLOCKS, HEADS, BS, 2 * DIM), float("nan"), dtype=torch.bfloat16,
                                     device=device) for n in NAMES}
        self.worker.register_kv_caches(self.caches)
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.fingerprint = fp

    def close(self) -> None:
        self.worker.close()
        self.client.close()

    def token_kv(self, block_ids: list[int], n: int) -> torch.Tensor:
        """What the cache holds for a request's first n tokens, (L, 2, n, H, D), read by plain indexing: row r of
        block b holds K in channels [0, D) and V in [D, 2D) (FlashAttention's kv_cache.transpose(1, 2).split)."""
        out = torch.empty(LAYERS, 2, n, HEADS, DIM, dtype=torch.bfloat16)
        for layer, name in enumerate(NAMES):
            for t in range(n):
                row = self.caches[name][block_ids[t // BS], :, t % BS].cpu()  # (H, 2D)
                out[layer, 0, t], out[layer, 1, t] = row[:, :DIM], row[:, DIM:]
        return out

    def forward(self, block_ids: list[int], tokens: list[int], start: int, meta: Any) -> None:
        """Attention writing each new token's KV into its block, layer by layer, with vLLM's save hook after."""
        kv = reference_kv(tokens)
        for layer, name in enumerate(NAMES):
            for t in range(start, len(tokens)):
                row = self.caches[name][block_ids[t // BS], :, t % BS]
                row[:, :DIM], row[:, DIM:] = kv[layer, 0, t], kv[layer, 1, t]
            self.worker.save_layer(name, meta)

    def run(self, req_id: str, tokens: list[int], *, local_hit: int = 0, request: Request | None = None,
            flush: bool = True) -> tuple[int, list[int], Any]:
        """Admit a request whose first local_hit tokens vLLM's own prefix cache holds (those blocks written
        here, as an earlier request left them) and run its whole prompt in one step. Returns the tokens the
        connector reported, the request's block ids, and the step's metadata."""
        req = request or Request(req_id, tokens)
        ext, load_async = self.scheduler.num_new_matched_tokens(req, local_hit)
        assert load_async is False
        ids = [self.free.pop() for _ in range(-(-len(tokens) // BS))]
        if local_hit:
            self.forward(ids, tokens[:local_hit], 0, _NO_SAVES)
        self.scheduler.update_state_after_alloc(req, Blocks(ids), ext)
        computed = local_hit + ext
        out = SchedulerOutput([NewRequestData(req_id, tokens, (ids,), computed, req.mm_features, req.lora_request)],
                              CachedRequestData(), {req_id: len(tokens) - computed})
        meta = self.scheduler.build_meta(out)
        self.worker.start_load(meta)
        self.loaded_now = self.token_kv(ids, computed) if computed else None  # before the forward writes
        self.forward(ids, tokens, computed, meta)
        self.worker.wait_for_save(meta)
        if flush:  # decoding the answer outlasts the put in the background (the async-save tests do not wait)
            self.worker.flush()
        self.scheduler.request_finished(req, ids)
        return ext, ids, meta


@dataclass
class _NoSaves:
    loads: list[Any] = field(default_factory=list)
    saves: list[Any] = field(default_factory=list)


_NO_SAVES = _NoSaves()


def namespace_of(request: pytest.FixtureRequest) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)


def _engines(cls: type[MiniVllm], daemon: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Engines on one daemon and one namespace per test: the first stores, a later one (another worker
    process in production: its own client and caches) loads."""
    made: list[MiniVllm] = []

    def make(**kw: Any) -> MiniVllm:
        made.append(cls(daemon, namespace_of(request), seed=len(made), **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.fixture
def engines(daemon: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    yield from _engines(MiniVllm, daemon, request)


# ---- hits, misses, partial hits -------------------------------------------------------------------------------


def test_a_saved_prompt_is_reported_cached_and_loads_bit_exact_into_scattered_blocks(engines: Any) -> None:
    first = engines()
    shared = prompt(5 * BS + 3)
    ext, _, meta = first.run("a", shared)
    assert ext == 0 and [s.req_id for s in meta.saves] == ["a"]
    assert first.worker.saved_tokens == len(shared)

    second = engines()  # fresh caches, other block ids
    longer = shared + prompt(20, seed=9)
    ext, ids, meta = second.run("b", longer)
    # Engram holds all 83 tokens of the shared prefix; vLLM gets its whole blocks: 5 of 16.
    assert ext == 5 * BS
    assert [(s.req_id, s.first_token, len(s.token_ids)) for s in meta.loads] == [("b", 0, 5 * BS)]
    assert sorted(ids) != ids  # the blocks are scattered
    assert torch.equal(second.loaded_now, reference_kv(longer)[:, :, : 5 * BS])
    assert second.worker.loaded_tokens == 5 * BS
    # Blocks no request was given were never written.
    untouched = sorted(set(range(NUM_BLOCKS)) - set(ids))
    assert torch.isnan(second.caches[NAMES[0]][untouched]).all()


def test_the_schedulers_lookups_count_no_use_and_the_load_counts_one_per_block(engines: Any) -> None:
    # vLLM asks every step a request waits; the daemon's eviction order learns from comebacks, so only the
    # load (GetPrefix) may count one, and the save's own question (what need not be sent) none.
    first = engines()
    shared = prompt(5 * BS + 3)
    first.run("a", shared)
    second = engines()
    longer = shared + prompt(20, seed=9)

    def comebacks() -> int:
        return int(second.client.stats().eviction.comebacks)

    before = comebacks()
    for _ in range(3):
        assert second.scheduler.num_new_matched_tokens(Request("b", longer), 0) == (5 * BS, False)
    assert comebacks() == before
    ext, _, meta = second.run("b", longer)
    assert ext == 5 * BS
    loaded = second.client.lookup(second.scheduler.fingerprint, meta.loads[0].token_ids, probe=True)
    assert len(loaded.blocks) >= 2 and comebacks() == before + len(loaded.blocks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200)")
def test_cuda_caches_save_and_load_bit_exact(engines: Any) -> None:
    """vLLM's caches on the GPU, as in a real engine: the saves gather from device pages, the loads DMA into
    them (the client's own CUDA streams; the worker synchronizes before the forward reads them)."""
    shared = prompt(5 * BS + 3, seed=11)
    first = engines(device="cuda")
    first.run("a", shared)
    assert first.worker.saved_tokens == len(shared)
    second = engines(device="cuda")
    longer = shared + prompt(20, seed=12)
    ext, ids, _ = second.run("b", longer)
    assert ext == 5 * BS and second.caches[NAMES[0]].is_cuda
    assert torch.equal(second.loaded_now, reference_kv(longer)[:, :, : 5 * BS])
    untouched = sorted(set(range(NUM_BLOCKS)) - set(ids))
    assert torch.isnan(second.caches[NAMES[0]][untouched]).all()


def test_a_fully_cached_prompt_leaves_its_last_token_to_compute(engines: Any) -> None:
    whole = prompt(4 * BS, seed=3)
    engines().run("a", whole)
    ext, _, meta = engines().run("b", whole)
    assert ext == 3 * BS  # not 4 * BS: vLLM computes at least the last token, whose block is then its own
    assert meta.saves == []  # Engram held every token already: nothing to store again


def test_a_miss_reports_zero_and_loads_nothing(engines: Any) -> None:
    engines().run("a", prompt(3 * BS, seed=1))
    e = engines()
    ext, ids, meta = e.run("b", prompt(3 * BS, seed=2))
    assert ext == 0 and meta.loads == [] and e.worker.loaded_tokens == 0


def test_a_partially_cached_prompt_reports_its_whole_block_part(engines: Any) -> None:
    stored = prompt(3 * BS, seed=4)
    engines().run("a", stored)
    diverged = stored[: BS + 9] + prompt(2 * BS, seed=5)  # leaves the cached chain 9 tokens into block 1
    e = engines()
    ext, _, meta = e.run("b", diverged)
    assert ext == BS  # 25 tokens match; one whole vLLM block of them
    assert torch.equal(e.loaded_now, reference_kv(stored)[:, :, :BS])


def test_tokens_vllm_holds_itself_are_not_loaded_over(engines: Any) -> None:
    """vLLM's own prefix cache hit the first block: Engram reports and writes only the blocks after it, and the
    block vLLM holds (shared with other requests) is left as it is."""
    stored = prompt(4 * BS, seed=6)
    engines().run("a", stored)
    e = engines()
    ext, ids, meta = e.run("b", [*stored, 7], local_hit=BS)
    assert ext == 3 * BS and [(s.first_token, len(s.token_ids)) for s in meta.loads] == [(BS, 4 * BS)]
    # Mark vLLM's block, then load again: a load that wrote it would overwrite the mark.
    e.caches[NAMES[0]][ids[0]].fill_(7.0)
    e.worker.start_load(meta)
    assert (e.caches[NAMES[0]][ids[0]] == 7.0).all()
    assert torch.equal(e.token_kv(ids, 4 * BS)[:, :, BS:], reference_kv(stored)[:, :, BS : 4 * BS])


def test_nvfp4_loads_are_the_daemons_decoded_blocks_within_the_codecs_error(engines: Any) -> None:
    shared = prompt(4 * BS + 5, seed=7)
    first = engines(codec="nvfp4")
    first.run("a", shared)
    e = engines(codec="nvfp4")
    ext, _, _ = e.run("b", shared + prompt(4, seed=8))
    assert ext == 4 * BS
    n, decoded = e.client.get_prefix(e.fingerprint, shared)  # the bytes path: what the daemon stored, decoded
    assert n == len(shared)
    assert torch.equal(e.loaded_now, decoded[:, :, :ext])
    want = reference_kv(shared)[:, :, :ext].float()
    rel = float((e.loaded_now.float() - want).norm() / want.norm())
    assert 0.0 < rel < 0.12  # docs/FP4_NOTES.md: relative RMS 0.095 on Gaussian data; 0 would mean it stored raw


# ---- what the scheduler plans ------------------------------------------------------------------------------


def test_a_chunked_prefill_is_saved_once_in_the_step_that_completes_the_prompt(engines: Any) -> None:
    e = engines()
    tokens = prompt(3 * BS + 4, seed=10)
    req = Request("c", tokens)
    assert e.scheduler.num_new_matched_tokens(req, 0) == (0, False)
    ids = [e.free.pop() for _ in range(2)]
    e.scheduler.update_state_after_alloc(req, Blocks(ids), 0)
    step1 = e.scheduler.build_meta(SchedulerOutput([NewRequestData("c", tokens, (ids,), 0)], CachedRequestData(),
                                                   {"c": 2 * BS}))
    assert step1.saves == []
    more = [e.free.pop() for _ in range(2)]
    step2 = e.scheduler.build_meta(SchedulerOutput([], CachedRequestData(["c"], [(more,)], [2 * BS]),
                                                   {"c": BS + 4}))
    assert [(s.req_id, s.token_ids, s.block_ids) for s in step2.saves] == [("c", tokens, ids + more)]
    step3 = e.scheduler.build_meta(SchedulerOutput([], CachedRequestData(["c"], [None], [3 * BS + 4]), {"c": 1}))
    assert step3.saves == []  # decoding: the prompt was saved once


def test_a_request_preempted_mid_prefill_is_saved_from_the_blocks_it_resumed_with(engines: Any) -> None:
    """Preempted after the first chunk of its prefill, a request's blocks are freed and reused by another request;
    vLLM resumes it with all-new blocks, sent whole (resumed_req_ids). Its save reads those, not the freed ones:
    what a later engine loads is the prompt's KV."""
    e = engines()
    tokens = prompt(3 * BS + 4, seed=10)
    req = Request("c", tokens)
    assert e.scheduler.num_new_matched_tokens(req, 0) == (0, False)
    old = [e.free.pop() for _ in range(2)]
    e.scheduler.update_state_after_alloc(req, Blocks(old), 0)
    first = e.scheduler.build_meta(SchedulerOutput([NewRequestData("c", tokens, (old,), 0)], CachedRequestData(),
                                                   {"c": 2 * BS}))
    e.forward(old, tokens[:2 * BS], 0, first)
    other = prompt(2 * BS, seed=99)  # preempted: another request gets its blocks and writes its own KV there
    e.forward(old, other, 0, _NO_SAVES)
    assert e.scheduler.num_new_matched_tokens(req, 0) == (0, False)
    new = [e.free.pop() for _ in range(4)]
    e.scheduler.update_state_after_alloc(req, Blocks(new), 0)
    resumed = e.scheduler.build_meta(SchedulerOutput([], CachedRequestData(["c"], [(new,)], [0], {"c"}),
                                                     {"c": len(tokens)}))
    assert [(s.req_id, s.block_ids) for s in resumed.saves] == [("c", new)]
    e.forward(new, tokens, 0, resumed)
    e.worker.wait_for_save(resumed)
    e.worker.flush()
    later = engines()
    ext, _, _ = later.run("d", [*tokens, 7])
    assert ext == 3 * BS and torch.equal(later.loaded_now, reference_kv(tokens)[:, :, :ext])


def test_requests_keyed_by_more_than_their_tokens_are_neither_looked_up_nor_saved(engines: Any) -> None:
    tokens = prompt(3 * BS, seed=11)
    engines().run("a", tokens)
    e = engines()
    for i, req in enumerate([Request("m", tokens, mm_features=["image"]), Request("l", tokens, lora_request="adapter"),
                             Request("s", tokens, cache_salt="user-7")]):
        ext, _, meta = e.run(f"r{i}", tokens, request=req)
        assert ext == 0 and meta.loads == [] and meta.saves == []


def test_a_load_that_finds_less_than_planned_reports_the_blocks_it_did_not_fill_and_is_not_saved(
        engines: Any) -> None:
    tokens = prompt(4 * BS, seed=12)
    engines().run("a", tokens)
    e = engines()
    req = Request("b", [*tokens, 1])
    ext, _ = e.scheduler.num_new_matched_tokens(req, 0)
    assert ext == 4 * BS
    ids = [e.free.pop() for _ in range(5)]
    e.scheduler.update_state_after_alloc(req, Blocks(ids), ext)
    meta = e.scheduler.build_meta(SchedulerOutput([NewRequestData("b", req.prompt_token_ids, (ids,), ext)],
                                                  CachedRequestData(), {"b": 1}))
    keys = [b.key.hex() for b in e.client.lookup(e.fingerprint, tokens).blocks]
    e.client.evict(key_prefixes=keys[1:], force=True)  # evicted between the scheduler's lookup and the load
    e.forward(ids, prompt(5 * BS, seed=77), 0, _NO_SAVES)  # what the blocks held: an earlier request's KV
    e.worker.start_load(meta)
    assert e.worker.take_load_errors() == set(ids[2:4])  # Engram block 0 (vLLM blocks 0, 1) still loaded
    assert e.worker.take_load_errors() == set()
    e.forward(ids, req.prompt_token_ids, ext, meta)  # this step's forward, over blocks 2, 3 as they were
    e.worker.wait_for_save(meta)
    e.worker.flush()
    assert e.worker.saved_tokens == 0  # not this step's save: it would store that KV as the prompt's
    later = engines()
    got, _, _ = later.run("c", [*tokens, 2])
    assert got == 2 * BS and torch.equal(later.loaded_now, reference_kv(tokens)[:, :, :2 * BS])  # Engram block 0 only


def test_a_daemon_that_is_down_gives_misses_not_errors(tmp_path: Path) -> None:
    client = SyncEngramClient(f"unix:{tmp_path}/none.sock")
    try:
        spec = config(f"unix:{tmp_path}/none.sock", "default").model_spec(layers(), name="m", weights_id="w")
        sched = EngramScheduler(Registration(client, spec, b"\0" * 16), BS)
        assert sched.num_new_matched_tokens(Request("a", prompt(40)), 0) == (0, False)
        assert sched.lookup_failures == 1
    finally:
        client.close()


def test_a_stopped_daemon_costs_a_step_the_timeout_a_miss_a_reported_load_and_a_counted_save_failure(
        tmp_path: Path) -> None:
    """The daemon stops (SIGSTOP: hung, or its host frozen) under a running engine with timeout_s = 1 in
    kv_connector_extra_config. The scheduler's lookup, the worker's load and a background save each give up
    within it: a miss, the planned hit's blocks reported to vLLM, a counted save failure; none raises. Each
    held vLLM's scheduler loop or step for as long as the daemon stalled (an audit: still blocked after 21 s).
    Once the daemon continues the engine hits again."""
    with engram_daemon(tmp_path) as (address, proc):
        e = MiniVllm(address, "stopped", timeout_s="1")  # as a command line's JSON may give it
        try:
            tokens, other = prompt(4 * BS + 5, seed=30), prompt(3 * BS + 1, seed=31)
            e.run("a", tokens)
            ext, ids, hit = plan(e, Request("b", tokens))  # planned before the daemon stops: a hit, and a save
            _, other_ids, save = plan(e, Request("c", other))
            assert ext == 4 * BS

            def step() -> None:
                assert e.scheduler.num_new_matched_tokens(Request("d", tokens), 0) == (0, False)
                e.worker.start_load(hit)
                e.forward(other_ids, other, 0, save)
                e.worker.wait_for_save(save)
                e.worker.flush()

            done = threading.Thread(target=step, daemon=True)
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                done.start()
                done.join(3 * 1.0 + 4.0)  # three calls given up, a loaded machine's slack
                assert not done.is_alive(), f"the step was still blocked {time.monotonic() - t0:.1f} s on"
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert e.scheduler.lookup_failures == 1
            assert e.worker.take_load_errors() == set(ids[:4])
            assert (e.worker.save_failures, e.worker.saved_tokens) == (1, len(tokens))  # the first run's only
            ext, _, _ = e.run("e", tokens)
            assert ext == 4 * BS and torch.equal(e.loaded_now, reference_kv(tokens)[:, :, :ext])
        finally:
            e.close()


# ---- a daemon restarted under the engine (DRAM only: it comes back knowing no model) ---------------------------
# The connector registered its model once, at vLLM's start: after such a restart every lookup, load, save and
# session open failed "unknown model fingerprint" for as long as the engine ran (an audit). Each now registers the
# model again (engram/integrations/registration.py) and is made once more.


@pytest.fixture
def restarting(tmp_path: Path) -> Iterator[tuple[RestartingDaemon, MiniVllm]]:
    with RestartingDaemon(tmp_path) as daemon:
        e = MiniVllm(daemon.address, "restart")
        try:
            yield daemon, e
        finally:
            e.close()


def plan(e: MiniVllm, req: Request) -> tuple[int, list[int], Any]:
    """The scheduler's side of a step that runs a request's whole prompt: its Engram hit, its blocks, the metadata."""
    tokens = req.prompt_token_ids
    ext, _ = e.scheduler.num_new_matched_tokens(req, 0)
    ids = [e.free.pop() for _ in range(-(-len(tokens) // BS))]
    e.scheduler.update_state_after_alloc(req, Blocks(ids), ext)
    out = SchedulerOutput([NewRequestData(req.request_id, tokens, (ids,), ext)], CachedRequestData(),
                          {req.request_id: len(tokens) - ext})
    return ext, ids, e.scheduler.build_meta(out)


def test_after_a_daemon_restart_a_lookup_registers_the_model_again_and_the_prompt_is_saved_then_hit(
        restarting: tuple[RestartingDaemon, MiniVllm]) -> None:
    """The engine had hits; after the restart the scheduler's lookup registers the model again (a miss: the daemon
    is empty), the prompt is saved, and the next request loads it."""
    daemon, e = restarting
    tokens = prompt(4 * BS + 5)
    e.run("a", tokens)
    assert e.run("b", tokens)[0] == 4 * BS
    daemon.restart(e.client, e.worker.save_client)
    assert e.run("c", tokens)[0] == 0
    assert (e.scheduler.lookup_failures, e.worker.save_failures) == (0, 0)
    ext, _, _ = e.run("d", tokens)
    assert ext == 4 * BS and torch.equal(e.loaded_now, reference_kv(tokens)[:, :, :ext])


def test_a_save_planned_before_a_daemon_restart_registers_the_model_again_through_the_save_client(
        restarting: tuple[RestartingDaemon, MiniVllm]) -> None:
    """The step runs after the restart with nothing said to the daemon since: the background put finds the model
    unknown, registers it on its own client and stores the prompt, which the next request loads."""
    daemon, e = restarting
    tokens = prompt(3 * BS + 2, seed=1)
    _, ids, meta = plan(e, Request("a", tokens))
    daemon.restart(e.client, e.worker.save_client)
    e.worker.start_load(meta)
    e.forward(ids, tokens, 0, meta)
    e.worker.wait_for_save(meta)
    e.worker.flush()
    assert (e.worker.saved_tokens, e.worker.save_failures) == (len(tokens), 0)
    ext, _, _ = e.run("b", tokens)
    assert ext == 3 * BS and torch.equal(e.loaded_now, reference_kv(tokens)[:, :, :ext])


def test_a_load_planned_before_a_daemon_restart_registers_the_model_again_and_reports_its_blocks(
        restarting: tuple[RestartingDaemon, MiniVllm]) -> None:
    """The hit planned before the restart is gone with the daemon's DRAM: the load registers the model again and
    finds nothing, and every block it was to fill is reported to vLLM (recomputed, never read as loaded)."""
    daemon, e = restarting
    tokens = prompt(4 * BS + 5, seed=2)
    e.run("a", tokens)
    ext, ids, meta = plan(e, Request("b", tokens))
    assert ext == 4 * BS
    daemon.restart(e.client, e.worker.save_client)
    e.worker.start_load(meta)
    assert e.worker.take_load_errors() == set(ids[:4])
    assert [m.name for m in e.client.stats().models] == ["tiny-llama"]  # registered again by the load


def test_a_session_joined_after_a_daemon_restart_registers_the_model_again_and_is_opened(
        restarting: tuple[RestartingDaemon, MiniVllm]) -> None:
    """A request of an agent session finishes after the restart with nothing said to the daemon since: the
    session's open finds the model unknown, registers it again and opens the session on the prompt."""
    daemon, e = restarting
    tokens = prompt(2 * BS, seed=3)
    daemon.restart(e.client, e.worker.save_client)
    e.scheduler.request_finished(Request("a", tokens, kv_transfer_params={"engram_session_id": "agent-1"}), [])
    assert e.scheduler.sessions.failures == 0
    assert e.client.describe_blocks(session_id="agent-1").session.info.tokens == len(tokens)


# ---- saves in the background (async_saves) -------------------------------------------------------------------


class Gate:
    """The save client with its put held until the test opens the gate (then the real put runs, or `fail`)."""

    def __init__(self, client: Any, fail: Exception | None = None) -> None:
        self.client, self.fail = client, fail
        self.open, self.entered = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def put(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.open.wait(10), "the test never opened the gate"
        if self.fail is not None:
            raise self.fail
        return self.client.put(*args, **kwargs)


def test_an_async_save_does_not_hold_up_the_step_and_lands_after(engines: Any) -> None:
    e, other = engines(), engines()
    gate = e.worker.save_client = Gate(e.worker.save_client)
    tokens = prompt(3 * BS + 1, seed=20)
    e.run("a", tokens, flush=False)  # wait_for_save returned with the put still held
    assert gate.entered.wait(10) and e.worker.saved_tokens == 0
    assert other.scheduler.num_new_matched_tokens(Request("x", tokens), 0) == (0, False)  # not stored yet
    gate.open.set()
    e.worker.flush()
    assert e.worker.saved_tokens == len(tokens) and e.worker.save_failures == 0
    ext, _, _ = other.run("b", tokens)
    assert ext == 3 * BS and torch.equal(other.loaded_now, reference_kv(tokens)[:, :, :3 * BS])  # what was gathered


def test_pending_saves_are_bounded_in_bytes_and_the_next_step_waits_for_the_oldest(engines: Any) -> None:
    one = LAYERS * 2 * (2 * BS + 1) * HEADS * DIM * 2  # one prompt's buffer: room for one at a time
    e = engines(max_pending_bytes=one + 1)
    gate = e.worker.save_client = Gate(e.worker.save_client)
    first, second = prompt(2 * BS + 1, seed=21), prompt(2 * BS + 1, seed=22)
    e.run("a", first, flush=False)
    step = threading.Thread(target=e.run, args=("b", second), kwargs={"flush": False})
    step.start()
    step.join(0.3)
    assert step.is_alive()  # its save waits for the first one's buffer to be freed
    gate.open.set()
    step.join(10)
    assert not step.is_alive()
    e.worker.flush()
    assert e.worker.saved_tokens == len(first) + len(second)


def test_a_background_save_gives_way_to_a_load_in_flight_and_lands_after_it(engines: Any) -> None:
    e, other = engines(), engines()
    e.worker.gate.max_wait_s = 30  # as long as the load lasts (0.1 s by default)
    tokens = prompt(3 * BS + 1, seed=25)
    with e.worker.gate.loading():  # a load in flight on this worker (start_load holds the gate so)
        e.run("a", tokens, flush=False)
        time.sleep(0.3)
        assert e.worker.saved_tokens == 0
        assert other.scheduler.num_new_matched_tokens(Request("x", tokens), 0) == (0, False)  # nothing stored
    e.worker.flush()
    assert e.worker.saved_tokens == len(tokens) and e.worker.gate.waits >= 1
    ext, _, _ = other.run("b", tokens)
    assert ext == 3 * BS and torch.equal(other.loaded_now, reference_kv(tokens)[:, :, :3 * BS])


def test_a_load_holds_the_gate_while_it_runs(engines: Any) -> None:
    e = engines()
    tokens = prompt(2 * BS + 1, seed=26)
    e.run("a", tokens)
    seen = []
    load = e.worker._load
    e.worker._load = lambda spec: (seen.append(e.worker.gate.loads), load(spec))[1]  # type: ignore[method-assign]
    ext, _, _ = e.run("b", tokens)
    assert ext == 2 * BS and seen == [1] and e.worker.gate.loads == 0


def test_a_background_put_that_raises_is_logged_and_counted_not_raised_into_a_later_step(
        engines: Any, caplog: pytest.LogCaptureFixture) -> None:
    e = engines()
    gate = e.worker.save_client = Gate(e.worker.save_client, fail=RuntimeError("the save client broke"))
    gate.open.set()
    e.run("a", prompt(2 * BS + 1, seed=23))  # flushed: the failure does not surface as an exception
    assert e.worker.save_failures == 1 and "the save client broke" in caplog.text
    e.worker.save_client = gate.client
    tokens = prompt(2 * BS + 1, seed=24)
    e.run("b", tokens)
    assert e.worker.saved_tokens == len(tokens)


def test_with_async_saves_off_the_step_puts_and_the_connector_config_checks_the_keys(engines: Any) -> None:
    e = engines(async_saves="false")
    assert e.worker.save_client is None
    tokens = prompt(2 * BS + 1, seed=25)
    e.run("a", tokens, flush=False)
    assert e.worker.saved_tokens == len(tokens)  # stored before wait_for_save returned
    for key, bad in (("async_saves", "maybe"), ("max_pending_bytes", 0), ("max_pending_bytes", "lots")):
        with pytest.raises(InvalidArgument, match=key):
            ConnectorConfig.from_extra({"address": "unix:/x", key: bad})
    cfg = ConnectorConfig.from_extra({"address": "unix:/x", "async_saves": "off", "max_pending_bytes": "512MiB"})
    assert (cfg.async_saves, cfg.max_pending_bytes) == (False, 512 * 2**20)


# ---- agent sessions named in kv_transfer_params ----------------------------------------------------------------


def session_request(req_id: str, tokens: list[int], **params: Any) -> Request:
    return Request(req_id, tokens, kv_transfer_params={"engram_session_id": "agent-1", **params})


def held(e: MiniVllm, session_id: str = "agent-1") -> tuple[int, int, list[int]]:
    """The daemon's session: its tokens, its hint, and how many live sessions hold each of its blocks."""
    d = e.client.describe_blocks(session_id=session_id)
    assert d.session is not None
    return d.session.info.tokens, d.session.info.expect_back_ms, [b.sessions for b in d.blocks]


def test_a_request_naming_a_session_makes_the_daemons_session_hold_its_prompt_with_its_hint(engines: Any) -> None:
    e = engines()
    turn1 = prompt(3 * BT + 5, seed=1)
    e.run("t1", turn1, request=session_request("t1", turn1, engram_expect_back_ms=60_000))
    assert held(e) == (len(turn1), 60_000, [1] * 4)  # opened on the prompt; its stored blocks (a partial last) held
    turn2 = turn1 + prompt(BT, seed=2)  # the next turn resends the conversation and adds to it
    e.run("t2", turn2, request=session_request("t2", turn2, engram_expect_back_ms=1500))
    assert held(e) == (len(turn2), 1500, [1] * 5)  # appended to, the new hint in place of the old
    rewritten = prompt(2 * BT + 1, seed=3)  # the harness compacted its context: no longer an extension
    e.run("t3", rewritten, request=session_request("t3", rewritten))
    assert held(e) == (len(rewritten), 0, [1] * 3)  # reset to the new prompt; no hint said, none kept
    assert e.scheduler.sessions.failures == 0
    plain = prompt(BT + 1, seed=4)
    e.run("p", plain)  # no session named: nothing opened
    assert [s.info.session_id for s in e.client.list_sessions()] == ["agent-1"]


def test_a_session_updated_before_its_async_save_lands_holds_the_blocks_once_they_do(engines: Any) -> None:
    e = engines()
    gate = e.worker.save_client = Gate(e.worker.save_client)
    turn1 = prompt(2 * BT + 3, seed=11)
    e.run("t1", turn1, request=session_request("t1", turn1, engram_expect_back_ms=900), flush=False)
    assert held(e) == (len(turn1), 900, [])  # the request finished (a short answer) before its put landed
    gate.open.set()
    e.worker.flush()
    assert held(e) == (len(turn1), 900, [1] * 3)  # the daemon's session took the blocks as they were stored


def test_a_session_closed_on_the_daemon_or_by_another_engine_is_opened_again(engines: Any) -> None:
    a, b = engines(), engines()
    turn1 = prompt(2 * BT + 3, seed=5)
    a.run("t1", turn1, request=session_request("t1", turn1))
    a.client.close_session("agent-1")  # closed idle, say (or the daemon restarted)
    turn2 = turn1 + prompt(BT, seed=6)
    a.run("t2", turn2, request=session_request("t2", turn2, engram_expect_back_ms=500))
    assert held(a) == (len(turn2), 500, [1] * 4)
    turn3 = turn2 + prompt(5, seed=7)  # served by another engine, which never saw the session
    b.run("t3", turn3, request=session_request("t3", turn3))
    assert held(b) == (len(turn3), 0, [1] * 4) and a.scheduler.sessions.failures == b.scheduler.sessions.failures == 0


@pytest.mark.parametrize("bad", [-1, 86_400_001, "soon", True])
def test_a_bad_hint_is_logged_and_leaves_the_request_and_the_session_alone(engines: Any, bad: Any,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    e = engines()
    turn1 = prompt(BT + 3, seed=8)
    e.run("t1", turn1, request=session_request("t1", turn1, engram_expect_back_ms=2000))
    turn2 = turn1 + prompt(BT, seed=9)
    e.run("t2", turn2, request=session_request("t2", turn2, engram_expect_back_ms=bad))
    assert e.scheduler.sessions.failures == 1 and "expect_back_ms" in caplog.text
    assert held(e) == (len(turn1), 2000, [1] * 2)  # the session as it was
    assert e.run("t3", turn2)[0] == 2 * BT  # the refused turn's prompt was stored all the same
    e.run("t4", turn2, request=session_request("t4", turn2))  # the next good turn appends, as before
    assert held(e) == (len(turn2), 0, [1] * 3) and e.scheduler.sessions.failures == 1


def test_a_session_id_the_daemon_refuses_is_logged_not_raised(engines: Any) -> None:
    e = engines()
    turn1 = prompt(BT + 3, seed=10)
    e.run("t1", turn1, request=Request("t1", turn1, kv_transfer_params={"engram_session_id": "x" * 500}))
    assert e.scheduler.sessions.failures == 1 and list(e.client.list_sessions()) == []


# ---- config, layouts, refusals -------------------------------------------------------------------------------


def test_the_connector_config_refuses_unknown_keys_and_a_missing_address() -> None:
    with pytest.raises(InvalidArgument, match=r"unknown keys \['adress'\]"):
        ConnectorConfig.from_extra({"adress": "unix:/x"})
    with pytest.raises(InvalidArgument, match="needs 'address'"):
        ConnectorConfig.from_extra({"namespace": "a"})
    with pytest.raises(InvalidArgument, match=r"block_tokens.*must be int"):
        ConnectorConfig.from_extra({"address": "unix:/x", "block_tokens": "many"})
    cfg = ConnectorConfig.from_extra({"address": "unix:/x", "block_tokens": "128", "codec": "nvfp4"})
    assert (cfg.block_tokens, cfg.codec, cfg.namespace, cfg.timeout_s) == (128, "nvfp4", "default", 30.0)
    for bad in (0, -1, "inf", "nan", "soon", True):
        with pytest.raises(InvalidArgument, match="timeout_s"):
            ConnectorConfig.from_extra({"address": "unix:/x", "timeout_s": bad})
    assert ConnectorConfig.from_extra({"address": "unix:/x", "timeout_s": "2.5"}).timeout_s == 2.5


def test_the_model_spec_stores_every_attention_layer_in_model_order() -> None:
    shuffled = [LayerCache(n, "full", HEADS, DIM, DIM, torch.float16, BS) for n in reversed(NAMES)]
    lay = VllmLayers.from_caches(shuffled)
    assert lay.names == NAMES
    spec = ConnectorConfig(address="unix:/x", block_tokens=64, codec="raw").model_spec(lay, name="llama",
                                                                                        weights_id="w")
    assert spec.layout.persisted_layers == LAYERS and spec.layout.block_shape(64) == (LAYERS, 2, 64, HEADS, DIM)
    assert (spec.name, spec.weights_id, spec.codec, spec.layout.dtype.name) == ("llama", "w", "raw", "FP16")
    named = ConnectorConfig(address="unix:/x", name="mine", weights_id="rev-3").model_spec(lay, name="llama",
                                                                                           weights_id="w")
    assert (named.name, named.weights_id) == ("mine", "rev-3")


def engine(**hf: Any) -> Any:
    """vLLM's ModelConfig as the connector reads it: the checkpoint, its revision and quantization, and its HF config
    as the engine runs it (--hf-overrides applied)."""
    from types import SimpleNamespace

    config = {"model_type": "llama", "rope_theta": 500000.0, "_name_or_path": "/models/llama", **hf}
    return SimpleNamespace(model="/models/llama", revision=None, quantization=None,
                           hf_config=SimpleNamespace(model_type="llama", to_dict=lambda: dict(config)))


def test_the_default_identity_tells_apart_engines_whose_config_overrides_change_the_kv() -> None:
    """Without a weights_id, the same checkpoint run with another RoPE theta (vLLM's --hf-overrides) is another
    Engram model: its K differs for the same tokens. How the config was saved (its path entry) is not."""
    cfg = ConnectorConfig(address="unix:/x", codec="raw", block_tokens=BT)
    base = cfg.engine_model_spec(layers(), engine())
    assert base.name == "llama" and base.weights_id.startswith("vllm:/models/llama@")
    assert cfg.engine_model_spec(layers(), engine(_name_or_path="/elsewhere")).fingerprint == base.fingerprint
    assert cfg.engine_model_spec(layers(), engine(rope_theta=1000000.0)).fingerprint != base.fingerprint
    assert cfg.engine_model_spec(layers(), engine(rope_scaling={"rope_type": "yarn", "factor": 4.0})).fingerprint \
        != base.fingerprint
    unknown = cfg.engine_model_spec(layers(), None)
    assert (unknown.name, unknown.weights_id) == ("vllm-model", "vllm:unknown")


def test_a_json_null_in_the_connector_config_is_the_keys_default_not_the_string_none() -> None:
    """kv_connector_extra_config is JSON: a null is the key left unset. It became the string "None": with
    "weights_id": null the model was stored as weights "None" (plus the config hash) instead of vLLM's checkpoint,
    revision and quantization, and "namespace": null put every block in a namespace named "None" (an audit,
    session 48)."""
    nulls = {key: None for key in ("namespace", "token", "root_cert", "codec", "name", "weights_id", "block_tokens",
                                   "async_saves", "max_pending_bytes", "timeout_s")}
    cfg = ConnectorConfig.from_extra({"address": "unix:/x", **nulls})
    assert cfg == ConnectorConfig(address="unix:/x")
    spec = cfg.engine_model_spec(layers(), engine())
    assert spec.name == "llama" and spec.weights_id.startswith("vllm:/models/llama@"), spec
    assert spec.fingerprint == ConnectorConfig(address="unix:/x").engine_model_spec(layers(), engine()).fingerprint
    with pytest.raises(InvalidArgument, match="needs 'address'"):
        ConnectorConfig.from_extra({"address": None})


def test_a_given_weights_id_still_tells_apart_engines_whose_config_overrides_change_the_kv() -> None:
    """A weights_id names the checkpoint, not how it runs: the same checkpoint with another RoPE theta or scaling
    (--hf-overrides) is another Engram model with it too. The weights_id replaced the config hash, so those
    engines shared a fingerprint and loaded KV computed under the other RoPE (an audit)."""
    cfg = ConnectorConfig(address="unix:/x", codec="raw", block_tokens=BT, weights_id="llama-3.1-8b@rev")
    base = cfg.engine_model_spec(layers(), engine())
    for override in ({"rope_theta": 1000000.0}, {"rope_theta": 50.0},
                     {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}):
        assert cfg.engine_model_spec(layers(), engine(**override)).fingerprint != base.fingerprint, override
    assert cfg.engine_model_spec(layers(), engine(_name_or_path="/elsewhere")).fingerprint == base.fingerprint
    assert base.weights_id.startswith("llama-3.1-8b@rev#")  # the checkpoint's id, then the config's hash


def test_a_full_attention_model_is_the_same_engram_model_to_vllm_and_transformers(daemon: str) -> None:
    """Blocks a vLLM engine stores serve a transformers worker of the same model, and back: the same name,
    weights_id, HF config, codec and block_tokens give the same layout and fingerprint in both integrations
    (docs/INTEGRATIONS.md); another RoPE theta does not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def both(**rope: Any) -> tuple[bytes, bytes]:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                          num_key_value_heads=HEADS, head_dim=DIM, vocab_size=1000)
        cfg.rope_parameters = {**cfg.rope_parameters, **rope}
        return both_stacks(daemon, LlamaForCausalLM(cfg), "/models/llama", layers())

    same, other = both(), both(rope_theta=50.0)
    assert same[0] == same[1] and other[0] == other[1] and other[0] != same[0]


@pytest.mark.parametrize(("caches", "match"), [
    ([LayerCache("model.layers.0.attn", "mla", 1, 576, 0, torch.bfloat16, BS),
      LayerCache("model.layers.1.attn", "full", HEADS, DIM, DIM, torch.bfloat16, BS)], "mixes MLA layers"),
    ([LayerCache("model.layers.0.attn", "mla", 2, 576, 0, torch.bfloat16, BS)], "MLA cache of 2 heads"),
    ([LayerCache("model.layers.0.attn", "the sparse indexer's keys (DeepSeek-V3.2)", 1, 132, 0, torch.uint8, BS)],
     "full attention and MLA layers only"),
    ([LayerCache("model.layers.0.attn", "sliding", HEADS, DIM, DIM, torch.bfloat16, BS)],
     "disable-hybrid-kv-cache-manager"),
    ([LayerCache("model.layers.0.attn", "MambaSpec", 1, 0, 0, torch.bfloat16, BS)],
     "full attention and MLA layers only"),
    ([LayerCache("model.layers.0.attn", "full", HEADS, DIM, DIM, torch.bfloat16, BS),
      LayerCache("model.layers.1.attn", "full", HEADS, 2 * DIM, 2 * DIM, torch.bfloat16, BS)], "differ"),
    ([], "no attention layer"),
])
def test_layers_engram_cannot_store_are_refused_saying_why(caches: list[LayerCache], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        VllmLayers.from_caches(caches)


def test_a_quantized_vllm_cache_and_an_engram_block_vllm_blocks_do_not_fill_are_refused() -> None:
    fp8 = VllmLayers(NAMES, HEADS, DIM, torch.float8_e4m3fn, BS)
    with pytest.raises(InvalidArgument, match="kv_cache_dtype='auto'"):
        ConnectorConfig(address="unix:/x").model_spec(fp8, name="m", weights_id="w")
    with pytest.raises(InvalidArgument, match="multiple of vLLM's block_size"):
        ConnectorConfig(address="unix:/x", block_tokens=16).model_spec(layers(block_size=32), name="m", weights_id="w")


def test_both_vllm_cache_layouts_give_pages_that_write_into_the_cache() -> None:
    k = torch.randn(3, BS, HEADS, DIM)
    v = torch.randn(3, BS, HEADS, DIM)
    standardized = torch.zeros(3, HEADS, BS, 2 * DIM)  # (B, H, N, 2D)
    flash_v0 = torch.zeros(2, 3, BS, HEADS, DIM)  # (2, B, N, H, D)
    for cache in (standardized, flash_v0):
        kp, vp = kv_pages(cache, HEADS, DIM)
        kp.copy_(k)
        vp.copy_(v)
    assert torch.equal(standardized[:, :, :, :DIM], k.transpose(1, 2))
    assert torch.equal(standardized[:, :, :, DIM:], v.transpose(1, 2))
    assert torch.equal(flash_v0[0], k) and torch.equal(flash_v0[1], v)
    with pytest.raises(InvalidArgument, match="no layout Engram knows"):
        kv_pages(torch.zeros(3, BS, HEADS, DIM), HEADS, DIM)


def test_pages_smaller_than_vllms_block_are_addressed_through_it(engines: Any, daemon: str) -> None:
    """vLLM may view its cache in kernel blocks smaller than its own (8-token pages for 16-token blocks)."""
    tokens = prompt(3 * BS + 1, seed=13)
    engines().run("a", tokens)
    e = engines()
    kernel = {n: torch.full((2 * NUM_BLOCKS, HEADS, BS // 2, 2 * DIM), float("nan"), dtype=torch.bfloat16)
              for n in NAMES}
    e.worker.register_kv_caches(kernel)
    assert e.worker.pages_per_block == 2
    req = Request("b", tokens)
    ext, _ = e.scheduler.num_new_matched_tokens(req, 0)
    ids = [5, 1, 9, 3]
    e.scheduler.update_state_after_alloc(req, Blocks(ids), ext)
    meta = e.scheduler.build_meta(SchedulerOutput([NewRequestData("b", tokens, (ids,), ext)], CachedRequestData(),
                                                  {"b": 1}))
    e.worker.start_load(meta)
    want = reference_kv(tokens)
    for t in range(ext):
        page, row = ids[t // BS] * 2 + (t % BS) // (BS // 2), t % (BS // 2)
        assert torch.equal(kernel[NAMES[1]][page, :, row, :DIM], want[1, 0, t])
        assert torch.equal(kernel[NAMES[1]][page, :, row, DIM:], want[1, 1, t])


# ---- MLA: one latent entry a token and layer ------------------------------------------------------------------

LATENT_W = 576  # DeepSeek-V2/V3: kv_lora_rank 512 + qk_rope_head_dim 64


def reference_latent(tokens: list[int]) -> torch.Tensor:
    """An MLA model's cache entries for a prompt, (L, T, 576) bf16, each a function of the tokens up to it."""
    out = torch.empty(LAYERS, len(tokens), LATENT_W, dtype=torch.bfloat16)
    h = 0
    for t, tok in enumerate(tokens):
        h = (h * 1_000_003 + int(tok) + 1) % (2**61 - 1)
        out[:, t] = torch.randn(LAYERS, LATENT_W, generator=torch.Generator().manual_seed(h))
    return out


def mla_layers() -> VllmLayers:
    return VllmLayers.from_caches([LayerCache(n, "mla", 1, LATENT_W, 0, torch.bfloat16, BS) for n in NAMES])


class MiniMlaVllm(MiniVllm):
    """MiniVllm for an MLA model: per-layer caches of one 576-wide latent a token, in vLLM's standardized [B, H=1,
    N, C] view (`squeezed`: the (num_blocks, block_size, 576) of earlier releases), NaN-filled, shuffled ids."""

    def __init__(self, address: str, namespace: str, *, seed: int = 0, squeezed: bool = False, device: str = "cpu",
                 **extra: Any) -> None:
        cfg = config(address, namespace, **extra)
        self.layers = mla_layers()
        self.spec = cfg.model_spec(self.layers, name="tiny-deepseek", weights_id="seed-0")
        self.client = cfg.client()
        model = Registration(self.client, self.spec)
        fp = model.register()
        self.scheduler = EngramScheduler(model, BS, namespace=namespace)
        self.worker = EngramWorker(model, self.layers, namespace=namespace)
        shape = (NUM_BLOCKS, BS, LATENT_W) if squeezed else (NUM_BLOCKS, 1, BS, LATENT_W)
        self.caches = {n: torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device) for n in NAMES}
        self.worker.register_kv_caches(self.caches)
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.fingerprint = fp

    def row(self, name: str, block: int, t: int) -> torch.Tensor:
        cache = self.caches[name]
        return cache[block, t] if cache.dim() == 3 else cache[block, 0, t]

    def token_kv(self, block_ids: list[int], n: int) -> torch.Tensor:
        """The latents the cache holds for a request's first n tokens, (L, n, 576), by plain indexing."""
        out = torch.empty(LAYERS, n, LATENT_W, dtype=torch.bfloat16)
        for layer, name in enumerate(NAMES):
            for t in range(n):
                out[layer, t] = self.row(name, block_ids[t // BS], t % BS).cpu()
        return out

    def forward(self, block_ids: list[int], tokens: list[int], start: int, meta: Any) -> None:
        latent = reference_latent(tokens)
        for layer, name in enumerate(NAMES):
            for t in range(start, len(tokens)):
                self.row(name, block_ids[t // BS], t % BS).copy_(latent[layer, t])
            self.worker.save_layer(name, meta)


@pytest.fixture
def mla_engines(daemon: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    yield from _engines(MiniMlaVllm, daemon, request)


@pytest.mark.parametrize("squeezed", [False, True], ids=["B1NC", "BNC"])
def test_an_mla_prompt_is_saved_as_a_latent_stream_and_loads_bit_exact(mla_engines: Any, squeezed: bool) -> None:
    first = mla_engines(squeezed=squeezed)
    assert [(s.name, s.shape, s.codec) for s in first.spec.layout.streams] == [("latent", (LATENT_W,), "")]
    shared = prompt(5 * BS + 3, seed=30)
    ext, _, meta = first.run("a", shared)
    assert ext == 0 and [s.req_id for s in meta.saves] == ["a"] and first.worker.saved_tokens == len(shared)
    # What the daemon holds is the latent as vLLM's pages had it, one 576-wide entry a token and layer.
    n, stored = first.client.get_prefix(first.fingerprint, shared)
    assert n == len(shared) and torch.equal(stored["latent"], reference_latent(shared))

    second = mla_engines(squeezed=squeezed)
    longer = shared + prompt(20, seed=31)
    ext, ids, meta = second.run("b", longer)
    assert ext == 5 * BS and [(s.first_token, len(s.token_ids)) for s in meta.loads] == [(0, 5 * BS)]
    assert sorted(ids) != ids
    assert torch.equal(second.loaded_now, reference_latent(longer)[:, : 5 * BS])
    assert second.worker.loaded_tokens == 5 * BS
    untouched = sorted(set(range(NUM_BLOCKS)) - set(ids))
    assert torch.isnan(second.caches[NAMES[1]][untouched]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200)")
@pytest.mark.parametrize("codec", ["raw", "nvfp4"])
def test_mla_cuda_caches_save_and_load(mla_engines: Any, codec: str) -> None:
    """An MLA model's caches on the GPU: saves gathered from device latent pages, loads (FP4 decoded on the GPU)
    written into them; the latents are what the daemon holds, decoded."""
    shared = prompt(5 * BS + 3, seed=35)
    first = mla_engines(device="cuda", codec=codec)
    first.run("a", shared)
    assert first.worker.saved_tokens == len(shared)
    second = mla_engines(device="cuda", codec=codec)
    longer = shared + prompt(20, seed=36)
    ext, ids, _ = second.run("b", longer)
    assert ext == 5 * BS and second.caches[NAMES[0]].is_cuda
    n, decoded = second.client.get_prefix(second.fingerprint, shared)
    assert torch.equal(second.loaded_now, decoded["latent"][:, :ext])
    if codec == "raw":
        assert torch.equal(second.loaded_now, reference_latent(longer)[:, :ext])
    untouched = sorted(set(range(NUM_BLOCKS)) - set(ids))
    assert torch.isnan(second.caches[NAMES[0]][untouched]).all()


def test_mla_tokens_vllm_holds_itself_are_not_loaded_over(mla_engines: Any) -> None:
    stored = prompt(4 * BS, seed=32)
    mla_engines().run("a", stored)
    e = mla_engines()
    ext, ids, meta = e.run("b", [*stored, 7], local_hit=BS)
    assert ext == 3 * BS and [(s.first_token, len(s.token_ids)) for s in meta.loads] == [(BS, 4 * BS)]
    e.caches[NAMES[0]][ids[0]].fill_(7.0)
    e.worker.start_load(meta)
    assert (e.caches[NAMES[0]][ids[0]] == 7.0).all()
    assert torch.equal(e.token_kv(ids, 4 * BS)[:, BS:], reference_latent(stored)[:, BS : 4 * BS])


def test_mla_nvfp4_loads_are_the_daemons_decoded_latents_within_the_codecs_error(mla_engines: Any) -> None:
    shared = prompt(4 * BS + 5, seed=33)
    mla_engines(codec="nvfp4").run("a", shared)
    e = mla_engines(codec="nvfp4")
    ext, _, _ = e.run("b", shared + prompt(4, seed=34))
    assert ext == 4 * BS
    n, decoded = e.client.get_prefix(e.fingerprint, shared)
    assert n == len(shared) and torch.equal(e.loaded_now, decoded["latent"][:, :ext])
    want = reference_latent(shared)[:, :ext].float()
    rel = float((e.loaded_now.float() - want).norm() / want.norm())
    assert 0.0 < rel < 0.12  # nvfp4's error on Gaussian data (docs/FP4_NOTES.md); 0 would mean it stored raw


def test_an_mla_model_is_the_same_engram_model_to_vllm_and_transformers(daemon: str) -> None:
    """vLLM's MLA cache entry and transformers' DeepseekV3 cache (c then k_pe per layer) give the same layout: the
    same name, weights_id, HF config, codec and block_tokens make the same fingerprint."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(num_hidden_layers=LAYERS, first_k_dense_replace=LAYERS, hidden_size=64,
                           intermediate_size=64, num_attention_heads=2, kv_lora_rank=512, qk_rope_head_dim=64,
                           q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, vocab_size=1000)
    ours, theirs = both_stacks(daemon, DeepseekV3ForCausalLM(cfg), "/models/deepseek", mla_layers())
    assert ours == theirs
    spec = ConnectorConfig(address="unix:/x", codec="raw", block_tokens=BT).model_spec(mla_layers(), name="m",
                                                                                        weights_id="w")
    assert spec.layout.bytes_per_token() == LAYERS * LATENT_W * 2


def test_mla_pages_of_unknown_shapes_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="no layout Engram knows for a 576-wide latent"):
        latent_pages(torch.zeros(3, 2, BS, LATENT_W), LATENT_W)
    with pytest.raises(InvalidArgument, match="no layout Engram knows"):
        latent_pages(torch.zeros(3, BS, 512), LATENT_W)


# ---- against vLLM's real classes (skipped without vLLM: scripts/vllm_venv.sh builds a venv that has it) ----------

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# CI does not install vLLM (its wheel depends on a CUDA torch; scripts/vllm_venv.sh installs it without its
# dependencies): these skips say plainly what a CI run leaves uncovered.
WITHOUT_VLLM = ("vLLM is not installed: NOT COVERED here is the connector against real vLLM (its subclass of "
                "KVConnectorBase_V1 and the base class's signatures, VllmConfig, KVCacheConfig, Request, "
                "SchedulerOutput, vLLM's KV cache allocator); the connector's logic is tested above with a miniature "
                "vLLM. To run them: scripts/vllm_venv.sh VENV, then VENV/bin/pytest -q tests/test_integration_vllm.py")
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason=WITHOUT_VLLM)


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """vLLM imported for a CPU-only machine (its CPU platform, and Triton's missing GPU driver tolerated), and a
    tiny Llama model directory (config only: nothing here loads weights)."""
    if not HAVE_VLLM:
        pytest.skip(WITHOUT_VLLM)
    with pytest.MonkeyPatch.context() as mp:
        if not torch.cuda.is_available():
            mp.setenv("VLLM_TARGET_DEVICE", "cpu")
            mp.setenv("CUDA_VISIBLE_DEVICES", "")
        from transformers import LlamaConfig

        model = tmp_path_factory.mktemp("tiny-llama")
        LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                    num_key_value_heads=HEADS, head_dim=DIM, vocab_size=32_000, max_position_embeddings=1024,
                    dtype="bfloat16", architectures=["LlamaForCausalLM"]).save_pretrained(model)
        import warnings

        with warnings.catch_warnings():  # vLLM's own imports warn (deprecations in torch.jit, pydantic): not ours
            warnings.simplefilter("ignore")
            for name in ("vllm.config", "vllm.distributed.kv_transfer.kv_connector.factory",
                         "vllm.v1.core.kv_cache_planning", "vllm.v1.worker.utils", "vllm.v1.request",
                         "vllm.v1.core.sched.output", "vllm.v1.core.kv_cache_manager", "vllm.sampling_params",
                         "engram.integrations.vllm.connector"):
                importlib.import_module(name)
        yield model


class RealVllm:
    """EngramConnector's two roles built as vLLM builds them, from a real VllmConfig and KVCacheConfig, over the
    per-layer cache views vLLM's own allocator (allocate_kv_cache) makes in the given physical layout."""

    def __init__(self, model_dir: Path, address: str, namespace: str, layout: str, *, mla: bool = False,
                 **extra: Any) -> None:
        from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
        from vllm.v1.worker.utils import allocate_kv_cache

        self.mla = mla

        model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024)
        transfer = KVTransferConfig(kv_connector="EngramConnector", kv_connector_module_path="engram.integrations.vllm",
                                    kv_role="kv_both", kv_connector_extra_config={
                                        "address": address, "namespace": namespace, "codec": "raw",
                                        "block_tokens": BT, **extra})
        self.config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BS),
                                 kv_transfer_config=transfer)
        self.config.cache_config.kv_cache_layout = layout  # what vLLM's engine core resolves and records there
        # An MLA model's layers as vLLM's DeepSeek attention declares them (the model config stays the tiny
        # Llama's: the connector reads the layers' KV from the KV cache config alone).
        spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=LATENT_W, dtype=torch.bfloat16) if mla \
            else FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16)
        self.kv_cache_config = get_kv_cache_config_from_groups(
            self.config, [KVCacheGroupSpec(list(NAMES), spec)], NUM_BLOCKS * LAYERS * spec.page_size_bytes)
        self.caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                        self.config.cache_config.get_resolved_kv_cache_layout())
        for c in self.caches.values():
            c.fill_(float("nan"))
        # The class vLLM's factory finds, constructed as the factory does for each role.
        cls = KVConnectorFactory.get_connector_class(transfer)
        self.scheduler = cls(self.config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        self.worker = cls(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.worker.register_kv_caches(self.caches)
        self.free = list(range(self.kv_cache_config.num_blocks))
        random.Random(len(layout)).shuffle(self.free)

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()

    def token_kv(self, ids: list[int], n: int) -> torch.Tensor:
        """The cache's first n tokens by plain indexing of vLLM's [B, H, N, 2D] view (K channels first); for MLA,
        its [B, 1, N, 576] view's latents, (L, n, 576)."""
        if self.mla:
            return torch.stack([torch.stack([self.caches[name][ids[t // BS], 0, t % BS] for t in range(n)])
                                for name in NAMES])
        out = torch.empty(LAYERS, 2, n, HEADS, DIM, dtype=torch.bfloat16)
        for layer, name in enumerate(NAMES):
            for t in range(n):
                row = self.caches[name][ids[t // BS], :, t % BS]
                out[layer, 0, t], out[layer, 1, t] = row[:, :DIM], row[:, DIM:]
        return out

    def step(self, req_id: str, tokens: list[int]) -> tuple[int, Any, list[int], dict[Any, int]]:
        """One request through the connector's hooks with vLLM's own objects, its whole prompt in one step."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        from vllm.v1.request import Request as VllmRequest

        req = VllmRequest(req_id, tokens, SamplingParams(max_tokens=4), None)
        ext, load_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        assert load_async is False
        ids = [self.free.pop() for _ in range(-(-len(tokens) // BS))]
        self.scheduler.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(i) for i in ids],)), ext)
        sources = self.scheduler.get_external_cache_hit_sources(req, ext)
        req.num_computed_tokens = ext
        new = NewRequestData.from_request(req, (ids,), prefill_token_ids=tokens)
        out = SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData.make_empty(),
                              num_scheduled_tokens={req_id: len(tokens) - ext},
                              total_num_scheduled_tokens=len(tokens) - ext, scheduled_spec_decode_tokens={},
                              scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])
        meta = pickle.loads(pickle.dumps(self.scheduler.build_connector_meta(out)))  # to the worker's process
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        kv = reference_latent(tokens) if self.mla else reference_kv(tokens)
        for layer, name in enumerate(NAMES):
            self.worker.wait_for_layer_load(name)
            for t in range(ext, len(tokens)):  # attention writes the new tokens' KV
                row = self.caches[name][ids[t // BS], :, t % BS]
                if self.mla:
                    row[0] = kv[layer, t]
                else:
                    row[:, :DIM], row[:, DIM:] = kv[layer, 0, t], kv[layer, 1, t]
            self.worker.save_kv_layer(name, self.caches[name], None)
        self.worker.wait_for_save()
        self.worker.worker.flush()  # the put runs in the background (async_saves); the next request should hit
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        assert self.scheduler.request_finished(req, ids) == (False, None)
        assert errors == set()
        return ext, meta, ids, sources


@needs_vllm
def test_the_connector_subclasses_vllms_base_class_with_its_signatures(vllm_model: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    from engram.integrations.vllm import EngramConnector, EngramConnectorMetadata

    assert issubclass(EngramConnector, KVConnectorBase_V1) and not EngramConnector.__abstractmethods__
    assert issubclass(EngramConnectorMetadata, KVConnectorMetadata)
    overridden = [name for name, attr in vars(EngramConnector).items()
                  if callable(attr) and not name.startswith("_") and hasattr(KVConnectorBase_V1, name)]
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
            "register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
            "get_block_ids_with_load_errors"} <= set(overridden)
    for name in overridden:
        ours = inspect.signature(getattr(EngramConnector, name)).parameters
        theirs = inspect.signature(getattr(KVConnectorBase_V1, name)).parameters
        assert [(p.name, p.kind) for p in ours.values()] == [(p.name, p.kind) for p in theirs.values()], name


@needs_vllm
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])  # vLLM's NHD and HND physical orders of one [B, H, N, C] view
def test_real_vllm_classes_save_then_report_and_load_a_cached_prefix(vllm_model: Path, daemon: str, layout: str,
                                                                       request: pytest.FixtureRequest) -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    ns = namespace_of(request)
    first = RealVllm(vllm_model, daemon, ns, layout)
    second = RealVllm(vllm_model, daemon, ns, layout)
    try:
        shared = prompt(5 * BS + 3, seed=20)
        ext, meta, _, _ = first.step("a", shared)
        assert ext == 0 and [s.req_id for s in meta.saves] == ["a"]
        longer = shared + prompt(9, seed=21)
        ext, meta, ids, sources = second.step("b", longer)
        assert ext == 5 * BS and sources == {CacheHitSource.HOST: 5 * BS}  # from the daemon's DRAM pool
        assert [(s.first_token, len(s.token_ids)) for s in meta.loads] == [(0, 5 * BS)]
        assert torch.equal(second.token_kv(ids, 5 * BS), reference_kv(longer)[:, :, : 5 * BS])
        miss, _, _, _ = second.step("c", prompt(3 * BS, seed=22))
        assert miss == 0
    finally:
        first.close()
        second.close()


@needs_vllm
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_real_vllm_mla_caches_save_and_load_a_latent_stream(vllm_model: Path, daemon: str, layout: str,
                                                             request: pytest.FixtureRequest) -> None:
    """vLLM's MLAAttentionSpec (one 576-wide latent a token, the [B, 1, N, 576] views its allocator makes) through
    the real EngramConnector: saved as the latent stream, reported and loaded bit for bit into scattered blocks."""
    ns = namespace_of(request)
    first = RealVllm(vllm_model, daemon, ns, layout, mla=True)
    second = RealVllm(vllm_model, daemon, ns, layout, mla=True)
    try:
        assert tuple(first.caches[NAMES[0]].shape) == (first.kv_cache_config.num_blocks, 1, BS, LATENT_W)
        assert [s.name for s in first.worker.spec.layout.streams] == ["latent"]
        shared = prompt(4 * BS + 7, seed=40)
        ext, meta, _, _ = first.step("a", shared)
        assert ext == 0 and [s.req_id for s in meta.saves] == ["a"]
        longer = shared + prompt(5, seed=41)
        ext, meta, ids, _ = second.step("b", longer)
        assert ext == 4 * BS and [(s.first_token, len(s.token_ids)) for s in meta.loads] == [(0, 4 * BS)]
        assert torch.equal(second.token_kv(ids, 4 * BS), reference_latent(longer)[:, : 4 * BS])
    finally:
        first.close()
        second.close()


@needs_vllm
def test_real_vllm_configs_engram_cannot_serve_are_refused(vllm_model: Path, daemon: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, SparseCacheRole

    from engram.integrations.vllm import EngramConnector

    base = RealVllm(vllm_model, daemon, "refusals", "LBNHC")
    base.close()

    def mla(**kw: Any) -> KVCacheConfig:
        spec = {"block_size": BS, "num_kv_heads": 1, "head_size": LATENT_W, "dtype": torch.bfloat16, **kw}
        return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(list(NAMES), MLAAttentionSpec(**spec))])

    with pytest.raises(InvalidArgument, match="quantized"):  # DeepSeek's fp8 latent cache
        EngramConnector(base.config, KVConnectorRole.WORKER, mla(head_size=656, dtype=torch.uint8,
                                                                cache_dtype_str="fp8_ds_mla"))
    with pytest.raises(InvalidArgument, match="sparse indexer"):  # DeepSeek-V3.2's indexer keys
        EngramConnector(base.config, KVConnectorRole.WORKER, mla(head_size=132, dtype=torch.uint8,
                                                                cache_role=SparseCacheRole.INDEXER))
    base.config.parallel_config.tensor_parallel_size = 2
    with pytest.raises(InvalidArgument, match="tensor_parallel_size=2"):
        EngramConnector(base.config, KVConnectorRole.SCHEDULER, base.kv_cache_config)


def test_a_root_cert_that_cannot_be_read_is_a_config_error_naming_the_key_and_path(tmp_path: Path) -> None:
    """kv_connector_extra_config's root_cert naming no file raised a bare FileNotFoundError when the connector
    made its client (an audit, session 48); a directory IsADirectoryError. Refused at parse as the other keys are,
    naming the key and the path; a file that is not a PEM certificate too."""
    not_pem = tmp_path / "key.txt"
    not_pem.write_text("not a certificate")
    for path, why in ((tmp_path / "missing.pem", "No such file"), (tmp_path, "directory"),
                      (not_pem, "not a PEM certificate")):
        with pytest.raises(InvalidArgument, match=rf"kv_connector_extra_config\['root_cert'\].*{path}.*{why}"):
            ConnectorConfig.from_extra({"address": "localhost:50051", "root_cert": str(path)})
        with pytest.raises(InvalidArgument, match=rf"kv_connector_extra_config\['root_cert'\].*{path}.*{why}"):
            ConnectorConfig(address="localhost:50051", root_cert=str(path)).client()
