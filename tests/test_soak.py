"""The soak benchmark (benchmarks/soak.py) for 60 s: 32 clients mixing put, get, lookup, resume, pin and evict
against a real daemon subprocess; no wrong byte, no unexpected error, and the daemon's RSS, open files,
leases, pins and sessions bounded after the warm-up (the 30-minute run's figures are in
benchmarks/RESULTS.md). Marked `soak` so a quick local run can leave it out (`-m "not soak"`); CI runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.soak
@pytest.mark.timeout(960)
def test_sixty_seconds_of_32_clients_hold_every_bound(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # The bound is for a hang, not a speed: the run takes about 2.5 min on the 2-core dev machine, and went past
    # 400 s twice in one session with helpers loading the cores (session 54), its checks never reached.
    # From the repository root: `benchmarks` is a package there (the daemon it starts runs elsewhere).
    proc = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--seconds", "60", "--clients", "32",
                           "--sample-s", "5", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert out.exists(), proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["wrong_bytes"] == 0 and not res["failures"], proc.stdout
    assert all(res["bounded"].values()), proc.stdout
    ops = res["ops"]
    assert all(ops.get(op, 0) > 0 for op in ("put", "get", "lookup", "resume", "pin", "evict")), ops
    assert proc.returncode == 0, proc.stdout
