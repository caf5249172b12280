"""Engram as a transformers model's prefix cache, against a real daemon, with tiny random-weight Llama, Qwen3,
gpt-oss, Gemma 3 and DeepSeek-V3 (MLA: a latent stream) models saved with save_pretrained: one session stores
its KV, the worker process is replaced (a fresh process loads the model from its directory), and a second
session sharing a long prefix loads it and prefills only the rest. Greedy generation is token-identical with and
without Engram and the first step's logits agree to float32 rounding (raw codec; for the hybrid models the
sliding layers' windows are rebuilt by exact replay); with nvfp4 the first step's logits stay within the
tolerance docs/INTEGRATIONS.md states."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import missing

if importlib.util.find_spec("transformers") is None:  # a declared test dependency: fails, unless ENGRAM_TESTS_WITHOUT names it
    missing("transformers", "the transformers integration needs it (pip install -e '.[dev]')")

from engram.client import SyncEngramClient
from engram.integrations.transformers import EngramPrefixCache, generate, layout_of
from engram.replay.hf import cache_kwarg

from helpers import NEUTRAL_CWD, RestartingDaemon, engram_daemon, wait_reachable

RAW_LOGIT_TOL = 1e-5  # float32 rounding of a different prefill split; damage to any stream is orders above
NVFP4_LOGIT_TOL = 0.1  # relative L2 error of the first step's logits; measured 0.018 (Llama), 0.046 (Gemma 3)


def tiny(kind: str) -> Any:
    """A tiny random-weight model of the family, in float32, eager attention."""
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    if kind == "llama":
        cfg, cls = tf.LlamaConfig(num_hidden_layers=2, **common), tf.LlamaForCausalLM
    elif kind == "qwen3":
        cfg, cls = tf.Qwen3Config(num_hidden_layers=2, **common), tf.Qwen3ForCausalLM
    elif kind == "deepseek-v3":  # MLA: the cache holds the latent (c of 32 + k_pe of 8), not per-head K/V
        cfg = tf.DeepseekV3Config(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4,
                                  num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                                  moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
                                  qk_nope_head_dim=16, v_head_dim=16,
                                  **{**common, "num_key_value_heads": 4, "head_dim": 8})
        cls = tf.DeepseekV3ForCausalLM
    elif kind == "gpt-oss":
        cfg = tf.GptOssConfig(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                              **{**common, "intermediate_size": 64})
        cls = tf.GptOssForCausalLM
        cfg._experts_implementation = "eager"
    else:
        cfg = tf.Gemma3TextConfig(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"], **common)
        cls = tf.Gemma3ForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(cfg).float().eval()


WORKER = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from engram.client import SyncEngramClient
from engram.integrations.transformers import EngramPrefixCache, cache_kwarg, generate
model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32, attn_implementation={attn!r}).eval()
with SyncEngramClient({address!r}, namespace="agents") as client:
    cache = EngramPrefixCache(model, client, codec={codec!r}, block_tokens=16)
    ids = torch.tensor([{tokens!r}])
    out = generate(model, ids, cache, max_new_tokens=6, do_sample=False)
    loaded = cache.last_loaded  # what this session found cached from the first one
    past = cache.load(ids)
    logits = model(ids[:, cache.last_loaded:], **{{cache_kwarg(model): past}}).logits[0, -1]
    print(json.dumps({{"tokens": out[0].tolist(), "loaded": loaded, "logits": logits.tolist()}}))
"""


async def _second_session(path: Path, address: str, codec: str, tokens: list[int], attn: str = "eager"
                          ) -> dict[str, Any]:
    """A fresh worker process: loads the model from its directory (with that attention: "sdpa" runs Engram's
    GQA-aware one, engram/integrations/hf_attention.py) and runs a session through Engram."""
    code = WORKER.format(path=str(path), address=address, codec=codec, tokens=tokens, attn=attn)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, cwd=NEUTRAL_CWD)
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, err.decode()[-3000:]
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(("kind", "attn"), [("llama", "eager"), ("qwen3", "eager"), ("gpt-oss", "eager"),
                                           ("gemma3", "eager"), ("deepseek-v3", "eager"), ("llama", "sdpa"),
                                           ("gemma3", "sdpa"), ("deepseek-v3", "sdpa")])
