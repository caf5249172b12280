"""The `engram` command against a real daemon subprocess (started by `engram serve`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engram.cli.main import app
from engram.client import SyncEngramClient
from engram.codec.base import default_backend, resolve_default_codec

from helpers import (
    BLOCK_TOKENS,
    ENGRAM,
    NEUTRAL_CWD,
    engram_daemon,
    random_kv,
    small_tmpfs,
    tiny_model,
    tokens,
)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    with engram_daemon(tmp_path) as running:
        yield running


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ENGRAM, *args], capture_output=True, text=True, timeout=60, cwd=NEUTRAL_CWD)


def test_stats_json_and_table_match_daemon_state(daemon) -> None:  # type: ignore[no-untyped-def]
    address, _ = daemon
    spec = tiny_model()
    toks = tokens(40)
    with SyncEngramClient(address, namespace="cli") as c:
        fp = c.register_model(spec)
        c.put(fp, toks, random_kv(spec, 40))
        c.get_prefix(fp, toks)
    out = run_cli("stats", "--json", "--address", address)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    dram = data["tiers"][0]
    assert dram["name"] == "dram" and int(dram["blocks"]) == 3 and int(dram["capacity_bytes"]) == 64 * 2**20
    assert int(dram["used_bytes"]) == spec.layout.block_nbytes(40)
    assert data["models"][0]["model_fingerprint"] == fp.hex()
    assert int(data["models"][0]["tokens"]) == 40
    assert int(data["blocks_served"]) == 3
    ev = data["eviction"]  # cold: three uses by the prefix Get, far from the evidence densities need
    assert ev.get("learned", False) is False and float(ev["recency_weight"]) == 0.5 and int(ev["comebacks"]) == 3

    table = run_cli("stats", "--address", address)
    assert table.returncode == 0
    assert "dram" in table.stdout and "tiny-hybrid" in table.stdout and fp.hex()[:12] in table.stdout
    assert "least recently used (learning: 3 comebacks seen" in " ".join(table.stdout.split())


def test_serve_stops_gracefully_on_sigterm(daemon) -> None:  # type: ignore[no-untyped-def]
    _, proc = daemon
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert proc.stdout is not None and "engram: stopped" in proc.stdout.read()


def test_unreachable_daemon_is_a_clear_error(tmp_path: Path) -> None:
    out = run_cli("stats", "--address", f"unix:{tmp_path / 'nobody.sock'}")
    assert out.returncode == 2
    assert "no Engram daemon answers" in out.stderr and "Traceback" not in out.stderr


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "c.toml"
    bad.write_text("[server]\nprot = 1\n")
    out = run_cli("serve", "--config", str(bad))
    assert out.returncode == 4 and "unknown config key 'server.prot'" in out.stderr
    out = run_cli("serve", "--set", "novalue")
    assert out.returncode == 4 and "key=value" in out.stderr


def test_config_output_loads_back_as_a_config_file(tmp_path: Path) -> None:
    from engram.config import load_config

    env = {"ENGRAM_TIERS__DRAM__CAPACITY": "3GiB", "ENGRAM_AUTH__SALT_SECRET": "env:S",
           "ENGRAM_AUTH__TENANTS__TEAM_A__TOKEN": "file:/run/t", "ENGRAM_SERVER__HOST": "10.0.0.1"}
    out = CliRunner().invoke(app, ["config"], env=env)
    assert out.exit_code == 0, out.output
    (tmp_path / "effective.toml").write_text(out.stdout)
    again = load_config(tmp_path / "effective.toml", env={})
    assert again == load_config(env=env) and again.tiers.dram.capacity == 3 * 2**30
    assert again.auth.tenants["team_a"].token == "file:/run/t"  # references are not secrets: printed as they are
    as_json = CliRunner().invoke(app, ["config", "--json"], env=env)
    assert json.loads(as_json.stdout)["server"]["host"] == "10.0.0.1"


def test_config_prints_literal_secrets_only_when_asked(tmp_path: Path) -> None:
    """Tokens, salts, signing secrets and passwords a config holds literally print as 'redacted:' (a
    config printed for a bug report or a screen share leaks nothing), which a config may not hold: loading it
    says what to do. --show-secrets prints them, and that output loads back to the same configuration."""
    from engram.config import ConfigError, load_config

    secrets = {"ENGRAM_AUTH__SALT_SECRET": "salt-s3cr3t-1", "ENGRAM_AUTH__TENANTS__TEAM_A__TOKEN": "tok-s3cr3t-2",
               "ENGRAM_AUTH__ADMIN_TOKENS": "adm-s3cr3t-3,env:ADMIN2", "ENGRAM_CLUSTER__SECRET": "mac-s3cr3t-4",
               "ENGRAM_CLUSTER__PEER_TOKEN": "peer-s3cr3t-5", "ENGRAM_CLUSTER__REDIS_PASSWORD": "pw-s3cr3t-6",
               "ENGRAM_CLUSTER__REDIS_URL": "redis://user:pw-s3cr3t-7@redis:6379/0?password=pw-s3cr3t-8"}
    for args in (["config"], ["config", "--json"]):
        out = CliRunner().invoke(app, args, env=secrets)
        assert out.exit_code == 0, out.output
        assert "s3cr3t" not in out.stdout, out.stdout  # none of the eight
        assert "env:ADMIN2" in out.stdout and "redis://user:redacted:@redis:6379/0" in out.stdout
    printed = tmp_path / "printed.toml"
    printed.write_text(CliRunner().invoke(app, ["config"], env=secrets).stdout)
    with pytest.raises(ConfigError, match=r"auth.admin_tokens holds 'redacted:'.*--show-secrets"):
        load_config(printed, env={})
    shown = CliRunner().invoke(app, ["config", "--show-secrets"], env=secrets).stdout
    assert all(v.split(",")[0] in shown for v in secrets.values() if "s3cr3t" in v)
    printed.write_text(shown)
    assert load_config(printed, env={}) == load_config(env=secrets)


def test_config_keys_listing() -> None:
    result = CliRunner().invoke(app, ["config", "--keys"])
    assert result.exit_code == 0 and "tiers.dram.capacity" in result.output.split()


def test_demo_shares_the_prefix() -> None:
    from rich.console import Console

    from engram.cli.demo import demo

    console = Console(record=True, width=140)
    reports = demo(console)
    a, b = reports
    assert a.cached_tokens == 0 and a.stored == 19
    assert b.cached_tokens == 4096 and b.verified and b.skipped == 16 and b.stored == 3
    codec = resolve_default_codec("auto", default_backend())[0]  # the demo runs on the daemon's defaults
    if codec == "nvfp4":
        assert 0.05 < b.rel_error < 0.15  # NVFP4 on Gaussian data: ~0.1
    else:
        assert codec == "raw" and b.rel_error == 0
    text = console.export_text()
    assert "session B" in text and "4096 (87%)" in text and f"blocks stored as {codec}" in text
    assert torch.__version__  # the demo ran on the CPU build


def test_demo_puts_its_pool_in_its_own_directory_when_dev_shm_is_small(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import shutil as shutil_mod

    from rich.console import Console

    import engram.cli.demo as demo_mod
    from engram.tiers import shm

    made: list[str] = []
    real_init = shm.SharedSegment.__init__

    def recording_init(self, directory, *args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(str(directory))
        real_init(self, directory, *args, **kwargs)

    # Docker's default: a 64 MiB /dev/shm, too small for the demo's 256 MiB pool.
    monkeypatch.setattr(demo_mod.shutil, "disk_usage", lambda path: shutil_mod._ntuple_diskusage(64 << 20, 0, 64 << 20))
    monkeypatch.setattr(shm.SharedSegment, "__init__", recording_init)
    a, b = demo_mod.demo(Console(record=True, width=140))
    assert b.cached_tokens == 4096 and b.verified
    assert made and all(d != "/dev/shm" and "engram-demo-" in d for d in made)


def test_demo_whose_daemon_cannot_start_says_so_in_one_line_with_serves_exit_code(tmp_path: Path) -> None:
    # A $TMPDIR so long that the demo's socket path cannot fit a unix socket's 107 bytes: a ConfigError at start.
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    out = subprocess.run([*ENGRAM, "demo"], capture_output=True, text=True, timeout=120, cwd=NEUTRAL_CWD,
                         env={**os.environ, "TMPDIR": str(deep)})
    assert out.returncode == 4, out.stderr  # serve's code for a configuration error, not the demo's own 1
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("error: server.unix_socket") and "choose a shorter path" in out.stderr


def test_check_offline_reports_then_fixes(tmp_path: Path) -> None:
    import asyncio

    from engram.block import BlockRecord
    from engram.layout import DType
    from engram.tiers.nvme import NvmeTier

    async def write_two() -> list[Path]:
        tier = NvmeTier(tmp_path, 1 << 30)
        paths = []
        for i in range(2):
            payload = os.urandom(1000)
            from engram.block import checksum

            rec = BlockRecord(bytes([i]) * 16, b"\0" * 16, b"f" * 16, "ns", DType.BF16, True, (1, 2, 16, 1, 16),
                              b"\1\0\0\0" * 16, len(payload), checksum(payload))
            assert tier.reserve(tier.space_for(rec))
            await tier.write(rec, payload, tier.space_for(rec))
            paths.append(tier.path_of(rec.key))
        await tier.close()
        return paths

    paths = asyncio.run(write_two())
    clean = run_cli("check", "--dir", str(tmp_path), "--json")
    assert clean.returncode == 0 and json.loads(clean.stdout)["valid"] == 2
    data = bytearray(paths[0].read_bytes())
    data[-1] ^= 1
    paths[0].write_bytes(bytes(data))
    found = run_cli("check", "--dir", str(tmp_path), "--json")
    assert found.returncode == 1
    report = json.loads(found.stdout)
    assert report["valid"] == 1 and len(report["findings"]) == 1
    assert "checksum" in report["findings"][0]["problem"] and not report["findings"][0]["fixed"]
    assert paths[0].exists()
    fixed = run_cli("check", "--dir", str(tmp_path), "--fix")
    assert fixed.returncode == 1 and "yes" in fixed.stdout and not paths[0].exists()
    assert run_cli("check", "--dir", str(tmp_path)).returncode == 0
    bad = run_cli("check", "--dir", str(tmp_path / "nope"))
    assert bad.returncode == 4 and "not an Engram NVMe tier directory" in bad.stderr
    empty = run_cli("check", "--dir", "")  # refused: not taken for "no --dir" (a check of the default daemon)
    assert empty.returncode == 4 and "--dir needs the NVMe tier's directory" in empty.stderr


async def test_check_offline_fix_drops_the_blocks_that_extend_a_dropped_one(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`engram check --dir D --fix` removed a damaged block's file but left the files of the blocks extending it,
    which no lookup could reach (the next start removed them as orphans; the daemon's own check drops them at
    once, as RELIABILITY says a check's drop does; docs audit, session 48). Now they go with it, each a finding;
    another chain stays, and a restarted daemon serves it."""
    from engram.client import EngramClient

    nvme = tmp_path / "nvme"
    settings = {"tiers.nvme.path": str(nvme), "tiers.write_policy": "write-through"}
    spec = tiny_model()
    chain, other = tokens(3 * BLOCK_TOKENS, seed=71), tokens(2 * BLOCK_TOKENS, seed=72)
    srv = await server_factory(**settings)
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        keys = (await c.put(fp, chain, random_kv(spec, len(chain), seed=71))).keys
        await c.put(fp, other, random_kv(spec, len(other), seed=72))
    tier = srv.store.tiers[-1]
    paths = [tier.path_of(k) for k in keys]
    await srv.stop(0)
    data = bytearray(paths[0].read_bytes())
    data[-1] ^= 1
    paths[0].write_bytes(bytes(data))
    fixed = run_cli("check", "--dir", str(nvme), "--fix", "--json")
    assert fixed.returncode == 1, fixed.stderr
    report = json.loads(fixed.stdout)
    assert [f["fixed"] for f in report["findings"]] == [True] * 3
    unreachable = sorted(f["path"] for f in report["findings"] if f["problem"].startswith("unreachable"))
    assert unreachable == sorted(str(p) for p in paths[1:])
    assert not any(p.exists() for p in paths) and report["valid"] == 2
    assert run_cli("check", "--dir", str(nvme)).returncode == 0
    srv = await server_factory(**settings)
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        assert (await c.lookup(fp, chain)).matched_tokens == 0
        assert (await c.lookup(fp, other)).matched_tokens == len(other)



