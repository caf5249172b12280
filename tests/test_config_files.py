"""A config file (`-c`, ENGRAM_CONFIG) or auth.tenants_file that is no configuration is refused as one: a
ConfigError naming the file, one line and exit 4 from every command, `engram serve` included (a fuzz audit,
session 49). Nested too deeply for tomllib, it was a RecursionError traceback (exit 1); endless (/dev/zero, an
endless pipe), it was read until memory ran out. A config from a pipe (`-c <(...)`) is still read.

Real `engram` processes; the endless cases run under a 2 GiB address-space limit, so the unbounded read that
the fix removed ends in a MemoryError within seconds instead of taking the machine's memory."""

from __future__ import annotations

import os
import resource
import shlex
import subprocess
from pathlib import Path

import pytest

from engram.tomlfile import MAX_TOML_BYTES

from helpers import ENGRAM, NEUTRAL_CWD

DEEP = {"arrays": "a = " + "[" * 5000 + "]" * 5000 + "\n",
        "inline-tables": "x = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n"}
TOO_DEEP = "is not valid TOML: its arrays or inline tables nest too deeply"
TOO_LONG = f"holds more than {MAX_TOML_BYTES // 2**20} MiB, read no further"


def _two_gib_of_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))


def engram(*args: str, env: dict[str, str] | None = None, shell: str = "") -> subprocess.CompletedProcess[str]:
    """`engram ARGS` (or the bash line `shell`, its `engram` this one) in a real process."""
    command = shlex.join(ENGRAM)
    argv = ["bash", "-c", shell.replace("engram ", command + " ", 1)] if shell else [*ENGRAM, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=NEUTRAL_CWD,
                          env={**os.environ, **(env or {})}, preexec_fn=_two_gib_of_address_space)


def one_error(out: subprocess.CompletedProcess[str]) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 4 and len(lines) == 1 and lines[0].startswith("error: "), (out.returncode, out.stderr)
    return lines[0]


@pytest.mark.parametrize("nesting", DEEP, ids=list(DEEP))
def test_a_config_nested_too_deeply_is_not_valid_toml(tmp_path: Path, nesting: str) -> None:
    config = tmp_path / "deep.toml"
    config.write_text(DEEP[nesting])
    assert one_error(engram("config", "-c", str(config))) == f"error: config file {config} {TOO_DEEP}"
    from_env = engram("stats", "-a", "unix:/nonexistent", env={"ENGRAM_CONFIG": str(config)})
    assert one_error(from_env) == f"error: config file {config} {TOO_DEEP}"


@pytest.mark.parametrize(("how", "source"), [
    ("flag", "/dev/zero"), ("flag", "/dev/urandom"), ("env", "/dev/zero"), ("pipe", "<(yes '# endless')"),
], ids=["dev-zero", "dev-urandom", "env-dev-zero", "endless-pipe"])
def test_an_endless_config_is_refused_at_the_bound(how: str, source: str) -> None:
    if how == "flag":
        out = engram("config", "-c", source)
    elif how == "env":
        out = engram("ls", "-a", "unix:/nonexistent", env={"ENGRAM_CONFIG": source})
    else:
        out = engram(shell=f"engram config -c {source}")
    assert TOO_LONG in one_error(out)


def test_a_config_file_past_the_bound_is_refused_and_one_at_it_is_read(tmp_path: Path) -> None:
    config = tmp_path / "long.toml"
    line = b"# " + b"x" * 1021 + b"\n"  # 1 KiB
    config.write_bytes(line * (MAX_TOML_BYTES // len(line)) + b"[server]\nport = 6001\n")
    assert config.stat().st_size > MAX_TOML_BYTES
    assert one_error(engram("config", "-c", str(config))) == f"error: config file {config} {TOO_LONG}: no " \
        "configuration is that long (an endless file such as /dev/zero?); give the TOML file"
    config.write_bytes(line * (MAX_TOML_BYTES // len(line) - 1) + b"[server]\nport = 6001\n")
    out = engram("config", "-c", str(config))
    assert out.returncode == 0 and "port = 6001" in out.stdout, out.stderr


def test_a_config_from_a_pipe_is_read() -> None:
    """`-c <(...)`: a named pipe, no regular file, read to its end as a file is."""
    out = engram(shell="engram config -c <(printf '[server]\\nport = 6002\\n')")
    assert out.returncode == 0 and "port = 6002" in out.stdout, out.stderr


def serve_with_tenants_file(tmp_path: Path, tenants: Path) -> subprocess.CompletedProcess[str]:
    shm = tmp_path / "shm"
    shm.mkdir()
    return engram("serve", "--unix-socket", str(tmp_path / "e.sock"), "--dram-capacity", "64MiB",
                  "--set", f"tiers.dram.shm_dir={shm}", "--set", f"auth.tenants_file={tenants}",
                  "--set", "auth.salt_secret=s3cr3t-salt")


def test_a_tenants_file_nested_too_deeply_fails_the_start_as_not_valid_toml(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('admin_tokens = ["x"]\n[tenants.a]\ntoken = "tok-aaaaaaaa"\nq = ' + "[" * 5000 + "]" * 5000)
    out = serve_with_tenants_file(tmp_path, tenants)
    assert one_error(out) == f"error: auth.tenants_file {tenants} {TOO_DEEP}"


def test_a_tenants_file_past_the_bound_fails_the_start(tmp_path: Path) -> None:
    """Read whole, it would have failed on its last line's unknown key instead."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_bytes(b"#" * MAX_TOML_BYTES + b'\nbogus = 1\n')
    out = serve_with_tenants_file(tmp_path, tenants)
    assert TOO_LONG in one_error(out) and f"auth.tenants_file {tenants} " in out.stderr


@pytest.mark.parametrize("secret", ["endless", "binary"])
def test_a_file_secret_that_is_no_secret_is_a_config_error(tmp_path: Path, secret: str) -> None:
    """auth.salt_secret = "file:PATH" (tokens take file: too): /dev/zero was read until MemoryError, a binary
    file raised UnicodeDecodeError (tracebacks, exit 1); both are the config's error now, exit 4."""
    path = "/dev/zero"
    if secret == "binary":
        path = str(tmp_path / "secret.bin")
        Path(path).write_bytes(bytes(range(128, 256)))
    config = tmp_path / "engram.toml"
    config.write_text(f'[auth]\nsalt_secret = "file:{path}"\n[auth.tenants.a]\ntoken = "token-a"\n')
    out = engram("serve", "-c", str(config), "--unix-socket", str(tmp_path / "s.sock"),
                 "--set", "tiers.dram.pool=private", "--dram-capacity", "64MiB")
    said = "holds more than 64 KiB, read no further" if secret == "endless" else "is not UTF-8 text"
    assert one_error(out).startswith(f"error: auth.salt_secret: {path} {said}"), out.stderr
