"""`engram bench replay` (engram/replay/bench.py) end to end on the CPU: the JSON a cost model calibrates from
follows schema engram.replay_cost/1 (checked here key by key, apart from the module's own validator), its
figures are the ones the run measured (R list, token-layers, byte counts, fidelity of the exact replay), and
the Markdown and the PNG are written."""

from __future__ import annotations

import datetime
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from engram.cli.main import app
from engram.replay.bench import NAMED, validate

from helpers import missing

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

MODEL_KEYS = {"name": str, "source": str, "weights_id": str, "layers": int, "sliding_layers": int,
              "global_layers": int, "window": int, "n_kv_heads": int, "head_dim": int, "dtype": str}
MACHINE_KEYS = {"id": str, "device": str, "device_name": str, "torch": str}
ROW_KEYS = {
    "replay": {"context": int, "replayed": int, "label": str, "seconds": float, "token_layers": int},
    "load": {"tier": str, "bytes": int, "seconds": float},
    "fidelity": {"replayed": int, "label": str, "kv_rel_error": float, "kl": float, "top1": float},
    "persisted": {"context": int, "global_bytes": int, "window_bytes": int},
}


def _typed(obj: dict[str, Any], keys: dict[str, type], where: str) -> None:
    assert set(obj) == set(keys), (where, sorted(obj))
    for key, typ in keys.items():
        value = obj[key]
        assert not isinstance(value, bool), (where, key)
        assert isinstance(value, (int, float) if typ is float else typ), (where, key, value)


def check_schema(doc: dict[str, Any]) -> None:
    assert set(doc) == {"schema", "model", "machine", "date", "replay", "load", "fidelity", "persisted"}
    assert doc["schema"] == "engram.replay_cost/1"
    datetime.date.fromisoformat(doc["date"])
    _typed(doc["model"], MODEL_KEYS, "model")
    _typed(doc["machine"], MACHINE_KEYS, "machine")
    assert doc["model"]["source"] in ("named", "checkpoint")
    assert doc["machine"]["device"] in ("cuda", "cpu")
    for section, keys in ROW_KEYS.items():
        assert isinstance(doc[section], list) and doc[section], section
        for i, row in enumerate(doc[section]):
            _typed(row, keys, f"{section}[{i}]")
    validate(doc)  # the module's validator agrees


def check_figures(doc: dict[str, Any], contexts: list[int], itemsize: int) -> None:
    m = doc["model"]
    w, sliding, glob = m["window"], m["sliding_layers"], m["global_layers"]
    assert m["layers"] == sliding + glob
    bound = sliding * (w - 1)
    per_row = m["n_kv_heads"] * m["head_dim"] * itemsize
    # replay: per context, R = W, 2W, 4W, ... strictly increasing, ending in the exact bound
    assert sorted({r["context"] for r in doc["replay"]}) == contexts
    for n in contexts:
        rows = [r for r in doc["replay"] if r["context"] == n]
        rs = [r["replayed"] for r in rows]
        assert rs == sorted(set(rs)) and rs[-1] == bound and rows[-1]["label"] == "exact"
        assert [r["label"] for r in rows[:-1]] == ["W", *(f"{2**i}W" for i in range(1, len(rows) - 1))]
        assert all(r["replayed"] == 2**i * w for i, r in enumerate(rows[:-1]))
        assert all(r["seconds"] > 0 for r in rows)
        layers = [r["token_layers"] for r in rows]
        assert layers == sorted(set(layers)) and layers[-1] <= m["layers"] * bound
    # loads: the window's bytes and larger, from DRAM and NVMe (no HBM on the CPU)
    window = sliding * 2 * (w - 1) * per_row
    tiers = {r["tier"] for r in doc["load"]}
    assert tiers == ({"hbm", "dram", "nvme"} if doc["machine"]["device"] == "cuda" else {"dram", "nvme"})
    for tier in tiers:
        sizes = [r["bytes"] for r in doc["load"] if r["tier"] == tier]
        assert min(sizes) == window and len(sizes) >= 3 and all(s % window == 0 for s in sizes)
    assert all(r["seconds"] > 0 for r in doc["load"])
    # persisted: global KV for N tokens, and the window beside it
    assert [p["context"] for p in doc["persisted"]] == contexts
    for p in doc["persisted"]:
        assert p["global_bytes"] == glob * 2 * p["context"] * per_row
        assert p["window_bytes"] == window
    # fidelity: the same R list; the exact replay rebuilds the window (float32 rounding) and decodes the same
    # token; a replay of W tokens over more than one sliding layer does not
    fid = doc["fidelity"]
    assert [f["replayed"] for f in fid] == [r["replayed"] for r in doc["replay"] if r["context"] == contexts[-1]]
    exact = fid[-1]
    assert exact["label"] == "exact" and exact["replayed"] == bound
    assert exact["kv_rel_error"] < 1e-5 and exact["kl"] < 1e-8 and exact["top1"] == 1.0
    assert fid[0]["label"] == "W" and fid[0]["kv_rel_error"] > 1e-3 and fid[0]["kl"] > exact["kl"]
    assert all(0.0 <= f["top1"] <= 1.0 and f["kl"] >= 0.0 for f in fid)


