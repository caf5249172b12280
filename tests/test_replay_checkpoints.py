"""Hugging Face checkpoint directories as the daemon's replay models (replay.models): tiny random gpt-oss,
Gemma 2, Gemma 3, Mistral-family (Ministral's interleaved layers) and Qwen2 models written with save_pretrained in
several safetensors shards, loaded by path by a real daemon, which replays a session whose window was dropped;
the logits the worker then computes equal an uninterrupted run's (prefill, keep the window, decode) bit for bit
in float64 on the CPU. (HF's own decode differs from a prefill of one more token by ~5e-8 on Gemma 3, float32
RoPE tables: that is HF against itself, not replay.)"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import missing

if importlib.util.find_spec("transformers") is None:  # a declared test dependency: fails, unless ENGRAM_TESTS_WITHOUT names it
    missing("transformers", "the HF checkpoints' tests need it (pip install -e '.[dev]')")

from engram import errors
from engram.client import EngramClient
from engram.config import ConfigError, load_config
from engram.replay import SwaWindow, decode_next
from engram.replay.hf import HFReplayModel, load_checkpoint, tiny_gemma3, tiny_gpt_oss
from engram.replay.model import ReplayError
from engram.replay.runtime import ReplayRuntime, model_spec_for

BT = 16
P = 45  # ends inside a block; longer than every model's exact replay bound below


def _ministral(dtype: torch.dtype) -> HFReplayModel:
    """Mistral family with interleaved sliding and full layers (as Ministral 8B): global KV to store."""
    from transformers import MinistralConfig, MinistralForCausalLM

    config = MinistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                             layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=4096)
    return _random(MinistralForCausalLM, config, dtype)


def _qwen2(dtype: torch.dtype) -> HFReplayModel:
    """A Qwen2 config with sliding layers (use_sliding_window: layers from max_window_layers on slide)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=6,
                         max_window_layers=2, max_position_embeddings=4096)
    return _random(Qwen2ForCausalLM, config, dtype)