async def test_greedy_generation_is_identical_with_and_without_engram(server_factory, tmp_path: Path, kind: str,
                                                                      attn: str) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    model = tiny(kind)
    model.save_pretrained(tmp_path / kind)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 256, (1, 70), generator=g)  # a shared system prompt + repository
    first = torch.cat([prefix, torch.randint(0, 256, (1, 5), generator=g)], dim=1)
    second = torch.cat([prefix, torch.randint(0, 256, (1, 9), generator=g)], dim=1)

    def first_session() -> tuple[int, int]:
        with SyncEngramClient(srv.address, namespace="agents") as client:
            cache = EngramPrefixCache(model, client, codec="raw", block_tokens=16)
            generate(model, first, cache, max_new_tokens=6, do_sample=False)
            return cache.last_loaded, cache.client.stats().blocks_put

    loaded, stored = await asyncio.to_thread(first_session)
    assert loaded == 0 and stored >= 4  # a cold cache; its whole sequence stored
    got = await _second_session(tmp_path / kind, srv.address, "raw", second[0].tolist(), attn)
    assert got["loaded"] == 70  # the shared prefix came from Engram; only the rest was prefilled
    want = model.generate(second, max_new_tokens=6, do_sample=False)[0].tolist()
    assert got["tokens"] == want
    with torch.no_grad():  # and the loaded cache is the model's own (greedy tokens alone miss small damage)
        want_logits = model(second).logits[0, -1]
    err = float((torch.tensor(got["logits"]) - want_logits).norm() / want_logits.norm())
    print(f"{kind}: raw first-step logits relative error {err:.2e}")
    assert err <= RAW_LOGIT_TOL, err
    if kind in ("gpt-oss", "gemma3"):
        assert layout_of(model).persisted_layers < len(layout_of(model).layers)  # sliding layers were replayed
    if kind == "deepseek-v3":  # one 40-wide latent a token and layer, not 4 heads of K (24) and V (16)
        assert [(s.name, s.shape) for s in layout_of(model).streams] == [("latent", (40,))]


async def test_the_forward_after_a_hit_appends_into_the_loaded_buffer_and_generation_stays_in_its_room(
        server_factory) -> None:  # type: ignore[no-untyped-def]
    """The cache `load` builds holds its global layers in buffers with room for the prompt's rest and the tokens
    to generate: the suffix's forward and every generated token are written there, not concatenated."""
    srv = await server_factory()
    model = tiny("llama")
    model.set_attn_implementation("sdpa")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (1, 79), generator=g)

    def hit() -> tuple[list[tuple[bool, bool, int]], list[tuple[bool, bool, int]], int, float]:
        from transformers import DynamicCache

        with SyncEngramClient(srv.address, namespace="agents") as client, torch.no_grad():
            cache = EngramPrefixCache(model, client, codec="raw", block_tokens=16)
            assert model.config._attn_implementation == "engram_sdpa"
            own = DynamicCache(config=model.config)
            model(ids[:, :70], **{cache_kwarg(model): own})
            cache.store(ids[0, :70].tolist(), own)
            past = cache.load(ids, room=6)
            rooms = [layer.room_keys.data_ptr() for layer in past.layers]
            logits = model(ids[:, cache.last_loaded:], **{cache_kwarg(model): past}).logits[0, -1]
            after = [(layer.in_room, layer.keys.data_ptr() == r, layer.get_seq_length())
                     for layer, r in zip(past.layers, rooms, strict=True)]
            again = cache.load(ids, room=6)
            model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, **{cache_kwarg(model): again})
            generated = [(layer.in_room, layer.keys.data_ptr() == layer.room_keys.data_ptr(), layer.get_seq_length())
                         for layer in again.layers]
            full = model(ids).logits[0, -1]
            return after, generated, cache.last_loaded, float((logits - full).norm() / full.norm())

    after, generated, loaded, err = await asyncio.to_thread(hit)
    assert loaded == 70
    assert after == [(True, True, 79)] * 2  # 70 loaded + 9 appended in place
    assert generated == [(True, True, 84)] * 2  # + 6 generated, the last one's KV not computed
    assert err <= RAW_LOGIT_TOL


