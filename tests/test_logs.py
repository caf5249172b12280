"""`logging.json = true`: every log line of a real daemon is one JSON object; start, eviction bursts
(summarized per interval, not per block) and stop each give one line."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from engram import errors
from engram.client import SyncEngramClient

from helpers import engram_daemon, random_kv, small_tmpfs, tiny_model, tokens


def test_json_logs_one_line_per_event(tmp_path: Path) -> None:
    spec = tiny_model()
    block = spec.layout.block_nbytes(16)
    env = {"ENGRAM_TIERS__DRAM__CAPACITY": str(4 * block), "ENGRAM_LOGGING__JSON": "true",
           "ENGRAM_LOGGING__SUMMARY_S": "0.2", "ENGRAM_LOGGING__LEVEL": "info"}
    with engram_daemon(tmp_path, "--log-level", "info", env=env) as (address, proc):
        with SyncEngramClient(address, namespace="logs") as c:
            fp = c.register_model(spec)
            for seed in range(3):  # 3 chains of 4 blocks into room for 4: 8 evictions
                c.put(fp, tokens(64, seed=seed), random_kv(spec, 64, seed=seed))
            evictions = c.stats().tiers[0].evictions
        time.sleep(0.6)  # let the reporter's interval pass once more
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert proc.stdout is not None
        lines = [line for line in proc.stdout.read().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines if not line.startswith("engram: ")]  # prints are for humans
    assert records and all(set(r) == {"time", "level", "logger", "event", "fields"} for r in records)
    events = [r["event"] for r in records]
    assert any(e.startswith("engram serving on unix:") for e in events)
    start = next(r for r in records if r["event"].startswith("engram serving"))
    assert start["fields"]["tiers"] == ["dram"] and start["level"] == "info"
    bursts = [r for r in records if "blocks evicted" in r["event"]]
    assert 1 <= len(bursts) < evictions  # summarized, not one line per block
    assert sum(r["fields"]["evicted"] for r in bursts) == evictions == 8
    assert events[-1] == "engram stopped"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_plain_logs_say_why_a_tier_is_degraded_and_the_banner_gives_a_small_tier_its_unit(tmp_path: Path) -> None:
    """Plain-text logs drop the structured fields: "tier nvme is degraded" said neither the full disk nor its path,
    which only JSON mode's fields held; and the banner showed a 64 KiB DRAM tier as "dram 0 MiB" (an audit,
    session 48). A real daemon whose NVMe tier fills (a 256 KiB tmpfs: ENOSPC from the kernel)."""
    spec = tiny_model()
    with small_tmpfs(tmp_path / "nvme") as nvme:
        env = {"ENGRAM_TIERS__DRAM__CAPACITY": "64KiB", "ENGRAM_TIERS__NVME__PATH": str(nvme),
               "ENGRAM_TIERS__NVME__CAPACITY": "64MiB", "ENGRAM_TIERS__NVME__FSYNC": "false",
               "ENGRAM_TIERS__WRITE_POLICY": "write-through", "ENGRAM_TIERS__ON_NVME_FAILURE": "fail",
               "ENGRAM_TIERS__RETRY_S": "30", "ENGRAM_LOGGING__SUMMARY_S": "0.2"}
        with engram_daemon(tmp_path, "--log-level", "info", env=env) as (address, proc):
            with SyncEngramClient(address, namespace="logs", zero_copy=False) as c:
                fp = c.register_model(spec)
                for seed in range(1000):
                    try:
                        c.put(fp, tokens(64, seed=seed), random_kv(spec, 64, seed=seed))
                    except errors.EngramError:
                        break
                assert c.stats().tier("nvme").state == "degraded"
            time.sleep(0.6)  # the reporter's interval passes
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0
            assert proc.stdout is not None
            lines = proc.stdout.read().splitlines()
    said = [line for line in lines if "tier nvme is degraded" in line]
    assert len(said) == 1 and "no space left" in said[0] and str(nvme) in said[0], said
    assert any(line.startswith("engram: tiers: dram 64 KiB") for line in lines), lines[:8]


@pytest.mark.parametrize("json_logs", [False, True], ids=["plain", "json"])
def test_the_serving_line_lists_the_tiers_and_their_capacities(tmp_path: Path, json_logs: bool) -> None:
    """The log's "engram serving on ..." named no tier (only stdout's banner did; JSON mode's fields held the
    names without capacities), so a log alone did not say what the daemon ran with (an audit, session 48)."""
    env = {"ENGRAM_TIERS__DRAM__CAPACITY": "64MiB", "ENGRAM_TIERS__NVME__PATH": str(tmp_path / "nvme"),
           "ENGRAM_TIERS__NVME__CAPACITY": "2GiB", "ENGRAM_LOGGING__JSON": str(json_logs).lower()}
    with engram_daemon(tmp_path, "--log-level", "info", env=env) as (_, proc):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert proc.stdout is not None
        lines = proc.stdout.read().splitlines()
    said = [line for line in lines if "engram serving on unix:" in line]
    assert len(said) == 1, lines
    assert "tiers: dram 64 MiB, nvme 2.0 GiB" in said[0], said
    if json_logs:
        fields = json.loads(said[0])["fields"]
        assert fields["tiers"] == ["dram", "nvme"]
        assert fields["tier_capacity_bytes"] == {"dram": 64 * 2**20, "nvme": 2 * 2**30}
