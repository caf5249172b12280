"""The reference hybrid decoder: config checks, seeded weights, save/load, numerics, sharing, the KV hook."""

from __future__ import annotations

import pytest
import torch

from engram.errors import InvalidArgument
from engram.replay import (
    AttentionKind,
    HybridConfig,
    HybridDecoder,
    Numerics,
    ReplayError,
    ReplayModel,
    ReplayPast,
    all_sliding_pattern,
    gemma3_pattern,
    gpt_oss_pattern,
    load_decoder,
    save_decoder,
)

S, G = AttentionKind.SLIDING, AttentionKind.GLOBAL
SHARED = ("sliding", "global", "sliding", "reindex", "sliding", "reuse")


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _model(layers, **kw) -> HybridDecoder:
    numerics = kw.pop("numerics", Numerics.BATCH_INVARIANT)
    transform = kw.pop("global_kv_transform", None)
    cfg = HybridConfig(tuple(layers), **{"window": 4, "dtype": torch.float64, **kw})
    return HybridDecoder(cfg, device="cpu", numerics=numerics, global_kv_transform=transform)


def test_patterns_match_the_models_they_name() -> None:
    assert gpt_oss_pattern(4) == (S, G, S, G)
    assert gemma3_pattern(12) == (S,) * 5 + (G,) + (S,) * 5 + (G,)
    assert all_sliding_pattern(3) == (S, S, S)


def test_config_normalizes_strings_and_round_trips_json() -> None:
    cfg = HybridConfig(SHARED, window=5, sinks=True, top_k=3, dtype=torch.bfloat16, seed=7)
    assert cfg.layers[3] is AttentionKind.REINDEX
    assert HybridConfig.from_json(cfg.to_json()) == cfg
    spec = cfg.replay_spec()
    assert spec.stored_layers == (1,)  # reindex/reuse layers keep no KV of their own
    assert spec.sliding_layers == (0, 2, 4)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"layers": ("global", "dense")}, "unknown layer kind"),
    ({"layers": ()}, "at least one layer"),
    ({"layers": ("sliding",), "window": 0}, "window must be >= 1"),
    ({"layers": ("global",), "n_heads": 4, "n_kv_heads": 3}, "multiple of n_kv_heads"),
    ({"layers": ("global",), "head_dim": 15}, "even"),
    ({"layers": ("reuse", "global"), "top_k": 2}, "no global layer precedes"),
    ({"layers": ("global",), "top_k": 0}, "top_k"),
    ({"layers": ("global",), "dtype": torch.int32}, "dtype"),
])
def test_bad_config_is_rejected_with_a_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        HybridConfig(**kwargs)
    assert isinstance(info.value, InvalidArgument)  # and the gRPC edge maps it as a malformed request


def test_implements_the_replay_protocol() -> None:
    assert isinstance(_model(gpt_oss_pattern(2)), ReplayModel)


def test_weights_are_a_function_of_the_seed() -> None:
    a, b, c = (_model(gpt_oss_pattern(4), seed=s) for s in (3, 3, 4))
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters(),
                                            strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("proj"):
            assert not torch.equal(pa, pc), name


def test_save_and_load_round_trip(tmp_path) -> None:
    model = _model(gemma3_pattern(6), sinks=True, seed=5)
    path = tmp_path / "m.safetensors"
    save_decoder(model, path)
    again = load_decoder(path, device="cpu")
    assert again.config == model.config
    tokens = _tokens(20)
    assert torch.equal(again.prefill(tokens).logits, model.prefill(tokens).logits)


def test_load_refuses_a_mismatched_config(tmp_path) -> None:
    model = _model(gpt_oss_pattern(4))
    path = tmp_path / "m.safetensors"
    save_decoder(model, path)
    other = HybridConfig(gpt_oss_pattern(4), window=8, dtype=torch.float64)
    with pytest.raises(ValueError, match="not the requested"):
        load_decoder(path, config=other)


def test_load_refuses_a_file_without_config(tmp_path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "bare.safetensors"
    save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="save it with save_decoder"):
        load_decoder(path)