def check_files(out: Path, stdout: str) -> None:
    png = (out / "replay_cost.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    md = (out / "replay_cost.md").read_text()
    for heading in ("| context | R = W |", "| tier | bytes | ms |", "| R | label | K/V rel. error",
                    "| context | with replay (global KV) |"):
        assert heading in md, heading
    assert md in stdout


def test_smoke_writes_json_markdown_and_png(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bench", "replay", "--smoke", "--out", str(out), "--nvme-dir",
                                   str(tmp_path / "nvme")])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "replay_cost.json").read_text())
    check_schema(doc)
    tiny = NAMED["tiny"]
    assert doc["model"] | {"weights_id": ""} == {
        "name": "tiny", "source": "named", "weights_id": "", "layers": tiny.n_layers,
        "sliding_layers": tiny.n_layers // 2, "global_layers": tiny.n_layers // 2, "window": tiny.window,
        "n_kv_heads": tiny.n_kv_heads, "head_dim": tiny.head_dim, "dtype": "float32"}
    assert doc["model"]["weights_id"].startswith("hybrid:")
    assert doc["machine"]["device"] == "cpu"
    check_figures(doc, [64, 128, 256], itemsize=4)
    check_files(out, res.stdout)
    assert list((tmp_path / "nvme").iterdir()) == []  # the NVMe test file is removed


def test_a_checkpoint_directory(tmp_path: Path) -> None:
    if importlib.util.find_spec("transformers") is None:  # a declared test dependency (ENGRAM_TESTS_WITHOUT)
        missing("transformers", "the HF checkpoints need it (pip install -e '.[dev]')")
    from engram.replay.hf import tiny_gpt_oss

    tiny_gpt_oss(dtype=torch.float32).model.save_pretrained(tmp_path / "gpt-oss-tiny")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bench", "replay", "--smoke", "--model", str(tmp_path / "gpt-oss-tiny"),
                                   "--contexts", "48,64", "--prompts", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "replay_cost.json").read_text())
    check_schema(doc)
    assert doc["model"]["source"] == "checkpoint" and doc["model"]["name"] == "gpt-oss-tiny"
    assert doc["model"]["weights_id"].startswith("hf:")
    check_figures(doc, [48, 64], itemsize=4)
    check_files(out, res.stdout)


def test_bad_input_is_refused(tmp_path: Path) -> None:
    for args in (["--model", "no-such-model"], ["--contexts", "4K,x"], ["--device", "tpu"], ["--contexts", "4"],
                 ["--fidelity-context", "20"]):
        res = CliRunner().invoke(app, ["bench", "replay", "--smoke", "--out", str(tmp_path), *args])
        assert res.exit_code == 4, (args, res.output)
    assert not (tmp_path / "replay_cost.json").exists()