def test_check_dir_on_a_read_only_filesystem_says_so_in_one_line(tmp_path: Path) -> None:
    """A tier remounted read-only after disk errors, when an offline check is most wanted: its lock file could not
    be made and the check died in a traceback with exit 1, the code for "problems found" (an audit). A plain check
    makes nothing, so it runs; --fix cannot, and says so."""
    from engram.tiers.nvmedir import write_marker

    with small_tmpfs(tmp_path / "small", "1m") as mnt:
        (mnt / "blocks").mkdir()
        write_marker(mnt)
        if subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode:
            pytest.skip("this machine refuses to remount a tmpfs read-only")
        plain = run_cli("check", "--dir", str(mnt))
        assert plain.returncode == 0 and "scanned 0 stored copies" in plain.stdout, plain.stderr
        got = run_cli("check", "--dir", str(mnt), "--fix")
        assert got.returncode == 4, got.stderr
        assert "cannot open the tier (Read-only file system" in got.stderr and "Traceback" not in got.stderr
        assert len(got.stderr.strip().splitlines()) == 1


def test_cli_messages_keep_colons_as_typed(tmp_path: Path) -> None:
    """rich turned ":x:" in a name into an emoji in every CLI message (`engram show :x:` said no session '❌')."""
    got = run_cli("check", "--dir", str(tmp_path / ":x:"))
    assert got.returncode == 4 and ":x:" in got.stderr and "\u274c" not in got.stderr


