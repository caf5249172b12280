"""The CLI against a daemon with tenants and TLS, configured as README.md's "Tenants" section says (its TOML
block, read from the README, with real files for the paths it names), and the exit codes of usage errors.

The daemon is a real `engram serve` subprocess over TCP with a self-signed certificate; the README's secrets
come from the environment variables it names (ENGRAM_SALT, TEAM_A_TOKEN), which the config loader must not
take for config keys. Commands run in this process through Typer's CliRunner with the environment a user
would set (ENGRAM_TOKEN, ENGRAM_TLS_CA), and once as a real `engram` subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from engram import errors
from engram.cli.main import app
from engram.client import EngramClient, SyncEngramClient
from engram.config import load_config

from helpers import (
    ENGRAM,
    NEUTRAL_CWD,
    engram_daemon,
    free_port,
    random_kv,
    self_signed_cert,
    tiny_model,
    tokens,
    wait_for,
)

REPO = Path(__file__).resolve().parent.parent
ADMIN, TEAM_A = "admin-token-1", "team-a-token-1"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI for a certificate")


def readme_tenant_toml() -> str:
    blocks = re.findall(r"```toml\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return next(b for b in blocks if "[auth.tenants." in b)


@dataclass
class Deployment:
    address: str
    cert: Path
    env: dict[str, str]  # what the daemon was started with (ENGRAM_SALT, TEAM_A_TOKEN, ...)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    cert, key = self_signed_cert(tmp_path)
    admin = tmp_path / "admin"
    admin.write_text(ADMIN)
    toml = (readme_tenant_toml().replace("/etc/engram/cert.pem", str(cert)).replace("/etc/engram/key.pem", str(key))
            .replace("/etc/engram/admin", str(admin)))
    config = tmp_path / "engram.toml"
    config.write_text(toml)
    port = free_port()
    env = {**os.environ, "ENGRAM_SALT": "salt-secret", "TEAM_A_TOKEN": TEAM_A, "ENGRAM_TOKEN": ADMIN,
           "ENGRAM_PEER": "unused", "ENGRAM_TIERS__DRAM__CAPACITY": "64MiB"}
    proc = subprocess.Popen([*ENGRAM, "serve", "--config", str(config), "--port", str(port), "--log-level",
                             "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=NEUTRAL_CWD)
    address = f"localhost:{port}"
    try:
        wait_for(address, proc, root_cert=cert.read_bytes())
        with SyncEngramClient(address, token=TEAM_A, namespace="team-a", root_cert=cert.read_bytes()) as c:
            spec = tiny_model()
            toks = tokens(32)
            fp = c.register_model(spec)
            c.put(fp, toks, random_kv(spec, 32))
            c.open_session(fp, mode="persist", session_id="chat-1", tokens=toks)
        yield Deployment(address, cert, env)
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def cli(*args: str, token: str | None = ADMIN, ca: Path | None = None) -> Result:
    env = {"ENGRAM_TOKEN": token, "ENGRAM_TLS_CA": str(ca) if ca else None}
    return CliRunner().invoke(app, list(args), env=env)


def test_readme_tenant_config_loads_with_its_env_references(tmp_path: Path) -> None:
    """ENGRAM_SALT (named by env:ENGRAM_SALT), ENGRAM_PEER and the CLI's ENGRAM_TOKEN are not config keys."""
    config = tmp_path / "engram.toml"
    config.write_text(readme_tenant_toml().split("[server]")[0])
    env = {"ENGRAM_SALT": "s", "ENGRAM_PEER": "p", "ENGRAM_TOKEN": "t", "ENGRAM_TLS_CA": "/x.pem",
           "ENGRAM_CLUSTER_SECRET": "c", "ENGRAM_SERVER__PORT": "7000"}
    cfg = load_config(config, env=env)
    assert cfg.auth.salt_secret == "env:ENGRAM_SALT" and cfg.auth.tenants["team-a"].quota == 64 * 2**30
    assert cfg.server.port == 7000  # ENGRAM_<SECTION>__<KEY> still sets keys
    with pytest.raises(Exception, match="ENGRAM_SERVER__PROT"):  # and a typo in one is still an error
        load_config(config, env={**env, "ENGRAM_SERVER__PROT": "1"})


