"""Bounded replay on tiny random-weight Hugging Face models: gpt-oss, Gemma 3, Mistral (sliding_window).

HF runs its linear layers through BLAS, whose per-row results depend on how many rows share the GEMM, so a
replay matches the prefill to rounding (measured <= 4e-16 relative in float64), not bit for bit; the tolerance
is EXACT_TOL. HF computes RoPE angles in float32, so even HF's own incremental decode differs from its own
full forward by ~1e-8 in float64; our decode after a replay is held to HF's incremental decode instead.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import missing

if importlib.util.find_spec("transformers") is None:  # a declared test dependency: fails, unless ENGRAM_TESTS_WITHOUT names it
    missing("transformers", "the HF adapter tests need it (pip install -e '.[dev]')")

from transformers import DynamicCache

from engram.replay import (
    AttentionKind,
    ReplayError,
    ReplayMode,
    decode_next,
    exact_bound,
    reconstruct_swa,
    window_error,
)
from engram.replay.hf import HFReplayModel, cache_kwarg, tiny_gemma3, tiny_gpt_oss, tiny_mistral

EXACT_TOL = 1e-12  # relative to the reference's largest |x|; measured 4e-17..4e-16
P = 40
# Gemma 3 with 7 layers: a sliding layer above the global one, so the replay must read stored global KV
BUILDERS = {"gpt-oss": (tiny_gpt_oss, 4), "gemma3": (tiny_gemma3, 7), "mistral": (tiny_mistral, 3)}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def hf(request) -> tuple[str, HFReplayModel, torch.Tensor, object]:
    build, n_layers = BUILDERS[request.param]
    model = build(n_layers=n_layers, window=4)
    tokens = torch.randint(0, 256, (P + 1,), generator=torch.Generator().manual_seed(3))
    return request.param, model, tokens, model.prefill(tokens[:P])


def test_layer_kinds_come_from_the_config(hf) -> None:
    name, model, _, _ = hf
    kinds = model.replay_spec.kinds
    s, g = AttentionKind.SLIDING, AttentionKind.GLOBAL
    expected = {"gpt-oss": (s, g, s, g), "gemma3": (s,) * 5 + (g, s), "mistral": (s, s, s)}[name]
    assert kinds == expected
    assert model.replay_spec.window == 4 and not model.replay_spec.supports_cone


def test_prefill_through_the_adapter_is_the_models_own_forward(hf) -> None:
    _, model, tokens, pre = hf
    plain = model.model(input_ids=tokens[None, :P]).logits[0]
    assert (pre.logits - plain).abs().max().item() <= 1e-13 * plain.abs().max().item()


def test_exact_replay_rebuilds_the_swa_kv(hf) -> None:
    _, model, tokens, pre = hf
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(P), ReplayMode.exact(), prefix_len=P)
    assert rec.replayed == exact_bound(model.replay_spec)
    assert window_error(rec.window, pre.swa_window(P)) <= EXACT_TOL


def test_one_short_of_the_bound_is_not_exact(hf) -> None:
    _, model, tokens, pre = hf
    short = ReplayMode.fixed(exact_bound(model.replay_spec) - 1)
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(P), short, prefix_len=P)
    ref = pre.swa_window(P)
    assert window_error(rec.window, ref) > 1e6 * EXACT_TOL  # measured 6e-3 .. 0.23
    (last_k, _), (ref_k, _) = rec.window.kv[-1], ref.kv[-1]
    assert (last_k[1:] - ref_k[1:]).abs().max().item() <= EXACT_TOL * ref_k.abs().max().item()  # only row 0 is off


def test_replay_reads_stored_global_kv(hf) -> None:
    """Perturb the stored global KV of the replayed positions: the rebuilt window must change, so the adapter
    really attends over storage rather than over what the layer recomputed."""
    _, model, tokens, pre = hf
    if not model.replay_spec.stored_layers:
        assert model.replay_spec.kinds == (AttentionKind.SLIDING,) * 3  # Mistral: nothing stored to read
        return
    stored = pre.stored_global_kv(P)
    bumped = tuple((k.clone().index_add_(0, torch.tensor([P - 2]), torch.ones_like(k[:1])), v) for k, v in stored)
    a = reconstruct_swa(model, tokens, stored, prefix_len=P)
    b = reconstruct_swa(model, tokens, bumped, prefix_len=P)
    assert window_error(b.window, a.window) > 1e-6


def test_the_replay_hands_its_cache_by_the_name_the_models_forward_takes(hf, monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers before 5.2x (5.17 on the GPU image) names it past_key_values and swallows an unknown `cache`
    # into **kwargs, making a cache of its own: the replay then read nothing back. A forward of that older shape:
    _, model, tokens, pre = hf
    lm = model.model
    new_name, forward = cache_kwarg(lm), lm.forward

    def older(input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, past_key_values: object = None,
              use_cache: bool | None = None, **ignored: object) -> object:
        return forward(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache,
                       **{new_name: past_key_values})

    monkeypatch.setattr(lm, "forward", older)
    assert cache_kwarg(lm) == "past_key_values"
    rec = reconstruct_swa(HFReplayModel(lm), tokens, pre.stored_global_kv(P), ReplayMode.exact(), prefix_len=P)
    assert window_error(rec.window, pre.swa_window(P)) <= EXACT_TOL


def test_decode_after_replay_matches_hf_incremental_decode(hf) -> None:
    _, model, tokens, pre = hf
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(P), prefix_len=P)
    out = decode_next(model, tokens[P], pre.stored_global_kv(P), rec.window)
    with torch.inference_mode():
        cache = DynamicCache(config=model.model.config)  # filled in place by both calls
        kw = cache_kwarg(model.model)  # `cache` from transformers 5.2x, `past_key_values` before
        model.model(input_ids=tokens[None, :P], use_cache=True, **{kw: cache})
        step = model.model(input_ids=tokens[None, P:], use_cache=True, **{kw: cache}).logits[0, -1]
        full = model.model(input_ids=tokens[None]).logits[0, -1]
    scale = step.abs().max().item()
    assert (out.logits - step).abs().max().item() <= EXACT_TOL * scale
    assert (out.logits - full).abs().max().item() <= 1e-6 * scale  # HF's float32 RoPE tables: ~1e-7 relative


def test_approx_error_shrinks_with_k() -> None:
    model = tiny_gemma3(n_layers=6, window=4)  # 5 sliding layers: bound 15; k*W = 4, 8, 12
    tokens = torch.randint(0, 256, (P,), generator=torch.Generator().manual_seed(5))
    pre = model.prefill(tokens)
    errors = [window_error(reconstruct_swa(model, tokens, pre.stored_global_kv(P), ReplayMode.approx(k)).window,
                           pre.swa_window(P)) for k in (1, 2, 3)]
    assert errors[0] > errors[1] > errors[2] > 1e6 * EXACT_TOL, errors


def test_cone_replay_is_refused() -> None:
    model = tiny_mistral(window=4)
    tokens = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1))
    pre = model.prefill(tokens)
    with pytest.raises(ValueError, match="pass cone=False"):
        reconstruct_swa(model, tokens, pre.stored_global_kv(20), cone=True)


def test_token_ids_outside_the_vocabulary_are_refused_before_the_forward() -> None:
    """An id >= vocab_size is a ReplayError (INVALID_ARGUMENT at the daemon), checked on the host: the
    embedding's own IndexError was an INTERNAL on the CPU, and is a device-side assert on a GPU."""
    model = tiny_mistral(window=4)
    vocab = model.model.get_input_embeddings().num_embeddings
    for bad in (vocab, -1):
        tokens = torch.tensor([1, 2, bad, 3])
        with pytest.raises(ReplayError, match=rf"token ids must lie in \[0, {vocab}\)"):
            model.prefill(tokens)


def test_unsupported_layer_types_are_rejected() -> None:
    from engram.replay.hf import replay_spec_from_config

    class _Config:
        num_hidden_layers = 2
        sliding_window = None
        layer_types = ("full_attention", "linear_attention")
        head_dim = 16
        num_key_value_heads = 2

    with pytest.raises(ReplayError, match="linear_attention"):
        replay_spec_from_config(_Config(), torch.float64)