async def test_generate_with_a_session_id_makes_the_daemons_session_hold_the_conversation(server_factory) -> None:  # type: ignore[no-untyped-def]
    """An agent's turns through `generate(..., session_id=, expect_back_ms=)`: the daemon's session holds what
    each turn stored (opened, then appended to), with the turn's hint; a bad hint is logged, not raised."""
    srv = await server_factory()
    model = tiny("llama")
    g = torch.Generator().manual_seed(3)
    turn1 = torch.randint(0, 256, (1, 40), generator=g)

    def turns() -> tuple[Any, Any, int]:
        with SyncEngramClient(srv.address, namespace="agents") as client:
            cache = EngramPrefixCache(model, client, codec="raw", block_tokens=16)
            out = generate(model, turn1, cache, session_id="agent-7", expect_back_ms=30_000, max_new_tokens=4,
                           do_sample=False)
            first = client.describe_blocks(session_id="agent-7").session
            turn2 = torch.cat([out, torch.randint(0, 256, (1, 9), generator=g)], dim=1)  # the tool's result
            generate(model, turn2, cache, session_id="agent-7", expect_back_ms=-5, max_new_tokens=4, do_sample=False)
            second = client.describe_blocks(session_id="agent-7")
            return first, second, cache.sessions.failures

    first, second, failures = await asyncio.to_thread(turns)
    assert (first.info.tokens, first.info.expect_back_ms, first.blocks) == (43, 30_000, 3)  # 40 + 4 generated - 1
    assert failures == 1 and second.session.info.tokens == 43  # the refused hint: the session as it was
    assert all(b.sessions == 1 for b in second.blocks)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
async def test_nvfp4_logits_stay_within_the_stated_tolerance(server_factory, tmp_path: Path, kind: str) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    model = tiny(kind)
    model.save_pretrained(tmp_path / kind)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 256, (1, 96), generator=g)
    ids = torch.cat([prefix, torch.randint(0, 256, (1, 4), generator=g)], dim=1)

    def store() -> None:
        with SyncEngramClient(srv.address, namespace="agents") as client:
            cache = EngramPrefixCache(model, client, codec="nvfp4", block_tokens=16)
            generate(model, ids, cache, max_new_tokens=1, do_sample=False)

    await asyncio.to_thread(store)
    got = await _second_session(tmp_path / kind, srv.address, "nvfp4", ids[0].tolist())
    assert got["loaded"] == 99  # all but the last token came from Engram (the logits' load)
    with torch.no_grad():
        want = model(ids).logits[0, -1]
    err = float((torch.tensor(got["logits"]) - want).norm() / want.norm())
    print(f"{kind}: nvfp4 first-step logits relative error {err:.4f}")
    assert 0 < err <= NVFP4_LOGIT_TOL, err  # not bit-exact (FP4), but close


async def test_a_rope_override_of_the_same_checkpoint_is_another_model_though_the_weights_id_is_the_same(
        server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """One checkpoint loaded as it is and with a config override (rope_theta 500, linear RoPE scaling x4), each
    given the same weights_id: the overrides compute other K for the same tokens, so they get other fingerprints
    and miss the KV the first one stored. A given weights_id replaced the config hash: they shared a fingerprint
    and loaded KV computed under the other RoPE (greedy tokens changed in 2 of 8 prompts, an audit). The same
    checkpoint and config loaded again with that weights_id is the same model, and hits."""
    import transformers as tf

    srv = await server_factory()
    tiny("llama").save_pretrained(tmp_path / "ckpt")

    def load(**rope: Any) -> Any:
        """The checkpoint with its RoPE parameters overridden, as vLLM's --hf-overrides or a config= does."""
        cfg = tf.AutoConfig.from_pretrained(tmp_path / "ckpt")
        cfg.rope_parameters = {**cfg.rope_parameters, **rope}
        return tf.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", config=cfg, dtype=torch.float32,
                                                       attn_implementation="eager").eval()

    prompt = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(3))

    def sessions() -> dict[str, tuple[bool, int]]:
        with SyncEngramClient(srv.address, namespace="agents") as client:
            first = EngramPrefixCache(load(), client, codec="raw", block_tokens=16, weights_id="ckpt@rev1")
            generate(first.model, prompt, first, max_new_tokens=4, do_sample=False)
            out = {}
            for label, model in (("theta", load(rope_theta=500.0)), ("linear", load(rope_type="linear", factor=4.0)),
                                 ("same", load())):
                cache = EngramPrefixCache(model, client, codec="raw", block_tokens=16, weights_id="ckpt@rev1")
                cache.load(prompt)
                out[label] = (cache.fingerprint == first.fingerprint, cache.last_loaded)
            return out

    got = await asyncio.to_thread(sessions)
    assert got == {"theta": (False, 0), "linear": (False, 0), "same": (True, 63)}