def test_tenants_and_tls_from_the_cli(deployment: Deployment) -> None:
    addr, cert = deployment.address, deployment.cert
    stats = cli("stats", "--json", "-a", addr, "--tls-ca", str(cert))  # admin token from ENGRAM_TOKEN
    assert stats.exit_code == 0, stats.output
    assert [n["namespace"] for n in json.loads(stats.stdout)["namespaces"]] == ["team-a"]
    one = cli("stats", "--json", "-n", "team-a", "-a", addr, ca=cert)  # the CA from ENGRAM_TLS_CA
    assert one.exit_code == 0 and json.loads(one.stdout)["namespaces"][0]["blocks"] == 2
    assert cli("stats", "-n", "team-b", "-a", addr, ca=cert).exit_code == 3
    assert cli("check", "--json", "-a", addr, ca=cert).exit_code == 0

    mine = cli("ls", "-n", "team-a", "--json", "-a", addr, token=TEAM_A, ca=cert)
    assert mine.exit_code == 0, mine.output
    assert [s["info"]["session_id"] for s in json.loads(mine.stdout)["sessions"]] == ["chat-1"]
    for token in (ADMIN, TEAM_A):  # no -n: the one namespace holding chat-1 (a tenant sees only its own)
        shown = cli("show", "chat-1", "--json", "-a", addr, token=token, ca=cert)
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.stdout)["session"]["info"]["namespace"] == "team-a"
    top = cli("top", "--json", "-i", "0.1", "-a", addr, ca=cert)
    assert top.exit_code == 0 and "rates_per_s" in json.loads(top.stdout)

    denied = cli("ls", "-a", addr, token=TEAM_A, ca=cert)  # every namespace: admin only
    assert denied.exit_code == 6 and "admin token" in denied.stderr
    assert cli("ping", "-a", addr, token=None, ca=cert).exit_code == 0  # the health check needs no token
    anonymous = cli("stats", "-a", addr, token=None, ca=cert)
    assert anonymous.exit_code == 6 and "ENGRAM_TOKEN" in anonymous.stderr
    plaintext = cli("stats", "-a", addr)
    assert plaintext.exit_code == 4 and "serves TLS" in plaintext.stderr and "--tls-ca" in plaintext.stderr
    bad_ca = cli("stats", "-a", addr, "--tls-ca", str(deployment.cert.parent / "key.pem"))
    assert bad_ca.exit_code == 4 and "not a PEM certificate" in bad_ca.stderr


def test_a_tenants_stats_and_top_say_admin_only_where_the_daemons_figures_are_left_out(deployment: Deployment
                                                                                        ) -> None:
    """A tenant's Stats carry its namespaces' figures only and leave the daemon-wide activity out as 0
    (tests/test_stats_scope.py): `engram stats` and `engram top` say "admin only" there instead of a 0 that looks
    measured, and JSON rates are null; the admin's output is unchanged."""
    addr, cert = deployment.address, deployment.cert
    for args in (("stats",), ("top", "--once", "-i", "0.1")):
        mine = cli(*args, "-a", addr, token=TEAM_A, ca=cert)
        assert mine.exit_code == 0, mine.output
        assert "admin only" in mine.stdout
        every = cli(*args, "-a", addr, ca=cert)
        assert every.exit_code == 0 and "admin only" not in every.stdout, every.output
    stats = json.loads(cli("stats", "--json", "-a", addr, token=TEAM_A, ca=cert).stdout)
    assert stats["scoped"] and stats["blocks_put"] == 2 and stats["tiers"][0]["blocks"] == 2
    rates = json.loads(cli("top", "--json", "-i", "0.1", "-a", addr, token=TEAM_A, ca=cert).stdout)["rates_per_s"]
    assert rates["lookups"] is None and rates["tiers"]["dram"]["hits"] is None and rates["blocks_put"] == 0.0


def test_engram_token_in_the_environment_of_a_real_cli(deployment: Deployment) -> None:
    """What README says to do, as a user's shell would: ENGRAM_TOKEN (and the daemon's own secrets) exported."""
    out = subprocess.run([*ENGRAM, "ls", "-n", "team-a", "-a", deployment.address, "--tls-ca", str(deployment.cert)],
                         capture_output=True, text=True, timeout=60, cwd=NEUTRAL_CWD,
                         env={**deployment.env, "ENGRAM_TOKEN": TEAM_A})
    assert out.returncode == 0, out.stderr
    assert "chat-1" in out.stdout


@pytest.mark.parametrize("args", [["stats", "--bogus"], ["show"], ["nosuch"], ["ls", "-a", "garbage"],
                                  ["stats", "-a", "host:notaport"], ["top", "-i", "x"], ["bench", "trace", "--bogus"],
                                  ["--bogus"]])
def test_usage_errors_are_bad_input_not_unreachable(args: list[str]) -> None:
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 4, out.output


def test_garbage_address_is_named(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["stats", "-a", "garbage"])
    assert out.exit_code == 4 and "--address 'garbage' is not host:port, [v6addr]:port or unix:" in out.stderr


@pytest.mark.parametrize("command", [["ping"], ["stats"], ["ls"], ["show", "ab12"], ["evict", "ab12"], ["check"]],
                         ids=lambda c: c[0])
def test_a_unix_socket_path_too_long_is_bad_input_not_the_daemons_failure(command: list[str]) -> None:
    """-a unix:<a path past a unix socket's 107 bytes> was "the daemon at ... failed the call: UNKNOWN: Failed to
    create channel ... (its log says more)", exit 10, after gRPC core's error lines (a fuzz audit, session 49):
    `engram serve` refused the same path. Now bad input (exit 4) naming the bound, and nothing from gRPC."""
    address = "unix:/tmp/" + "a" * 120
    out = subprocess.run([*ENGRAM, *command, "-a", address], capture_output=True, text=True, timeout=60,
                         cwd=NEUTRAL_CWD)
    assert out.returncode == 4, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"error: the address {address!r} names a path of 125 bytes, which does not fit a unix socket's 107; use a "
        "shorter path"], out.stderr


