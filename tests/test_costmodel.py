"""The replay cost model (engram/replay/costmodel.py): fits recover what made the points, the choice is the
fastest option the budget and the fidelity floor allow, and calibrations are stored per weights and machine."""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.api import SessionMode
from engram.replay.costmodel import (
    EXACT,
    UNKNOWN,
    Calibration,
    Choice,
    CostModel,
    Fidelity,
    FidelityFloor,
    NoAllowedOption,
    calibration_path,
    machine_id,
    report,
)

W = 128
SLIDING = 8
LAYERS = 16
BOUND = SLIDING * (W - 1)  # 1016
WINDOW_BYTES = 2_080_768  # ~1.98 MiB, as the H200 run's window


def cone_tl(r: int) -> int:
    """Rows through layers of a cone replay of R tokens on alternating layers (the measured shape, made up)."""
    return LAYERS * r // 2


def calib(*, a: float = 0.010, b: float = 2e-7, c: float = 0.0, contexts: tuple[int, ...] = (4096, 16384),
          rs: tuple[int, ...] = (W, 2 * W, 4 * W, BOUND), lat: float = 5e-6, bw: float = 40e9,
          fidelity: tuple[tuple[int, float, float], ...] = ((W, 0.90, 0.08), (2 * W, 0.97, 0.02),
                                                            (4 * W, 0.995, 0.002)),
          window_bytes: int = WINDOW_BYTES, token_layers: bool = True) -> dict[str, Any]:
    """A calibration JSON whose replay and load times follow known linear laws exactly."""
    def label(r: int) -> str:
        return "exact" if r == BOUND else ("W" if r == W else f"{r // W}W")

    replay = []
    for p in contexts:
        for r in rs:
            tl = cone_tl(r)
            point = {"context": p, "replayed": r, "label": label(r), "seconds": a + b * tl + c * tl * p}
            if token_layers:
                point["token_layers"] = tl
            replay.append(point)
    return {
        "schema": "engram.replay_cost/1",
        "model": {"name": "hybrid-16", "source": "named", "weights_id": "hybrid-16@seed0", "layers": LAYERS,
                  "sliding_layers": SLIDING, "global_layers": LAYERS - SLIDING, "window": W, "n_kv_heads": 4,
                  "head_dim": 128, "dtype": "bfloat16"},
        "machine": {"id": "host-a/NVIDIA H200", "device": "cuda", "device_name": "NVIDIA H200", "torch": "2.11"},
        "date": "2026-12-03",
        "replay": replay,
        "load": [{"tier": t, "bytes": n, "seconds": lat * m + n / (bw / m)}
                 for m, t in ((1, "hbm"), (2, "dram"), (50, "nvme")) for n in (1 << 16, 1 << 20, 1 << 24)],
        "fidelity": [{"replayed": r, "label": label(r), "kv_rel_error": kl / 2, "kl": kl, "top1": top1}
                     for r, top1, kl in fidelity] + [{"replayed": BOUND, "label": "exact", "kv_rel_error": 0.017,
                                                      "kl": 1e-4, "top1": 0.999}],
        "persisted": [{"context": p, "global_bytes": p * 8 * 2048, "window_bytes": window_bytes} for p in contexts],
    }


def model(data: dict[str, Any] | None = None) -> CostModel:
    return CostModel(Calibration.from_json(data if data is not None else calib()))


def rel(x: float, y: float) -> float:
    return abs(x - y) / max(abs(y), 1e-300)


# ---- fits ----------------------------------------------------------------------------------------------


def test_replay_fit_recovers_known_parameters() -> None:
    for a, b, c in ((0.010, 2e-7, 0.0), (0.0123, 3.3e-7, 4.5e-12), (0.0, 1e-6, 1e-11)):
        fit = Calibration.from_json(calib(a=a, b=b, c=c)).replay_fit
        assert fit is not None
        assert rel(fit.per_token_layer, b) < 1e-6
        assert rel(fit.per_token_layer_context, c) < 1e-6 or (c == 0 and fit.per_token_layer_context < 1e-18)
        assert rel(fit.intercept, a) < 1e-6 or (a == 0 and fit.intercept < 1e-12)


