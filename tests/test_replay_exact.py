"""Bounded replay on the reference decoder: the exact bound, its tightness, approx and cone replay, decoding.

The reference is always an uninterrupted prefill of the same tokens with the same weights. With the
batch-invariant numerics a position's numbers do not depend on how many rows share a call, so "exact" is
asserted bit for bit (torch.equal). The FAST numerics (BLAS, SDPA) are held to documented tolerances.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from engram.replay import (
    HybridConfig,
    HybridDecoder,
    Numerics,
    ReplayMode,
    ReplayPast,
    ReplaySpec,
    SpanOutput,
    SwaWindow,
    all_sliding_pattern,
    as_layer_kv,
    csa_pattern,
    decode_next,
    exact_bound,
    gemma3_pattern,
    gpt_oss_pattern,
    layer_starts,
    reconstruct_swa,
    replay_length,
    window_error,
)

SHARED = ("sliding", "global", "sliding", "reindex", "sliding", "reuse")
# MLA global layers (one cached latent per token: c of 24 + k_pe of 8) beside GQA sliding layers
MLA = {"attention": "mla", "kv_lora_rank": 24, "rope_dim": 8, "nope_dim": 16, "v_head_dim": 12}

# (name, layers, window, extra config): bounds 9, 30, 12, 9, 9, 9, 9
CONFIGS = [
    ("gpt-oss", gpt_oss_pattern(6), 4, {}),
    ("gemma3", gemma3_pattern(12), 4, {}),
    ("all-sliding", all_sliding_pattern(4), 4, {}),
    ("sinks", gpt_oss_pattern(6), 4, {"sinks": True}),
    ("shared-topk", SHARED, 4, {"top_k": 5, "sinks": True}),
    ("mla", gpt_oss_pattern(6), 4, MLA),
    ("mla-csa-topk", csa_pattern(6), 4, {**MLA, "top_k": 5, "sinks": True}),
]
IDS = [c[0] for c in CONFIGS]

FP32_TOL = 1e-5  # FAST float32: BLAS sums depend on the row count; measured 3e-7..5e-7 relative
BF16_TOL = 3e-2  # FAST bfloat16: a few bf16 ulps (2^-8 = 3.9e-3 relative); measured 4.4e-3
FP64_FAST_TOL = 1e-12  # FAST float64: measured ~6e-16 relative


def _setup(layers, window: int, extra: dict, p: int, *, dtype=torch.float64, numerics=Numerics.BATCH_INVARIANT,
           transform=None, seed: int = 0):
    cfg = HybridConfig(tuple(layers), window=window, dtype=dtype, seed=seed, **extra)
    model = HybridDecoder(cfg, device="cpu", numerics=numerics, global_kv_transform=transform)
    tokens = torch.randint(0, 256, (p + 4,), generator=torch.Generator().manual_seed(seed + 11))
    return model, tokens, model.prefill(tokens[:p])


def _assert_windows_equal(got: SwaWindow, want: SwaWindow) -> None:
    assert (got.start, got.prefix_len) == (want.start, want.prefix_len)
    for i, ((gk, gv), (wk, wv)) in enumerate(zip(got.kv, want.kv, strict=True)):
        assert torch.equal(gk, wk), f"sliding layer {i}: K differs by {(gk - wk).abs().max().item():.3g}"
        assert torch.equal(gv, wv), f"sliding layer {i}: V differs by {(gv - wv).abs().max().item():.3g}"


@pytest.mark.parametrize(("name", "layers", "window", "extra"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("p", [5, 37, 53])
def test_exact_replay_is_bit_exact_in_float64(name, layers, window, extra, p) -> None:
    model, tokens, pre = _setup(layers, window, extra, p)
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(p), ReplayMode.exact(), prefix_len=p)
    spec = model.replay_spec
    assert rec.replayed == min(exact_bound(spec), p)
    assert rec.window.start == max(0, p - window + 1)
    _assert_windows_equal(rec.window, pre.swa_window(p))


def test_bit_exact_in_float32_and_bfloat16_with_batch_invariant_numerics() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        model, tokens, pre = _setup(gpt_oss_pattern(6), 4, {"sinks": True}, 41, dtype=dtype)
        rec = reconstruct_swa(model, tokens, pre.stored_global_kv(41), prefix_len=41)
        _assert_windows_equal(rec.window, pre.swa_window(41))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, FP64_FAST_TOL), (torch.float32, FP32_TOL),
                                            (torch.bfloat16, BF16_TOL)])
@pytest.mark.parametrize(("name", "layers", "window", "extra"), CONFIGS[:2] + CONFIGS[3:4], ids=IDS[:2] + IDS[3:4])
def test_exact_replay_with_fast_numerics_is_within_tolerance(name, layers, window, extra, dtype, tol) -> None:
    model, tokens, pre = _setup(layers, window, extra, 45, dtype=dtype, numerics=Numerics.FAST)
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(45), prefix_len=45)
    assert window_error(rec.window, pre.swa_window(45)) <= tol


@pytest.mark.parametrize(("name", "layers", "window", "extra"), CONFIGS, ids=IDS)
def test_one_token_short_of_the_bound_is_not_exact(name, layers, window, extra) -> None:
    """Theory: with R = L_swa*(W-1) - 1, sliding layer j (1-based) is exact from P-R+(j-1)(W-1) on, so the
    last one misses exactly one row, its first, P-W+1; every other row and layer stays bit-exact."""
    p = 40
    model, tokens, pre = _setup(layers, window, extra, p)
    short = exact_bound(model.replay_spec) - 1
    assert p > short + 1  # the replay does not reach token 0, where it would be exact again
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(p), ReplayMode.fixed(short), prefix_len=p)
    ref = pre.swa_window(p)
    *lower, (last_k, last_v) = rec.window.kv
    *ref_lower, (ref_k, ref_v) = ref.kv
    for (k, v), (rk, rv) in zip(lower, ref_lower, strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    assert torch.equal(last_k[1:], ref_k[1:]) and torch.equal(last_v[1:], ref_v[1:])
    scale = ref_k.abs().max().item()
    assert (last_k[0] - ref_k[0]).abs().max().item() > 1e-9 * scale  # far above any float64 tolerance
    assert (last_v[0] - ref_v[0]).abs().max().item() > 1e-9 * ref_v.abs().max().item()
    assert window_error(rec.window, ref) > 1e3 * FP64_FAST_TOL


def test_short_replay_of_a_short_prefix_is_exact() -> None:
    """Below the bound a replay that reaches token 0 replays everything and is exact."""
    model, tokens, pre = _setup(gemma3_pattern(12), 4, {}, 20)  # bound 30 > 20
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(20), ReplayMode.fixed(exact_bound(model.replay_spec) - 1),
                          prefix_len=20)
    assert rec.replayed == 20
    _assert_windows_equal(rec.window, pre.swa_window(20))


def test_approx_error_shrinks_as_k_grows() -> None:
    """10 sliding layers, W=8: bound 70; k*W = 8..64 stays below it. Measured (seed 0): 1.2, 0.37, 0.018, 6e-8."""
    model, tokens, pre = _setup(gemma3_pattern(12), 8, {}, 100)
    ref = pre.swa_window(100)
    errors = [window_error(reconstruct_swa(model, tokens, pre.stored_global_kv(100), ReplayMode.approx(k),
                                           prefix_len=100).window,
                           ref) for k in (1, 2, 4, 8)]
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 1e-4 * errors[0] and errors[-1] > 0, errors
    # past the bound approx is exact, and costs no more than exact mode
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(100), ReplayMode.approx(9), prefix_len=100)
    assert rec.replayed == 70
    _assert_windows_equal(rec.window, ref)


def test_recomputing_global_kv_inside_the_replay_is_not_exact() -> None:
    """Why the replay must read the stored global KV of the replayed positions too: a replay that recomputes
    them (stored KV only before the replay) stays wrong even at the exact bound (measured 5-15%)."""
    model, tokens, pre = _setup(gemma3_pattern(12), 8, {}, 100)
    p, r = 100, exact_bound(model.replay_spec)
    spec = model.replay_spec
    early = tuple((k[: p - r], v[: p - r]) for k, v in pre.global_kv)
    empty = torch.empty(0, spec.n_kv_heads, spec.head_dim, dtype=spec.dtype)
    out = model.forward_span(tokens[p - r : p], ReplayPast(p - r, early, tuple((empty, empty) for _ in
                                                                             spec.sliding_layers)), logits=False)
    w0 = p - 8 + 1
    window = SwaWindow(p, w0, tuple((k[w0 - (p - r):], v[w0 - (p - r):]) for k, v in out.swa_kv))
    assert window_error(window, pre.swa_window(p)) > 1e-2


@pytest.mark.parametrize(("name", "layers", "window", "extra"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("mode", [ReplayMode.exact(), ReplayMode.approx(1), ReplayMode.approx(2)],
                         ids=["exact", "k1", "k2"])
def test_cone_replay_equals_flat_with_fewer_token_layers(name, layers, window, extra, mode) -> None:
    model, tokens, pre = _setup(layers, window, extra, 50)
    flat = reconstruct_swa(model, tokens, pre.stored_global_kv(50), mode, prefix_len=50, cone=False)
    cone = reconstruct_swa(model, tokens, pre.stored_global_kv(50), mode, prefix_len=50, cone=True)
    _assert_windows_equal(cone.window, flat.window)
    assert flat.token_layers == flat.flat_token_layers == len(layers) * flat.replayed
    assert cone.token_layers < flat.token_layers


def test_cone_cost_matches_the_formula() -> None:
    """Gemma-3-like 12 layers: the rows entering layer l, in units of W-1, are 10,9,8,7,6,5,5,4,3,2,1,0 from the
    bottom: 60 of the flat 120, half the work (the brief's "about half")."""
    model, tokens, pre = _setup(gemma3_pattern(12), 4, {}, 50)
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(50), prefix_len=50)
    assert rec.token_layers == 60 * 3 and rec.flat_token_layers == 120 * 3
    assert rec.starts == tuple(50 - 3 * n for n in (10, 9, 8, 7, 6, 5, 5, 4, 3, 2, 1, 0, 0))


