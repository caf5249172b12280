"""`logging.json = true`: every log line of a real daemon is one JSON object; start, eviction bursts
(summarized per interval, not per block) and stop each give one line."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from engram.client import SyncEngramClient

from helpers import engram_daemon, random_kv, tiny_model, tokens


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