def test_readme_tenant_client_line_runs(deployment: Deployment, tmp_path: Path) -> None:
    """README's one-line tenant client (token, namespace, root_cert) against the daemon its TOML configures."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    line = next(b for b in blocks if "root_cert=ca_pem" in b).strip()
    assert line.endswith(": ...")
    body = line.replace("host:50051", deployment.address).removesuffix("...") + \
        "\n        print((await client.describe_namespace()).namespace)"
    script = tmp_path / "tenant.py"
    script.write_text("\n".join(["import asyncio", "from engram.client import EngramClient", f"token = {TEAM_A!r}",
                                 f"ca_pem = open({str(deployment.cert)!r}, 'rb').read()", "",
                                 "async def main() -> None:", f"    {body}", "", "asyncio.run(main())", ""]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=NEUTRAL_CWD)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "team-a"


def test_a_certificate_that_does_not_fit_the_daemon_is_named_not_no_daemon(deployment: Deployment, tmp_path: Path
                                                                          ) -> None:
    """A failed TLS handshake was "no Engram daemon answers ... start one with `engram serve`" (exit 2), after a
    raw line of gRPC's core log on stderr: --tls-ca of another certificate against the TLS daemon, and --tls-ca
    against a plaintext unix socket. Each now names the mismatch (exit 4, bad input), with nothing else on
    stderr: a real `engram` process, as gRPC logs only before its first import in a process."""
    (tmp_path / "other").mkdir()
    other, _ = self_signed_cert(tmp_path / "other")
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}

    def ping(address: str, ca: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ENGRAM, "ping", "-a", address, "--tls-ca", str(ca)], capture_output=True, text=True,
                              timeout=60, cwd=NEUTRAL_CWD, env=env)

    wrong = ping(deployment.address, other)
    assert wrong.returncode == 4, wrong.stderr
    assert wrong.stderr.startswith("error: ") and wrong.stderr.count("\n") == 1, wrong.stderr
    assert "serves TLS with a certificate that --tls-ca" in wrong.stderr and "start one" not in wrong.stderr
    with engram_daemon(tmp_path) as (plain, _):
        mismatch = ping(plain, deployment.cert)
    assert mismatch.returncode == 4, mismatch.stderr
    assert mismatch.stderr.startswith("error: ") and mismatch.stderr.count("\n") == 1, mismatch.stderr
    assert "does not serve TLS" in mismatch.stderr and "leave out --tls-ca" in mismatch.stderr


def test_a_client_without_root_cert_is_told_the_daemon_serves_tls(deployment: Deployment) -> None:
    """A client with no root_cert against a daemon serving TLS failed Unavailable "... Socket closed", and the CLI
    said "no Engram daemon answers" (exit 2). The client now finds that a TLS handshake completes there and says
    the daemon serves TLS and to pass root_cert (the CLI: --tls-ca, exit 4 as the other TLS mismatches). A peer
    that closes connections at once without serving TLS is not said to (the same gRPC words: no guess)."""

    async def stats(address: str) -> str:
        async with EngramClient(address, timeout_s=5) as client:
            with pytest.raises(errors.Unavailable) as failed:
                await client.stats()
            return str(failed.value)

    said = asyncio.run(stats(deployment.address))
    assert "serves TLS" in said and "root_cert" in said, said
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_VERBOSITY", "ENGRAM_TLS_CA")}
    ping = subprocess.run([*ENGRAM, "ping", "-a", deployment.address], capture_output=True, text=True, timeout=60,
                          cwd=NEUTRAL_CWD, env=env)
    assert ping.returncode == 4, ping.stderr
    assert ping.stderr.startswith("error: ") and ping.stderr.count("\n") == 1, ping.stderr
    assert "serves TLS" in ping.stderr and "--tls-ca" in ping.stderr and "start one" not in ping.stderr

    with socket.socket() as closer:  # accepts and closes each connection at once, speaking no TLS
        closer.bind(("127.0.0.1", 0))
        closer.listen()

        def close_each() -> None:
            with contextlib.suppress(OSError):
                while True:
                    closer.accept()[0].close()

        threading.Thread(target=close_each, daemon=True).start()
        other = asyncio.run(stats(f"127.0.0.1:{closer.getsockname()[1]}"))
    assert "serves TLS" not in other, other  # gRPC's "Socket closed", or a reset


def test_a_tenants_ls_without_a_namespace_is_told_to_name_its_own(deployment: Deployment) -> None:
    """`engram ls` without -n lists every tenant's namespaces, an admin's call: a tenant got exit 6 with "call it with
    an admin token", not that `-n NAMESPACE` lists its own (an audit, session 48). It now names the tenant's."""
    denied = cli("ls", "-a", deployment.address, token=TEAM_A, ca=deployment.cert)
    assert denied.exit_code == 6, denied.output
    assert "admin token" in denied.stderr and "-n team-a" in denied.stderr, denied.stderr
    mine = cli("ls", "-n", "team-a", "-a", deployment.address, token=TEAM_A, ca=deployment.cert)
    assert mine.exit_code == 0 and "chat-1" in mine.stdout, mine.output