def test_the_validator_refuses_strays() -> None:
    good = {"schema": "engram.replay_cost/1",
            "model": {"name": "m", "source": "named", "weights_id": "hybrid:x", "layers": 2, "sliding_layers": 1,
                      "global_layers": 1, "window": 4, "n_kv_heads": 1, "head_dim": 2, "dtype": "float32"},
            "machine": {"id": "h / cpu", "device": "cpu", "device_name": "cpu", "torch": "2"},
            "date": "2026-12-04",
            "replay": [{"context": 8, "replayed": 3, "label": "exact", "seconds": 0.1, "token_layers": 6}],
            "load": [{"tier": "dram", "bytes": 48, "seconds": 1e-6}],
            "fidelity": [{"replayed": 3, "label": "exact", "kv_rel_error": 0.0, "kl": 0.0, "top1": 1.0}],
            "persisted": [{"context": 8, "global_bytes": 128, "window_bytes": 48}]}
    validate(good)
    bad = [good | {"extra": 1}, good | {"schema": "engram.replay_cost/2"}, good | {"date": "yesterday"},
           good | {"load": [{"tier": "tape", "bytes": 48, "seconds": 1.0}]},
           good | {"replay": [{**good["replay"][0], "token_layers": 6.0}]},
           good | {"model": {**good["model"], "source": "other"}},
           good | {"persisted": []}]
    for doc in bad:
        with pytest.raises(ValueError):
            validate(doc)


async def test_a_calibration_it_saves_is_what_the_daemon_decides_by(tmp_path: Path, server_factory) -> None:  # type: ignore[no-untyped-def]
    """bench -> --calibrate DIR -> a daemon with replay.calibrations=DIR and the same checkpoint finds the
    calibration (same weights id, same machine id) and its auto sessions decide by it; a second run --check'd
    against the first reports the prediction error and the policy's choices."""
    if importlib.util.find_spec("transformers") is None:  # a declared test dependency (ENGRAM_TESTS_WITHOUT)
        missing("transformers", "the HF checkpoints need it (pip install -e '.[dev]')")
    import numpy as np

    from engram.client import EngramClient
    from engram.replay.hf import load_checkpoint, tiny_gpt_oss
    from engram.replay.runtime import model_spec_for

    ckpt = tmp_path / "gpt-oss-tiny"
    tiny_gpt_oss(dtype=torch.float32).model.save_pretrained(ckpt)
    cal_dir = tmp_path / "calibrations"
    common = ["bench", "replay", "--smoke", "--model", str(ckpt), "--prompts", "2", "--device", "cpu"]
    res = CliRunner().invoke(app, [*common, "--contexts", "48,64", "--out", str(tmp_path / "a"),
                                   "--calibrate", str(cal_dir)])
    assert res.exit_code == 0, res.output
    assert len(list(cal_dir.glob("replay_cost.*.json"))) == 1
    res = CliRunner().invoke(app, [*common, "--contexts", "56", "--out", str(tmp_path / "b"),
                                   "--check", str(tmp_path / "a" / "replay_cost.json")])
    assert res.exit_code == 0, res.output
    check = (tmp_path / "b" / "replay_cost_check.md").read_text()
    assert "replay: predicted within" in check and "load: predicted within" in check
    assert "worst chosen / best" in check and "| 56 |" in check

    worker = load_checkpoint(ckpt, dtype=torch.float32)
    srv = await server_factory(**{"replay.models": str(ckpt), "replay.device": "cpu",
                                  "replay.calibrations": str(cal_dir)})
    toks = np.random.default_rng(0).integers(0, 256, 40, dtype=np.int32)
    async with EngramClient(srv.address) as client:
        fp = await client.register_model(model_spec_for(worker, block_tokens=16, codec="raw"))
        res_kv = worker.prefill(torch.as_tensor(toks, dtype=torch.long))
        await client.put(fp, toks, torch.stack([torch.stack((k, v)) for k, v in res_kv.global_kv]))
        sid = (await client.open_session(fp, mode="auto", tokens=toks)).session_id
        assert (await client.resume(sid)).source == "replay"
        info = next(s.info for s in await client.list_sessions() if s.info.session_id == sid)
        assert info.decision and "no calibration" not in info.decision, info.decision
