"""`engram top` renders against a real daemon: a frame built from two snapshots (Rich console capture)
shows the rates of the traffic between them, and `--once` prints one frame and exits 0."""

from __future__ import annotations

import subprocess
from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

from engram.cli.main import app
from engram.cli.top import frame, snapshot
from engram.client import EngramClient, SyncEngramClient

from helpers import ENGRAM, NEUTRAL_CWD, engram_daemon, random_kv, tiny_model, tokens


async def test_frame_shows_rates_between_snapshots(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="top", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        await c.open_session(fp, mode="persist", session_id="agent-1", tokens=tokens(32))
        before = await snapshot(c, None)
        await c.put(fp, tokens(32), random_kv(spec, 32))
        for _ in range(4):
            await c.get_prefix(fp, tokens(32))
        after = await snapshot(c, None)
    after = type(after)(before.at + 2.0, after.stats, after.sessions)  # a known interval: rates are exact
    out = Console(record=True, width=160)
    out.print(frame(before, after, srv.address))
    text = out.export_text()
    rows = {cells[1]: cells[2:] for line in text.splitlines()
            if len(cells := [c.strip() for c in line.split("│")]) > 2}
    assert rows["dram"][4] == "4.0"  # hits/s: 8 block reads in 2 s
    assert rows["dram"][3] == "2"  # blocks
    assert "rates over 2.0 s" in " ".join(text.split())  # the title wraps at the table's width (the path's length)
    assert rows["blocks put/s"][0] == "1.0" and rows["blocks served/s"][0] == "4.0"
    assert rows["lookups/s"][0] == "2.0"  # four get_prefix lookups (a put on the daemon's host looks up nothing)
    assert "agent-1" in text and "persist" in text


def test_top_once_against_daemon_subprocess(tmp_path: Path) -> None:
    with engram_daemon(tmp_path) as (address, _):
        spec = tiny_model()
        with SyncEngramClient(address, namespace="top") as c:
            fp = c.register_model(spec)
            c.put(fp, tokens(32), random_kv(spec, 32))
        result = CliRunner().invoke(app, ["top", "--once", "--interval", "0.1", "-a", address])
        assert result.exit_code == 0, result.output
        assert "engram top" in result.stdout and "dram" in result.stdout and "lookups/s" in result.stdout
        gone = CliRunner().invoke(app, ["top", "--once", "-a", f"unix:{tmp_path / 'none.sock'}"])
        assert gone.exit_code == 2 and "no Engram daemon answers" in gone.stderr


def test_top_refuses_an_interval_past_a_day_instead_of_waiting_for_ever(tmp_path: Path) -> None:
    # inf was refused, but 1e308 was taken: --once slept that long under a call timeout of 4 intervals.
    with engram_daemon(tmp_path) as (address, _):
        for interval in ("1e308", "86401"):
            out = subprocess.run([*ENGRAM, "top", "--once", "-i", interval, "-a", address], capture_output=True,
                                 text=True, timeout=60, cwd=NEUTRAL_CWD)
            assert out.returncode == 4, out.stderr
            assert "--interval must be a finite number of seconds, at most a day (86400)" in out.stderr
