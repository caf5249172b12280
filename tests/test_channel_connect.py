"""A client's first call to a daemon that is slow to answer a new connection for a moment (a loaded host, a
collector pause: here SIGSTOP for half a second) waits for it, within the call's own deadline. The channel's
options once made grpc give each connection attempt about 100 ms (grpc.min_reconnect_backoff_ms is also its
minimum connect timeout), so such a call failed UNAVAILABLE "connection attempt timed out before receiving SETTINGS
frame" and the CLI said no daemon answers (an audit, session 44; likely also the rare TCP flake of
test_server_roundtrip's sixteen clients)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
from pathlib import Path

from engram.client import EngramClient

from helpers import ENGRAM, NEUTRAL_CWD, engram_daemon

PAUSE_S = 0.5


def _paused(proc: subprocess.Popen[str]) -> threading.Timer:
    """Stop the daemon now; it goes on after PAUSE_S (join the timer)."""
    os.kill(proc.pid, signal.SIGSTOP)
    timer = threading.Timer(PAUSE_S, os.kill, (proc.pid, signal.SIGCONT))
    timer.start()
    return timer


def test_a_first_call_waits_for_a_daemon_that_pauses_before_answering_its_connection(tmp_path: Path) -> None:
    with engram_daemon(tmp_path) as (address, proc):

        async def stats() -> int:
            async with EngramClient(address) as client:
                return len((await client.stats()).tiers)

        timer = _paused(proc)
        try:
            assert asyncio.run(stats()) >= 1
        finally:
            timer.join()
        timer = _paused(proc)
        try:
            cli = subprocess.run([*ENGRAM, "stats", "-a", address], capture_output=True, text=True, cwd=NEUTRAL_CWD,
                                 timeout=60)
        finally:
            timer.join()
        assert cli.returncode == 0, cli.stderr