def _gemma2(dtype: torch.dtype) -> HFReplayModel:
    """Gemma 2: sliding and global layers alternating, attention logit softcapping."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                          max_position_embeddings=4096)
    config._attn_implementation = "eager"
    return _random(Gemma2ForCausalLM, config, dtype)


def _random(cls: Any, config: Any, dtype: torch.dtype) -> HFReplayModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return HFReplayModel(cls(config).to(dtype))


FAMILIES: dict[str, Callable[[torch.dtype], HFReplayModel]] = {
    "gpt-oss": lambda dtype: tiny_gpt_oss(window=6, dtype=dtype),
    "gemma2": _gemma2,
    "gemma3": lambda dtype: tiny_gemma3(window=6, dtype=dtype),
    "ministral": _ministral,
    "qwen2": _qwen2,
}


def save_checkpoint(model: HFReplayModel, where: Path) -> Path:
    """save_pretrained in shards of at most 40 KB: the loader must read every shard, not only the first."""
    model.model.save_pretrained(where, max_shard_size="40KB")
    assert len(list(where.glob("*.safetensors"))) > 3
    return where


def tokens_for(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.int32)


def stored_tensor(model: HFReplayModel, toks: np.ndarray) -> torch.Tensor:
    res = model.prefill(torch.as_tensor(toks, dtype=torch.long))
    return torch.stack([torch.stack((k, v)) for k, v in res.global_kv])


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_daemon_replays_a_checkpoint_to_the_uninterrupted_logits(family: str, server_factory,  # type: ignore[no-untyped-def]
                                                                         tmp_path: Path) -> None:
    path = save_checkpoint(FAMILIES[family](torch.float64), tmp_path / family)
    worker = load_checkpoint(path, dtype=torch.float64)  # the worker loads the same checkpoint by path
    srv = await server_factory(**{"replay.models": str(path), "replay.device": "cpu", "replay.dtype": "float64"})
    toks = tokens_for(P + 1)
    async with EngramClient(srv.address) as client:
        fp = await client.register_model(model_spec_for(worker, name=family, block_tokens=BT, codec="raw"))
        await client.put(fp, toks[:P], stored_tensor(worker, toks[:P]))
        info = await client.open_session(fp, mode="exact", tokens=toks[:P])
        r, global_kv = await client.resume_kv(fp, info.session_id)
        assert r.source == "replay" and r.replayed_tokens > 0
        window = SwaWindow(r.position, r.window_start, tuple((layer[0], layer[1]) for layer in r.window))
        step = decode_next(worker, int(toks[P]), global_kv, window)
        # The uninterrupted run: the worker prefilled P tokens, kept its window, and decodes the next token.
        pre = worker.prefill(torch.as_tensor(toks[:P], dtype=torch.long))
        uninterrupted = decode_next(worker, int(toks[P]), pre.stored_global_kv(P), pre.swa_window(P))
        assert torch.equal(step.logits, uninterrupted.logits)
        stats = await client.stats()
        assert next(m for m in stats.models if m.model_fingerprint == fp).replayable


def test_identity_is_of_the_weights_not_of_how_they_are_run(tmp_path: Path) -> None:
    model = tiny_gemma3(window=6, dtype=torch.float32)
    path = save_checkpoint(model, tmp_path / "a")
    loaded = load_checkpoint(path)
    assert loaded.weights_identity() == model.weights_identity()
    assert loaded.model.config._attn_implementation == "eager"
    sdpa = load_checkpoint(path, attention="sdpa")  # how it runs is not what it is
    assert sdpa.model.config._attn_implementation == "sdpa"
    assert sdpa.weights_identity() == model.weights_identity()
    oss = save_checkpoint(tiny_gpt_oss(window=6, dtype=torch.float32), tmp_path / "oss")
    assert load_checkpoint(oss, attention="sdpa").model.config._attn_implementation == "eager"  # no sdpa: sinks
    assert load_checkpoint(path, dtype=torch.float64).weights_identity() != model.weights_identity()
    other = tiny_gemma3(window=6, dtype=torch.float32, seed=1)  # other weights, same config
    assert other.weights_identity() != model.weights_identity()
    runtime = ReplayRuntime.from_paths([path], device="cpu")
    assert runtime.identities[0].weights_id == model.weights_identity()
    assert runtime.model_for(model_spec_for(model, block_tokens=BT)) is runtime.models[0]
    assert runtime.model_for(model_spec_for(other, block_tokens=BT)) is None


def test_checkpoints_replay_cannot_serve_are_refused_at_load(tmp_path: Path) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    every_layer_slides = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6)
    path = save_checkpoint(_random(MistralForCausalLM, every_layer_slides, torch.float32), tmp_path / "mistral")
    with pytest.raises(ReplayError, match="every layer of this model slides"):
        ReplayRuntime.from_paths([path], device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReplayError, match=r"no config\.json"):
        ReplayRuntime.from_paths([tmp_path / "empty"], device="cpu")
    (tmp_path / "no-shards").mkdir()
    (tmp_path / "no-shards" / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ReplayError, match=r"no \*\.safetensors"):
        ReplayRuntime.from_paths([tmp_path / "no-shards"], device="cpu")
    with pytest.raises(ReplayError, match=r"replay\.dtype"):
        ReplayRuntime.from_paths([path], device="cpu", dtype="int8")
    with pytest.raises(ConfigError, match=r"without config\.json"):
        load_config(env={}, overrides={"replay.models": str(tmp_path / "empty")})
    with pytest.raises(ConfigError, match=r"replay\.dtype"):
        load_config(env={}, overrides={"replay.dtype": "fp64"})


async def test_a_daemon_given_a_model_whose_every_layer_slides_refuses_it_in_its_configs_terms(tmp_path: Path
                                                                                               ) -> None:
    """Mistral v0.1 (sliding_window set, no layer_types) slides in every layer: no global KV to store and replay
    from. replay.models' comment named Mistral; the daemon loaded every shard before it refused it (a 7B model's
    14 GB read for nothing), without saying which config field made it so. It is refused from config.json alone,
    naming sliding_window, before any shard is read (this one's shard is not even a safetensors file)."""
    from transformers import MistralConfig

    from engram.server import start_server

    MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=6).save_pretrained(tmp_path / "mistral")
    (tmp_path / "mistral" / "model.safetensors").write_bytes(b"not read")
    cfg = load_config(env={}, overrides={"server.port": 0, "tiers.dram.capacity": "64MiB",
                                         "tiers.dram.prefault": False, "replay.models": str(tmp_path / "mistral")})
    with pytest.raises(ConfigError, match=r"every layer of this model slides \(its config's sliding_window=6, with "
                                          r"no layer_types, applies to all 2 layers of this mistral model\)"):
        await start_server(cfg)