@pytest.mark.parametrize(("name", "layers", "window", "extra"), CONFIGS, ids=IDS)
def test_decode_after_reconstruction_matches_an_uninterrupted_prefill(name, layers, window, extra) -> None:
    p = 37
    model, tokens, pre = _setup(layers, window, extra, p)
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(p), prefix_len=p)
    stored, window_kv = pre.stored_global_kv(p), rec.window
    for step in range(3):  # keep decoding: each step's logits equal the prefill of one more token
        out = decode_next(model, tokens[p + step], stored, window_kv)
        full = model.prefill(tokens[: p + step + 1])
        assert full.logits is not None
        assert torch.equal(out.logits, full.logits[p + step])
        _assert_windows_equal(out.window, full.swa_window(p + step + 1))
        stored = tuple((torch.cat((k, nk)), torch.cat((v, nv))) for (k, v), (nk, nv) in
                       zip(stored, out.global_kv, strict=True))
        window_kv = out.window


def test_decode_with_fast_numerics_is_within_tolerance() -> None:
    model, tokens, pre = _setup(gpt_oss_pattern(6), 4, {"sinks": True}, 37, numerics=Numerics.FAST)
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(37), prefix_len=37)
    out = decode_next(model, tokens[37], pre.stored_global_kv(37), rec.window)
    full = model.prefill(tokens[:38]).logits
    assert full is not None
    assert (out.logits - full[37]).abs().max().item() <= FP64_FAST_TOL * full.abs().max().item()