def test_one_context_fits_no_context_slope() -> None:
    fit = Calibration.from_json(calib(contexts=(8192,))).replay_fit
    assert fit is not None and fit.per_token_layer_context == 0.0
    assert rel(fit.per_token_layer, 2e-7) < 1e-6 and rel(fit.intercept, 0.010) < 1e-6


def test_load_fit_recovers_latency_and_bandwidth() -> None:
    cal = Calibration.from_json(calib(lat=7e-6, bw=25e9))
    fits = dict(cal.load_fits)
    for m, tier in ((1, "hbm"), (2, "dram"), (50, "nvme")):
        assert rel(fits[tier].intercept, 7e-6 * m) < 1e-6
        assert rel(1 / fits[tier].slope, 25e9 / m) < 1e-6
    assert rel(CostModel(cal).predict_load("dram", 3 << 20), 14e-6 + (3 << 20) / 12.5e9) < 1e-6
    with pytest.raises(ValueError, match="tier 'tape'"):
        CostModel(cal).predict_load("tape", 1)


def test_fits_are_non_negative() -> None:
    """Noise that would make a plain least-squares intercept negative pins it at 0 instead."""
    data = calib(lat=0.0)
    for q in data["load"]:
        q["seconds"] *= 0.9 if q["bytes"] == 1 << 16 else 1.0
    for _, f in Calibration.from_json(data).load_fits:
        assert f.intercept >= 0 and f.slope > 0


def test_predict_replay_interpolates_token_layers_and_clamps() -> None:
    cm = model(calib(c=1e-12))
    fit = cm.calibration.replay_fit
    assert fit is not None
    for p, r in ((4096, W), (16384, BOUND), (4096, 3 * W)):  # measured, measured, interpolated (cone_tl is linear)
        assert rel(cm.predict_replay(p, r), 0.010 + 2e-7 * cone_tl(r) + 1e-12 * cone_tl(r) * p) < 1e-9
    assert cm.token_layers(5000, 3 * W) == cone_tl(3 * W)  # nearest context 4096
    assert cm.predict_replay(4096, 10 * BOUND) == cm.predict_replay(4096, BOUND)  # past the bound: no change
    assert cm.predict_replay(100, BOUND) == cm.predict_replay(100, 100)  # a replay cannot start before token 0
    assert cm.predict_replay(4096, 0) == 0.0
    assert cm.predict_replay(65536, BOUND) > cm.predict_replay(16384, BOUND)  # the global layers' P-slope