def test_check_online(daemon) -> None:  # type: ignore[no-untyped-def]
    address, _ = daemon
    spec = tiny_model()
    with SyncEngramClient(address, namespace="cli") as c:
        fp = c.register_model(spec)
        c.put(fp, tokens(40), random_kv(spec, 40))
    out = run_cli("check", "--address", address, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"scanned": 3, "valid": 3, "findings": []}


def test_inspection_commands_do_not_load_torch(daemon) -> None:  # type: ignore[no-untyped-def]
    """Importing torch costs seconds: stats, ls, show, top, ping and their --help must run without it."""
    address, _ = daemon
    script = f"""
import sys
from engram.cli.main import app
for args in (["stats", "--json"], ["ls", "--json"], ["top", "--json", "-i", "0.05"], ["ping"], ["show", "x"],
             ["evict", "--session", "x"], ["pin", "ab"], ["check", "--json"], ["stats", "--help"]):
    try:
        app([*args, "-a", {address!r}] if args[-1] != "--help" else args)
    except SystemExit as exc:
        assert exc.code in (0, 3), (args, exc.code)  # 3: x and ab are unknown
heavy = sorted(m for m in ("torch", "numpy", "engram.server", "engram.store", "engram.client") if m in sys.modules)
print("heavy:", heavy)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=NEUTRAL_CWD)
    assert out.returncode == 0, out.stderr
    assert "heavy: []" in out.stdout, out.stdout[-500:]


def test_version_help_and_ping(daemon) -> None:  # type: ignore[no-untyped-def]
    address, _ = daemon
    from engram import __version__

    assert CliRunner().invoke(app, ["--version"]).stdout.strip() == f"engram {__version__}"
    for command in ("stats", "ls", "show", "evict", "pin", "unpin", "top", "check", "ping", "verify-isolation"):
        short = CliRunner().invoke(app, [command, "-h"])  # one name for the TLS root everywhere
        assert short.exit_code == 0 and "--tls-ca" in short.stdout and "ENGRAM_TLS_CA" in short.stdout, command
    assert all(f" {metavar} " in CliRunner().invoke(app, ["ls", "-h"]).stdout for metavar in ("FILE", "ADDR", "NS"))
    ping = CliRunner().invoke(app, ["ping", "--json", "-a", address])
    assert ping.exit_code == 0 and json.loads(ping.stdout)["serving"] is True
    gone = CliRunner().invoke(app, ["ping", "-a", address + ".gone"])
    assert gone.exit_code == 2 and "no Engram daemon answers" in gone.stderr


def test_a_ctrl_c_while_the_command_loads_exits_130_without_a_traceback() -> None:
    """Loading the CLI imports grpc and typer (0.3 s, more on a loaded host); a Ctrl-C then printed the traceback of
    whichever import it stopped. The entry point (engram.command, the console script's and `python -m engram`'s)
    ends it with 130, as a shell's interrupted command. The interrupt is raised by the CLI's own import here (a
    real SIGINT would have to land inside that window, which no test can time)."""
    code = ("import builtins\n"
            "real = builtins.__import__\n"
            "def interrupted(name, *args, **kwargs):\n"
            "    if name == 'engram.cli.main':\n"
            "        raise KeyboardInterrupt\n"
            "    return real(name, *args, **kwargs)\n"
            "builtins.__import__ = interrupted\n"
            "import runpy\n"
            "runpy.run_module('engram', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=NEUTRAL_CWD)
    assert out.returncode == 130 and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("args", [["layouts"], ["--help"], ["config", "--keys"], ["ls", "-h"]])
def test_a_closed_stdout_exits_141_quietly(args: list[str]) -> None:
    """`engram layouts | head` and the like: stdout closed before the output is written exited 1, the code of
    check's "problems found", through click's and rich's handling of the broken pipe. It exits 141 (128 + SIGPIPE,
    as a shell reports cat or grep ended by the pipe), with nothing on stderr."""
    read, write = os.pipe()
    os.close(read)  # every write fails: no race with a reader that has not gone yet
    try:
        out = subprocess.run([*ENGRAM, *args], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
                             cwd=NEUTRAL_CWD)
    finally:
        os.close(write)
    assert out.returncode == 141 and out.stderr == "", out.stderr
