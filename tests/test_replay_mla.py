"""Bounded replay on the architecture the seed's report describes: MLA global layers that cache one latent per
token (c, k_pe) beside GQA sliding layers, with Full / Reindex / Reuse sharing. tests/test_replay_exact.py runs
its whole suite (exact bound bit for bit in float64, one token short not exact, cone = flat, decode) on MLA
configs too; this file checks what is MLA's own: what is stored, that it is what Engram stores as a "latent"
stream, and that a replay from the latent a real daemon gave back is bit-exact."""

from __future__ import annotations

import pytest
import torch

from engram.client import EngramClient
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec, StreamSpec
from engram.replay import (
    HybridConfig,
    HybridDecoder,
    ReplayError,
    ReplayMode,
    csa_pattern,
    decode_next,
    exact_bound,
    reconstruct_swa,
    window_error,
)
from engram.replay.runtime import implied_layout

MLA = {"attention": "mla", "kv_lora_rank": 24, "rope_dim": 8, "nope_dim": 16, "v_head_dim": 12}


def _model(dtype: torch.dtype = torch.float64, **extra: object) -> HybridDecoder:
    cfg = HybridConfig(csa_pattern(12), window=4, dtype=dtype, top_k=6, **{**MLA, **extra})  # type: ignore[arg-type]
    return HybridDecoder(cfg, device="cpu")


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(5))


def test_an_mla_layer_stores_its_latent_and_nothing_per_head() -> None:
    model = _model()
    pre = model.prefill(_tokens(30))
    spec = model.replay_spec
    assert spec.stored_layers == (1, 7) and len(spec.sliding_layers) == 6  # Full layers; Reindex/Reuse store nothing
    for c, pe in pre.global_kv:
        assert c.shape == (30, 1, 24) and pe.shape == (30, 1, 8)  # 32 numbers a token, whatever n_heads is
    assert all(k.shape == (30, 2, 16) for k, _ in pre.swa_kv)  # the sliding layers stay GQA
    assert exact_bound(spec) == 6 * 3


@pytest.mark.parametrize("p", [9, 40, 57])
def test_exact_bound_from_the_latent_stream_is_bit_exact_in_float64(p: int) -> None:
    model = _model()
    toks = _tokens(p + 3)
    pre = model.prefill(toks[:p])
    latent = torch.stack([torch.cat((c[:, 0], pe[:, 0]), dim=-1) for c, pe in pre.stored_global_kv(p)])  # (L, P, 32)
    rec = reconstruct_swa(model, toks, latent, ReplayMode.exact(), prefix_len=p)
    ref = pre.swa_window(p)
    assert rec.replayed == min(18, p)
    for (k, v), (rk, rv) in zip(rec.window.kv, ref.kv, strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    out = decode_next(model, toks[p], pre.stored_global_kv(p), rec.window)
    full = model.prefill(toks[: p + 1]).logits
    assert full is not None and torch.equal(out.logits, full[p])
    if p > 19:  # one short of the bound, not reaching token 0: the last window's first row is wrong
        short = reconstruct_swa(model, toks, latent, ReplayMode.fixed(17), prefix_len=p)
        assert window_error(short.window, ref) > 1e-9


async def test_replay_from_the_latent_a_daemon_gave_back_is_bit_exact(client: EngramClient) -> None:
    """float32 (a dtype Engram stores), batch-invariant numerics: the worker stores the Full layers' latent as a
    raw stream; a replay from what Get returns rebuilds the prefill's window bit for bit."""
    model = _model(torch.float32)
    p = 50
    toks = _tokens(p)
    pre = model.prefill(toks)
    kinds = {"sliding": LayerKind.SLIDING, "global": LayerKind.GLOBAL, "reindex": LayerKind.REINDEX,
             "reuse": LayerKind.REUSE}
    layers = tuple(LayerSpec(kinds[k.value], 4 if k.value == "sliding" else 0) for k in model.config.layers)
    layout = KVLayout(layers, block_tokens=16, streams=(StreamSpec("latent", (32,), DType.FP32, "raw"),),
                      window_streams=(StreamSpec("k", (2, 16), DType.FP32), StreamSpec("v", (2, 16), DType.FP32)))
    fp = await client.register_model(ModelSpec("tiny-mla-csa", "seed-0", layout, "raw"))
    latent = torch.stack([torch.cat((c[:, 0], pe[:, 0]), dim=-1) for c, pe in pre.global_kv])
    await client.put(fp, toks.numpy().astype("int32"), {"latent": latent})
    n, got = await client.get_prefix(fp, toks.numpy().astype("int32"))
    assert n == p and torch.equal(got["latent"], latent)
    rec = reconstruct_swa(model, toks, got["latent"], prefix_len=p)
    for (k, v), (rk, rv) in zip(rec.window.kv, pre.swa_window(p).kv, strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)


def test_mla_configs_are_checked_and_gqa_identities_do_not_move() -> None:
    with pytest.raises(ReplayError, match="rope_dim \\(even\\)"):
        HybridConfig(csa_pattern(6), **{**MLA, "rope_dim": 7})  # type: ignore[arg-type]
    with pytest.raises(ReplayError, match="attention='mla'"):
        HybridConfig(csa_pattern(6), kv_lora_rank=8)
    gqa = HybridConfig(csa_pattern(6))
    assert "attention" not in gqa.to_json()  # a saved GQA decoder keeps its weights identity
    mla = HybridConfig(csa_pattern(6), **MLA)  # type: ignore[arg-type]
    assert HybridConfig.from_json(mla.to_json()) == mla
    with pytest.raises(ReplayError, match="does not replay MLA models yet"):
        implied_layout(HybridDecoder(mla, device="cpu"))