def test_per_r_fit_when_token_layers_are_missing() -> None:
    cm = model(calib(token_layers=False, c=1e-12))
    assert cm.calibration.replay_fit is None
    for p in (4096, 16384):
        for r in (W, BOUND):
            assert rel(cm.predict_replay(p, r), 0.010 + 2e-7 * cone_tl(r) + 1e-12 * cone_tl(r) * p) < 1e-6
    mid = cm.predict_replay(4096, 3 * W)
    assert cm.predict_replay(4096, 2 * W) < mid < cm.predict_replay(4096, 4 * W)
    assert cm.predict_replay(4096, W // 2) == cm.predict_replay(4096, W)  # below the least: its time


def test_fidelity_interpolation_is_conservative() -> None:
    cm = model()
    assert cm.fidelity(W) == Fidelity(0.90, 0.08, 0.04)
    assert cm.fidelity(W + 1) == cm.fidelity(2 * W - 1) == Fidelity(0.90, 0.08, 0.04)  # the worse neighbour
    assert cm.fidelity(4 * W + 1) == cm.fidelity(4 * W)  # between the last measured and exact
    assert cm.fidelity(BOUND) == EXACT  # the measured 0.999 of bf16 rounding does not count against exact
    assert cm.fidelity(W - 1) == UNKNOWN
    assert cm.fidelity(W, context=W) == EXACT  # the replay started at token 0: a prefill
    assert cm.approx_ks() == [1.0, 2.0, 4.0]


# ---- the choice ----------------------------------------------------------------------------------------


def test_replay_when_storage_is_scarce() -> None:
    cm = model()
    for budget in (0, WINDOW_BYTES - 1):
        ch = cm.choose(16384, budget_bytes=budget)
        assert isinstance(ch, Choice) and ch.mode in (SessionMode.EXACT, SessionMode.APPROX)
        assert "persist refused" in ch.reason
    # with no floor the cheapest replay wins; a floor on top-1 forces a longer one, and exact is always allowed
    assert cm.choose(16384, budget_bytes=0).approx_k == 1.0
    ch = cm.choose(16384, budget_bytes=0, floor=FidelityFloor(min_top1=0.95))
    assert (ch.mode, ch.approx_k) == ("approx", 2.0)
    ch = cm.choose(16384, budget_bytes=0, floor=FidelityFloor(min_top1=0.9999))
    assert (ch.mode, ch.approx_k) == ("exact", 0.0)
    assert rel(ch.predicted_s, cm.predict_replay(16384, BOUND)) < 1e-12


def test_persist_when_storage_is_plentiful() -> None:
    cm = model()
    ch = cm.choose(16384, budget_bytes=1 << 30, floor=FidelityFloor(max_kl=0.0))
    assert ch.mode == "persist" and ch.mode is SessionMode.PERSIST and ch.approx_k == 0.0
    assert rel(ch.predicted_s, cm.predict_load("dram", WINDOW_BYTES)) < 1e-12
    assert ch.predicted_s < cm.predict_replay(16384, W) / 10
    nvme = cm.choose(16384, budget_bytes=1 << 30, tier="nvme")
    assert nvme.predicted_s > ch.predicted_s


def test_replay_wins_when_it_is_faster_than_the_load() -> None:
    cm = model(calib(lat=0.5))  # a very slow store: replay beats it
    assert cm.choose(16384, budget_bytes=1 << 30, floor=FidelityFloor(min_top1=1.0)).mode == "exact"


def test_window_bytes_without_persisted_points_come_from_the_model_shape() -> None:
    data = calib()
    data["persisted"] = []
    cm = model(data)
    assert cm.window_bytes(16384) == SLIDING * 2 * (W - 1) * 4 * 128 * 2  # bf16
    assert cm.window_bytes(10) == SLIDING * 2 * 10 * 4 * 128 * 2
    assert cm.choose(16384, budget_bytes=1 << 30).mode == "persist"
    data["model"]["dtype"] = "fp4-e2m1"
    ch = model(data).choose(16384, budget_bytes=1 << 30)
    assert ch.mode != "persist" and "window size unknown" in ch.reason


def test_nothing_allowed_says_why() -> None:
    cm = model()
    with pytest.raises(NoAllowedOption, match=r"persist: its window needs 2080768 B, 0 B .*exact: no replay model"):
        cm.choose(16384, budget_bytes=0, can_replay=False)
    data = calib()
    data["replay"] = []
    with pytest.raises(NoAllowedOption, match="no replay measurements"):
        model(data).choose(16384, budget_bytes=-5)
    assert model(data).choose(16384, budget_bytes=1 << 30).mode == "persist"


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[dict[str, Any], int, int, FidelityFloor, str]:
    rs = sorted(draw(st.sets(st.integers(1, BOUND - 1), min_size=1, max_size=5)))
    fid = []
    for r in rs:
        fid.append((r, draw(st.floats(0, 1)), draw(st.floats(0, 5))))
    data = calib(a=draw(st.floats(0, 0.05)), b=draw(st.floats(0, 1e-5)), c=draw(st.floats(0, 1e-10)),
                 rs=(*rs, BOUND), lat=draw(st.floats(0, 0.01)), bw=draw(st.floats(1e6, 1e12)), fidelity=tuple(fid),
                 window_bytes=draw(st.integers(0, 1 << 24)))
    for f in data["fidelity"]:  # labels that are not multiples of W: k = R / W
        if f["label"] != "exact":
            f["label"] = f"{f['replayed'] / W!r}W"
    floor = FidelityFloor(min_top1=draw(st.none() | st.floats(0, 1)), max_kl=draw(st.none() | st.floats(0, 5)),
                          max_kv_rel_error=draw(st.none() | st.floats(0, 3)))
    return (data, draw(st.integers(1, 1 << 17)), draw(st.integers(-10, 1 << 25)), floor,
            draw(st.sampled_from(["hbm", "dram", "nvme"])))


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_choice_never_below_floor_and_nothing_allowed_is_faster(
        s: tuple[dict[str, Any], int, int, FidelityFloor, str]) -> None:
    data, context, budget, floor, tier = s
    cm = model(data)
    ch = cm.choose(context, budget_bytes=budget, floor=floor, tier=tier)  # exact replay is always there
    opts = cm.options(context, budget_bytes=budget, floor=floor, tier=tier)
    allowed = [o for o in opts if o.allowed]
    picked = next(o for o in allowed if o.mode == ch.mode and o.approx_k == ch.approx_k)
    assert floor.allows(picked.fidelity)
    if ch.mode == "approx":
        assert floor.allows(cm.fidelity(math.ceil(ch.approx_k * W), context))
    if ch.mode == "persist":
        assert cm.window_bytes(context) <= budget
    assert all(o.predicted_s >= ch.predicted_s for o in allowed)
    assert ch.predicted_s >= 0 and math.isfinite(ch.predicted_s)
    for o in opts:  # and every refusal is a real one
        if not o.allowed:
            assert (o.mode == "persist" and cm.window_bytes(context) > budget) or not floor.allows(o.fidelity)


# ---- storage -------------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path: Any) -> None:
    cal = Calibration.from_json(calib(token_layers=False))
    path = cal.save(tmp_path / "cal")
    assert path == calibration_path(tmp_path / "cal", "hybrid-16@seed0", "host-a/NVIDIA H200")
    assert "/" not in path.name[len("replay_cost."):] and " " not in path.name
    back = Calibration.load(tmp_path / "cal", "hybrid-16@seed0", "host-a/NVIDIA H200")
    assert back == cal and back is not None and back.replay_fit_by_r == cal.replay_fit_by_r
    assert json.loads(path.read_text())["schema"] == "engram.replay_cost/1"
    assert Calibration.load(tmp_path / "cal", "hybrid-16@seed0", "host-b/cpu") is None
    assert Calibration.load(tmp_path / "nowhere", "hybrid-16@seed0", "host-a/NVIDIA H200") is None
    # ids that sanitize alike do not share a file
    assert calibration_path(tmp_path, "a/b", "m") != calibration_path(tmp_path, "a_b", "m")


def test_machine_id_names_host_and_device() -> None:
    host, _, device = machine_id().partition("/")
    assert host and device


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d.pop("schema"), "'schema'"),
    (lambda d: d["model"].pop("window"), "'model.window' is missing"),
    (lambda d: d["replay"][2].update(seconds="fast"), "'replay[2].seconds'"),
    (lambda d: d["load"][0].update(tier="tape"), "'load[0].tier'"),
    (lambda d: d["fidelity"][1].update(top1=1.5), "'fidelity[1].top1'"),
    (lambda d: d["fidelity"][0].update(kl=float("inf")), "'fidelity[0].kl'"),
    (lambda d: d["persisted"][0].update(window_bytes=-1), "'persisted[0].window_bytes'"),
    (lambda d: d.update(machine=[]), "'machine' must be an object"),
])
def test_malformed_file_names_file_and_field(tmp_path: Any, edit: Any, field: str) -> None:
    cal = Calibration.from_json(calib())
    path = cal.save(tmp_path)
    data = copy.deepcopy(cal.to_json())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + re.escape(field)):
        Calibration.load(tmp_path, "hybrid-16@seed0", "host-a/NVIDIA H200")