def test_lossy_global_kv_transform_still_replays_exactly() -> None:
    """The worker attends over the stored (here bf16-rounded) global KV, so the replay that reads it back
    rebuilds the SWA KV bit for bit; without the hook in the prefill the replay could not match."""
    to_bf16 = lambda x: x.to(torch.bfloat16).to(x.dtype)  # noqa: E731
    p = 41
    model, tokens, pre = _setup(gemma3_pattern(12), 4, {}, p, transform=to_bf16)
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(p), prefix_len=p)
    _assert_windows_equal(rec.window, pre.swa_window(p))
    out = decode_next(model, tokens[p], pre.stored_global_kv(p), rec.window)
    full = model.prefill(tokens[: p + 1])
    assert full.logits is not None and torch.equal(out.logits, full.logits[p])
    assert all(torch.equal(k, to_bf16(k)) for k, _ in out.global_kv)  # the new row is in the stored form too
    _, _, plain = _setup(gemma3_pattern(12), 4, {}, p)  # same weights, prefill over unrounded global KV
    assert window_error(rec.window, plain.swa_window(p)) > 1e-4


def test_block_layout_tensor_is_accepted() -> None:
    model, tokens, pre = _setup(gpt_oss_pattern(6), 4, {}, 30)
    block = torch.stack([torch.stack((k, v)) for k, v in pre.global_kv])  # (layers, 2, T, n_kv, d_h)
    rec = reconstruct_swa(model, tokens, block, prefix_len=30)
    _assert_windows_equal(rec.window, pre.swa_window(30))