async def test_a_float64_model_is_stored_raw_only(server_factory) -> None:  # type: ignore[no-untyped-def]
    model = tiny_gpt_oss(window=6, dtype=torch.float64)
    srv = await server_factory()
    async with EngramClient(srv.address) as client:
        with pytest.raises(errors.InvalidArgument, match="float64 layout is stored raw only"):
            await client.register_model(model_spec_for(model, block_tokens=BT, codec="nvfp4"))
        fp = await client.register_model(model_spec_for(model, block_tokens=BT, codec=""))  # defaults to raw
        toks = tokens_for(2 * BT)
        kv = stored_tensor(model, toks)
        await client.put(fp, toks, kv)
        got = await client.get(fp, [b.key for b in (await client.lookup(fp, toks)).blocks])
        assert torch.equal(torch.cat(got, dim=2), kv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200)")
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_daemon_replays_a_checkpoint_in_bf16_on_the_gpu(family: str, server_factory,  # type: ignore[no-untyped-def]
                                                               tmp_path: Path) -> None:
    """As served: bf16 on CUDA (sdpa where the model has it). The replay runs fewer rows through the same
    kernels than the prefill did, so bf16 rounding may differ: the window within 2% of its largest entry, the
    next-token logits within 3% of their largest, the same top-1 token. Measured on the H200 (2026-12-04,
    torch 2.11): 0 and 0 for all five tiny models (bit-identical); the bounds are for shapes whose kernels
    tile by row count, which these do not reach."""
    path = save_checkpoint(FAMILIES[family](torch.float32), tmp_path / family)
    worker = load_checkpoint(path, device="cuda")
    assert worker.replay_spec.dtype == torch.bfloat16
    srv = await server_factory(**{"replay.models": str(path), "replay.device": "cuda"})
    toks = tokens_for(P + 1)
    async with EngramClient(srv.address) as client:
        fp = await client.register_model(model_spec_for(worker, name=family, block_tokens=BT, codec="raw"))
        await client.put(fp, toks[:P], stored_tensor(worker, toks[:P]))
        info = await client.open_session(fp, mode="exact", tokens=toks[:P])
        r, global_kv = await client.resume_kv(fp, info.session_id, device="cuda")
        assert r.source == "replay"
        window = SwaWindow(r.position, r.window_start, tuple((la[0].cuda(), la[1].cuda()) for la in r.window))
        pre = worker.prefill(torch.as_tensor(toks[:P], dtype=torch.long))
        from engram.replay import window_error

        werr = window_error(window, pre.swa_window(P))
        step = decode_next(worker, int(toks[P]), global_kv, window).logits.float()
        ref = decode_next(worker, int(toks[P]), pre.stored_global_kv(P), pre.swa_window(P)).logits.float()
        lerr = float((step - ref).abs().max() / ref.abs().max())
        print(f"{family}: bf16 window error {werr:.2e}, logits error {lerr:.2e}")
        assert werr <= 0.02 and lerr <= 0.03
        assert int(step.argmax()) == int(ref.argmax())