async def test_beam_search_stores_the_prompt_not_a_beams_tokens_under_the_answers_name(server_factory) -> None:  # type: ignore[no-untyped-def]
    """With beams the cache holds one row per beam, reordered every step: which row is out[0]'s is not known, so
    `generate` stores only the prompt every row shares (it once filed row 0 under out[0]: another beam's KV),
    and `store` refuses a cache of several rows. The next turn loads the prompt and prefills the rest."""
    from engram.errors import InvalidArgument
    from engram.integrations.transformers import cache_kwarg

    srv = await server_factory()
    model = tiny("llama")
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5))

    def turn() -> tuple[Any, int, int, Any]:
        with SyncEngramClient(srv.address, namespace="agents") as client:
            cache = EngramPrefixCache(model, client, codec="raw", block_tokens=16)
            past = cache.load(prompt)
            out = model.generate(prompt, **{cache_kwarg(model): past}, num_beams=4, max_new_tokens=12,
                                 do_sample=False, length_penalty=0.0)
            with pytest.raises(InvalidArgument, match="one sequence"):
                cache.store(out, past)
            out = generate(model, prompt, cache, num_beams=4, max_new_tokens=12, do_sample=False, length_penalty=0.0)
            held = client.lookup(cache.fingerprint, out[0].tolist()).matched_tokens
            nxt = cache.load(out)
            with torch.no_grad():
                logits = model(out[:, cache.last_loaded:], **{cache_kwarg(model): nxt}).logits[0, -1]
            return out, held, cache.last_loaded, logits

    out, held, loaded, logits = await asyncio.to_thread(turn)
    assert held == loaded == prompt.shape[1]  # the prompt only
    with torch.no_grad():
        want = model(out).logits[0, -1]
    assert float((logits - want).norm() / want.norm()) <= RAW_LOGIT_TOL


@pytest.mark.parametrize("family", ["Mistral", "Mixtral", "Phi3", "Starcoder2"])
def test_a_model_whose_every_layer_slides_is_refused_in_its_configs_terms(family: str) -> None:
    """Mistral v0.1-style configs (sliding_window set, no layer_types) slide in every layer: no global KV to
    store per block. The refusal was the wire API's ("mark at least one layer LAYER_KIND_GLOBAL"); it now says
    that every layer of the model slides and names the config field."""
    import transformers as tf

    from engram.errors import InvalidArgument

    cfg = getattr(tf, f"{family}Config")(num_hidden_layers=2, sliding_window=64, vocab_size=256, hidden_size=64,
                                         intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, pad_token_id=0)
    model = getattr(tf, f"{family}ForCausalLM")(cfg)
    with pytest.raises(InvalidArgument, match=r"every layer of this \w+ model slides \(its config's sliding_window=64, "
                                              r"with no layer_types, applies to all 2 layers\)"):
        layout_of(model)
    cfg.sliding_window = None  # no window: every layer full attention, stored as such
    assert {layer.kind.name for layer in layout_of(model).layers} == {"GLOBAL"}

async def test_generate_returns_the_answer_when_the_daemon_is_gone_counting_the_failed_load_and_store(
        caplog: pytest.LogCaptureFixture) -> None:
    """The daemon stops between two requests: the next `generate` loads nothing (a miss, not an error), computes
    the answer, and its store fails. Both were raised (Unavailable) even after the answer was computed; now each
    is logged and counted, as the vLLM connector does, and the answer is the model's own."""
    from engram.config import load_config
    from engram.server import start_server

    srv = await start_server(load_config(env={}, overrides={"server.port": 0, "tiers.dram.capacity": "64MiB",
                                                            "tiers.dram.prefault": False}))
    model = tiny("llama")
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(6))
    longer = torch.cat([prompt, torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(7))], dim=1)

    def first_turn() -> tuple[SyncEngramClient, EngramPrefixCache]:
        client = SyncEngramClient(srv.address, namespace="agents")
        cache = EngramPrefixCache(model, client, codec="raw", block_tokens=16)
        generate(model, prompt, cache, max_new_tokens=4, do_sample=False)
        return client, cache

    try:
        client, cache = await asyncio.to_thread(first_turn)
    finally:
        await srv.stop(0)
    try:
        with caplog.at_level("WARNING", logger="engram.integrations"):
            out = await asyncio.to_thread(generate, model, longer, cache, max_new_tokens=4, do_sample=False)
    finally:
        await asyncio.to_thread(client.close)
    assert torch.equal(out, model.generate(longer, max_new_tokens=4, do_sample=False))
    assert cache.last_loaded == 0 and (cache.load_failures, cache.store_failures) == (1, 1)  # the first turn's: none
    assert "Engram load" in caplog.text and "Engram store" in caplog.text