def test_replay_length_per_mode() -> None:
    spec = ReplaySpec(gemma3_pattern(12), 8, 2, 16, torch.float32)
    assert exact_bound(spec) == 70
    assert replay_length(spec, ReplayMode.exact(), 1000) == 70
    assert replay_length(spec, ReplayMode.exact(), 33) == 33  # clamped to the prefix
    assert replay_length(spec, ReplayMode.approx(1), 1000) == 8
    assert replay_length(spec, ReplayMode.approx(2.5), 1000) == 20
    assert replay_length(spec, ReplayMode.approx(100), 1000) == 70  # never past the exact bound
    assert replay_length(spec, ReplayMode.fixed(69), 1000) == 69
    assert layer_starts(spec, 100, 8, cone=False) == (92,) * 13


def test_window_of_one_needs_no_replay() -> None:
    model, tokens, pre = _setup(gpt_oss_pattern(4), 1, {}, 10)
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(10), prefix_len=10)
    assert rec.replayed == 0 and all(k.shape[0] == 0 for k, _ in rec.window.kv)
    out = decode_next(model, tokens[10], pre.stored_global_kv(10), rec.window)
    full = model.prefill(tokens[:11]).logits
    assert full is not None and torch.equal(out.logits, full[10])


def test_a_model_without_sliding_layers_has_its_empty_window_at_p_in_prefill_replay_and_decode() -> None:
    """No sliding layer: no window whatever W the config names, so it starts at P (0 rows), as the daemon's
    Resume answers. The prefill's reference window started at P-W+1, so no replay or Resume ever equalled it, and
    a decode step from the window at P put the next one at P, not P + 1."""
    p = 10
    model, tokens, pre = _setup(("global",) * 3, 4, {}, p)
    assert pre.swa_window(p).start == p
    rec = reconstruct_swa(model, tokens, pre.stored_global_kv(p), prefix_len=p)
    _assert_windows_equal(rec.window, pre.swa_window(p))
    stored, window_kv = pre.stored_global_kv(p), rec.window
    for step in range(3):
        out = decode_next(model, tokens[p + step], stored, window_kv)
        full = model.prefill(tokens[: p + step + 1])
        assert full.logits is not None and torch.equal(out.logits, full.logits[p + step])
        _assert_windows_equal(out.window, full.swa_window(p + step + 1))
        assert out.window.start == p + step + 1
        stored = tuple((torch.cat((k, nk)), torch.cat((v, nv))) for (k, v), (nk, nv) in
                       zip(stored, out.global_kv, strict=True))
        window_kv = out.window


def test_decode_next_takes_a_window_of_a_model_without_sliding_layers_only_where_it_starts_at_p() -> None:
    """The start of a window with no layer is checked by the same rule as any other: at P. Unchecked, a window
    at P-W+1 (a prefill's before c0776cf, a worker's from W alone) was taken, and one past P too, whose next
    step's window then started past its own end (a window of negative rows)."""
    p = 10
    model, tokens, pre = _setup(("global",) * 3, 4, {}, p)
    stored = pre.stored_global_kv(p)
    for start in (p - 4 + 1, 0, p + 1, p + 5):
        with pytest.raises(ValueError, match=rf"starts at {p} \(no sliding layer, or W = 1: it holds no row\); "
                                             rf"not at {start}"):
            decode_next(model, tokens[p], stored, SwaWindow(p, start, ()))
    out = decode_next(model, tokens[p], stored, SwaWindow(p, p, ()))
    assert out.window == SwaWindow(p + 1, p + 1, ())
    sliding, _, sliding_pre = _setup(gpt_oss_pattern(4), 4, {}, p)  # the same words for a window past P
    with pytest.raises(ValueError, match=rf"starts at {p - 3} \(W=4\), or up to {p}"):
        decode_next(sliding, tokens[p], sliding_pre.stored_global_kv(p),
                    SwaWindow(p, p + 1, tuple((k[:0], v[:0]) for k, v in sliding_pre.swa_kv)))


class _FlatOnly:
    """A test double: any object with replay_spec and forward_span is a ReplayModel (no base class)."""

    def __init__(self, model: HybridDecoder) -> None:
        self.inner = model
        spec = model.replay_spec
        self.replay_spec = ReplaySpec(spec.kinds, spec.window, spec.n_kv_heads, spec.head_dim, spec.dtype,
                                      supports_cone=False)

    def forward_span(self, tokens, past, *, starts=None, logits=True) -> SpanOutput:
        assert starts is None or len(set(starts)) == 1
        return self.inner.forward_span(tokens, past, starts=starts, logits=logits)