@pytest.mark.parametrize("layers", [gpt_oss_pattern(4), gemma3_pattern(6), SHARED])
@pytest.mark.parametrize("sinks", [False, True])
def test_fast_path_matches_the_reference(layers, sinks: bool) -> None:
    """FAST (BLAS + SDPA) against BATCH_INVARIANT on the same weights and tokens, float64."""
    kw = {"sinks": sinks, "top_k": 3 if layers is SHARED else None}
    ref = _model(layers, **kw).prefill(_tokens(40))
    fast = _model(layers, numerics=Numerics.FAST, **kw).prefill(_tokens(40))
    assert ref.logits is not None and fast.logits is not None
    assert torch.allclose(fast.logits, ref.logits, rtol=0, atol=1e-12)
    for (fk, fv), (rk, rv) in zip(fast.swa_kv, ref.swa_kv, strict=True):
        assert torch.allclose(fk, rk, rtol=0, atol=1e-12) and torch.allclose(fv, rv, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layers", [gpt_oss_pattern(4), gemma3_pattern(6), SHARED, all_sliding_pattern(3)])
def test_batch_invariant_prefix_is_bit_identical(layers) -> None:
    """A position's KV depends only on tokens <= it, bit for bit: a longer prefill repeats a shorter one's rows.
    (With BLAS GEMMs this fails at ~1e-15: MKL's per-row sums depend on the matrix height.)"""
    model = _model(layers, sinks=True, top_k=3 if layers is SHARED else None)
    tokens = _tokens(53)
    short, long = model.prefill(tokens[:37]), model.prefill(tokens)
    for (sk, sv), (lk, lv) in zip(short.swa_kv + short.global_kv, long.swa_kv + long.global_kv, strict=True):
        assert torch.equal(sk, lk[:37]) and torch.equal(sv, lv[:37])
    assert short.logits is not None and long.logits is not None
    assert torch.equal(short.logits, long.logits[:37])


def test_sliding_layer_sees_exactly_w_keys() -> None:
    """Perturbing the token W positions back changes nothing in a one-layer sliding model; W-1 back does."""
    model = _model(("sliding",), window=4)
    tokens = _tokens(12)
    base = model.prefill(tokens).logits
    far, near = tokens.clone(), tokens.clone()
    far[11 - 4] = (far[11 - 4] + 1) % 256
    near[11 - 3] = (near[11 - 3] + 1) % 256
    assert base is not None
    assert torch.equal(model.prefill(far).logits[11], base[11])
    assert not torch.equal(model.prefill(near).logits[11], base[11])


def test_top_k_and_reuse_change_the_computation() -> None:
    """Top-K is really applied, and REUSE really reuses the index (it differs from re-scoring)."""
    tokens = _tokens(30)
    dense = _model(SHARED).prefill(tokens).logits
    sparse = _model(SHARED, top_k=3).prefill(tokens).logits
    reindexed = _model((*SHARED[:-1], "reindex"), top_k=3).prefill(tokens).logits
    assert dense is not None and sparse is not None and reindexed is not None
    assert (dense - sparse).abs().max() > 1e-3
    assert (sparse - reindexed).abs().max() > 1e-6
    assert torch.equal(sparse[:3], dense[:3])  # the first 3 queries have <= 3 keys: top-3 keeps them all


def test_global_kv_transform_is_what_prefill_attends_to() -> None:
    to_bf16 = lambda x: x.to(torch.bfloat16).to(x.dtype)  # noqa: E731 - a lossy, idempotent stored form
    tokens = _tokens(30)
    plain = _model(gpt_oss_pattern(4)).prefill(tokens)
    quant = _model(gpt_oss_pattern(4), global_kv_transform=to_bf16).prefill(tokens)
    for k, v in quant.global_kv:  # returned as stored
        assert torch.equal(k, to_bf16(k)) and torch.equal(v, to_bf16(v))
    # layer 0 (sliding) sees only embeddings; layer 2 sits above a global layer that attended over the stored form
    assert torch.equal(quant.swa_kv[0][0], plain.swa_kv[0][0])
    assert (quant.swa_kv[1][0] - plain.swa_kv[1][0]).abs().max() > 1e-4


def test_global_kv_transform_must_keep_the_shape() -> None:
    model = _model(gpt_oss_pattern(2), global_kv_transform=lambda x: x[:, :1])
    with pytest.raises(ValueError, match="keep the shape"):
        model.prefill(_tokens(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runs_in_lower_precision(dtype: torch.dtype) -> None:
    out = _model(gpt_oss_pattern(4), dtype=dtype, sinks=True).prefill(_tokens(16))
    assert out.logits is not None and out.logits.dtype == dtype and torch.isfinite(out.logits.float()).all()


def test_forward_span_rejects_bad_input() -> None:
    model = _model(gpt_oss_pattern(2))
    empty = torch.empty(0, 2, 16, dtype=torch.float64)
    past = ReplayPast(0, ((empty, empty),), ((empty, empty),))
    with pytest.raises(ValueError, match="token ids must lie"):
        model.forward_span(torch.tensor([1, 256]), past)
    with pytest.raises(ValueError, match="starts needs 3 entries"):
        model.forward_span(_tokens(4), past, starts=[0, 0])
    with pytest.raises(ValueError, match="non-decreasing"):
        model.forward_span(_tokens(4), past, starts=[0, 2, 1])
    with pytest.raises(ValueError, match="global KV for 1 stored layers"):
        model.forward_span(_tokens(4), ReplayPast(0, (), ((empty, empty),)))
    late = ReplayPast(3, ((empty, empty),), ((empty, empty),))
    with pytest.raises(ValueError, match="a global layer would miss keys"):
        model.forward_span(_tokens(4), late)
    with pytest.raises(ReplayError, match="must both be"):
        model.forward_span(_tokens(4), ReplayPast(0, ((empty, empty[:, :1]),), ((empty, empty),)))


def test_the_public_surface_is_pinned_and_every_name_resolves() -> None:
    # engram.replay is the public surface; its modules split by job behind it (model.py: the contract,
    # config.py, numerics.py, decoder.py, weights.py: the reference decoder). A rename shows up here.
    import engram.replay as replay
    import engram.replay.model as contract

    assert sorted(replay.__all__) == sorted([
        "KV", "AttentionKind", "DecodeStep", "HybridConfig", "HybridDecoder", "Numerics", "PrefillResult",
        "Reconstruction", "ReplayError", "ReplayKind", "ReplayMode", "ReplayModel", "ReplayPast", "ReplaySpec",
        "SpanOutput", "SwaWindow", "all_sliding_pattern", "as_layer_kv", "csa_pattern", "decode_next", "exact_bound",
        "gemma3_pattern", "gpt_oss_pattern", "layer_starts", "load_decoder", "reconstruct_swa", "replay_length",
        "save_decoder", "window_error",
    ])
    assert all(hasattr(replay, name) for name in replay.__all__)
    # The contract's types are still where the sessions, the reconstructor and the HF adapter import them.
    for name in ("KV", "AttentionKind", "PrefillResult", "ReplayError", "ReplayModel", "ReplayPast", "ReplaySpec",
                 "SpanOutput", "SwaWindow"):
        assert getattr(contract, name) is getattr(replay, name)