def test_a_stopped_daemon_costs_generate_its_clients_timeout_a_counted_miss_and_a_counted_store_failure(
        tmp_path: Path) -> None:
    """The daemon stops (SIGSTOP: hung, or its host frozen) between two requests of a worker whose client has
    timeout_s = 1: the load gives up within it (a miss) and so does the store, each counted, and `generate` returns
    the model's answer; both waited for as long as the daemon stalled. Once it continues the prompt hits again."""
    model = tiny("llama")
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(10))
    with engram_daemon(tmp_path) as (address, proc), \
            SyncEngramClient(address, namespace="agents", timeout_s=1.0) as client:
        cache = EngramPrefixCache(model, client, codec="raw", block_tokens=16)
        for _ in range(2):
            generate(model, prompt, cache, max_new_tokens=3, do_sample=False)
        assert cache.last_loaded == 39
        answers: list[torch.Tensor] = []
        turn = threading.Thread(target=lambda: answers.append(
            generate(model, prompt, cache, max_new_tokens=3, do_sample=False)), daemon=True)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            turn.start()
            turn.join(2 * 1.0 + 5.0)  # the load and the store given up, a loaded machine's slack
            assert not turn.is_alive(), "generate was still blocked on the stopped daemon"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert torch.equal(answers[0], model.generate(prompt, max_new_tokens=3, do_sample=False))
        assert cache.last_loaded == 0 and (cache.load_failures, cache.store_failures) == (1, 1)
        generate(model, prompt, cache, max_new_tokens=3, do_sample=False)
        assert cache.last_loaded == 39 and (cache.load_failures, cache.store_failures) == (1, 1)


async def test_a_cache_built_before_its_daemon_starts_misses_then_hits_once_the_daemon_is_up(tmp_path: Path) -> None:
    """A worker starts before its daemon: the cache is built with the daemon down (it raised Unavailable: the
    model was registered at construction), the first request runs as a miss (a counted load failure, its store
    skipped), and once the daemon is up the model is registered on the next call: that request stores, the
    one after loads the prefix."""
    from engram.config import load_config
    from engram.server import start_server

    sock = tmp_path / "engram.sock"
    model = tiny("llama")
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(8))
    client = await asyncio.to_thread(SyncEngramClient, f"unix:{sock}", namespace="agents")
    try:
        cache = EngramPrefixCache(model, client, codec="raw", block_tokens=16)  # no daemon yet
        out = await asyncio.to_thread(generate, model, prompt, cache, max_new_tokens=4, do_sample=False)
        assert torch.equal(out, model.generate(prompt, max_new_tokens=4, do_sample=False))
        assert cache.last_loaded == 0 and (cache.load_failures, cache.store_failures) == (1, 1)
        srv = await start_server(load_config(env={}, overrides={
            "server.port": 0, "server.unix_socket": str(sock), "tiers.dram.capacity": "64MiB",
            "tiers.dram.prefault": False}))
        try:
            await asyncio.to_thread(wait_reachable, client)
            await asyncio.to_thread(generate, model, prompt, cache, max_new_tokens=4, do_sample=False)
            assert cache.last_loaded == 0 and (cache.load_failures, cache.store_failures) == (1, 1)  # stored
            await asyncio.to_thread(generate, model, prompt, cache, max_new_tokens=4, do_sample=False)
            assert cache.last_loaded == 39  # all but the last token (the model computes its logits)
        finally:
            await srv.stop(0)
    finally:
        await asyncio.to_thread(client.close)


def test_after_a_daemon_restart_the_cache_registers_its_model_again_then_stores_and_hits(tmp_path: Path) -> None:
    """The daemon (DRAM only: no model registry survives it) restarts on the same socket under a worker that had
    hits. The next request's load finds the model unknown: the cache registers it again and loads (a miss: the
    daemon is empty), and its store lands; the request after it hits. Every load and store failed "unknown model
    fingerprint" for as long as the worker ran: the cache registered its model once (an audit)."""
    model = tiny("llama")
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(9))
    with RestartingDaemon(tmp_path) as daemon, SyncEngramClient(daemon.address, namespace="agents") as client:
        cache = EngramPrefixCache(model, client, codec="raw", block_tokens=16)
        for _ in range(2):
            generate(model, prompt, cache, max_new_tokens=3, do_sample=False)
        assert cache.last_loaded == 39
        daemon.restart(client)
        out = generate(model, prompt, cache, max_new_tokens=3, do_sample=False)
        assert cache.last_loaded == 0 and (cache.load_failures, cache.store_failures) == (0, 0)
        assert torch.equal(out, model.generate(prompt, max_new_tokens=3, do_sample=False))
        generate(model, prompt, cache, max_new_tokens=3, do_sample=False)
        assert cache.last_loaded == 39 and (cache.load_failures, cache.store_failures) == (0, 0)