def test_models_without_cone_support_replay_flat() -> None:
    model, tokens, pre = _setup(gpt_oss_pattern(6), 4, {}, 30)
    flat_only = _FlatOnly(model)
    rec = reconstruct_swa(flat_only, tokens, pre.stored_global_kv(30), prefix_len=30)  # cone=None: flat for this model
    _assert_windows_equal(rec.window, pre.swa_window(30))
    with pytest.raises(ValueError, match="pass cone=False"):
        reconstruct_swa(flat_only, tokens, pre.stored_global_kv(30), prefix_len=30, cone=True)


def test_bad_input_is_rejected_with_a_fix() -> None:
    model, tokens, pre = _setup(gpt_oss_pattern(6), 4, {}, 30)
    kv = pre.stored_global_kv(30)
    with pytest.raises(ValueError, match="past the end of the 34 tokens"):
        reconstruct_swa(model, tokens, kv, prefix_len=35)
    with pytest.raises(ValueError, match=">= 1 token"):
        reconstruct_swa(model, tokens, kv, prefix_len=0)
    with pytest.raises(ValueError, match=">= 1 token"):
        reconstruct_swa(model, tokens, kv, prefix_len=-3)
    with pytest.raises(ValueError, match="1-D"):
        reconstruct_swa(model, tokens[None], kv, prefix_len=30)
    with pytest.raises(ValueError, match="stores 3 global layers"):
        reconstruct_swa(model, tokens, kv[:2], prefix_len=30)
    with pytest.raises(ValueError, match="head_dim=16"):
        reconstruct_swa(model, tokens, [(k[..., :8], v[..., :8]) for k, v in kv], prefix_len=30)
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        reconstruct_swa(model, tokens, [(k[:, :1], v[:, :1]) for k, v in kv], prefix_len=30)
    with pytest.raises(ValueError, match=r"need \(>= 30"):
        reconstruct_swa(model, tokens, [(k[:29], v[:29]) for k, v in kv], prefix_len=30)
    with pytest.raises(ValueError, match="V has shape"):
        reconstruct_swa(model, tokens, [(k, v[:, :, :8]) for k, v in kv], prefix_len=30)
    with pytest.raises(ValueError, match="one tensor must be"):
        reconstruct_swa(model, tokens, torch.zeros(3, 3, 30, 2, 16), prefix_len=30)
    with pytest.raises(ValueError, match="k > 0"):
        ReplayMode.approx(0)
    with pytest.raises(ValueError, match="tokens >= 0"):
        ReplayMode.fixed(-1)


def test_mismatched_config_is_rejected() -> None:
    """Stored KV or a window made by a differently shaped model does not silently replay."""
    model, tokens, pre = _setup(gpt_oss_pattern(6), 4, {}, 30)
    other, _, other_pre = _setup(gemma3_pattern(6), 4, {}, 30)  # one global layer instead of three
    with pytest.raises(ValueError, match="stores 1 global layers"):
        reconstruct_swa(other, tokens, pre.stored_global_kv(30), prefix_len=30)
    with pytest.raises(ValueError, match="window holds 5 sliding layers"):
        decode_next(model, tokens[30], pre.stored_global_kv(30), other_pre.swa_window(30))
    wide, _, wide_pre = _setup(gpt_oss_pattern(6), 8, {}, 30)  # W = 8: a window of 7 rows
    with pytest.raises(ValueError, match=r"starts at 27 \(W=4\), or up to 30 after a shorter replay; not at 23"):
        decode_next(model, tokens[30], pre.stored_global_kv(30), wide_pre.swa_window(30))
    longer = model.prefill(tokens[:31])
    with pytest.raises(ValueError, match=r"need \(30, n_kv_heads"):  # stored KV one token ahead of the window
        decode_next(model, tokens[30], longer.global_kv, pre.swa_window(30))
    assert as_layer_kv(longer.global_kv, model.replay_spec, 30)[0][0].shape[0] == 30  # a replay may ignore extra rows
    with pytest.raises(ValueError, match="windows cover different positions"):
        window_error(pre.swa_window(30), wide_pre.swa_window(30))