def test_not_json_and_wrong_owner(tmp_path: Any) -> None:
    cal = Calibration.from_json(calib())
    path = cal.save(tmp_path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON calibration"):
        Calibration.load(tmp_path, "hybrid-16@seed0", "host-a/NVIDIA H200")
    other = calib()
    other["model"]["weights_id"] = "other"
    path.write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"'model\.weights_id' is 'other'"):
        Calibration.load(tmp_path, "hybrid-16@seed0", "host-a/NVIDIA H200")


# ---- prediction report ---------------------------------------------------------------------------------


def test_report_against_own_and_another_run(tmp_path: Any) -> None:
    cal = Calibration.from_json(calib(c=1e-12))
    own = report(cal, cal.to_json())
    assert len(own) == len(cal.replay_points) + len(cal.load_points)
    assert all(abs(r.ratio - 1) < 1e-6 for r in own)
    what, measured, predicted, ratio = own[0]
    assert what.startswith("replay P=4096 R=128 (W)") and ratio == pytest.approx(predicted / measured)
    slower = calib(c=1e-12, a=0.012, contexts=(65536,))  # a later run, at a context the calibration never saw
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(slower))
    rows = report(cal, path)
    assert [r.what for r in rows][:4] == [f"replay P=65536 R={r} ({lab})"
                                          for r, lab in ((W, "W"), (2 * W, "2W"), (4 * W, "4W"), (BOUND, "exact"))]
    assert all(r.ratio < 1 for r in rows[:4])  # it was slower than predicted: the report shows it
    assert all(abs(r.ratio - 1) < 1e-6 for r in rows[4:])  # the loads were the same
    slower["load"].append({"tier": "nvme", "bytes": 1, "seconds": 1.0})
    bare = Calibration.from_json({**calib(), "replay": [], "load": [q for q in calib()["load"] if q["tier"] != "nvme"]})
    rows = report(bare, slower)  # nothing to predict with: NaN rows, the rest still reported
    assert all(math.isnan(r.predicted) for r in rows if r.what.startswith(("replay", "load nvme")))
    assert all(abs(r.ratio - 1) < 1e-6 for r in rows if r.what.startswith(("load hbm", "load dram")))


def test_policy_check_compares_the_choice_with_what_the_run_measured() -> None:
    from engram.replay.costmodel import policy_check

    cal = Calibration.from_json(calib())
    rows = policy_check(cal, calib(), budgets=[0, 1 << 30], floor=FidelityFloor(min_top1=0.99))
    assert {r.budget_bytes for r in rows} == {0, 1 << 30} and {r.context for r in rows} == {4096, 16384}
    # On its own run the model is exact: the choice is the measured best, ratio 1.
    assert all(r.chosen == r.best and r.ratio == 1.0 for r in rows)
    assert all(r.chosen == "persist" for r in rows if r.budget_bytes)  # a 2 MiB load beats a 10 ms replay
    assert all(r.chosen == "approx k=4" for r in rows if not r.budget_bytes)  # top-1 0.995 passes 0.99
    # A run where approx replay turned out slow: the calibration still picks it, and the check says by how much.
    slow = calib()
    for p in slow["replay"]:
        if p["label"] == "4W":
            p["seconds"] *= 10
    rows = policy_check(cal, slow, budgets=[0], floor=FidelityFloor(min_top1=0.99))
    assert all(r.chosen == "approx k=4" and r.best == "exact" and r.ratio > 1.2 for r in rows)


def test_a_launch_bound_floor_is_fitted_as_overlapped_not_added() -> None:
    """Replays that cost max(floor, work) (the host launching kernels hides short device work, as on the H200)
    are fitted in that form: a sum would charge the floor again on top of long replays' work."""
    data = calib(contexts=(4096, 16384, 65536))
    for p in data["replay"]:
        p["seconds"] = max(0.027, p["token_layers"] * 2e-10 * p["context"])
    cal = Calibration.from_json(data)
    assert cal.replay_fit is not None and cal.replay_fit.overlapped
    assert math.isclose(cal.replay_fit.intercept, 0.027, rel_tol=1e-9)
    rows = report(cal, data)
    assert max(abs(r.ratio - 1) for r in rows if r.what.startswith("replay")) < 1e-6
    # Linear data still gets the sum form.
    assert not Calibration.from_json(calib(c=1e-12, contexts=(4096, 16384))).replay_fit.overlapped  # type: ignore[union-attr]
