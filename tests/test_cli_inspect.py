"""`engram ls / show / evict / pin / unpin` against a real daemon subprocess holding known content.

The commands run in this process through Typer's CliRunner (what the user sees: stdout, stderr, exit
code); the daemon is a real `engram serve` on a unix socket, filled with a real client."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import subprocess
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from engram import api
from engram.cli.main import app
from engram.client import SyncEngramClient

from helpers import ENGRAM, NEUTRAL_CWD, engram_daemon, random_kv, tiny_model, tokens


@dataclass
class Content:
    address: str
    fp: bytes
    s1: list[bytes]  # team-a session s1: 64 tokens, 4 full blocks
    s2_own: bytes  # team-a session s2: forked from s1 at 32 tokens, plus one block of its own
    b: list[bytes]  # team-b: 40 tokens, no session (2 full blocks and a partial one)


@pytest.fixture
def content(tmp_path: Path) -> Iterator[Content]:
    with engram_daemon(tmp_path) as (address, _):
        spec = tiny_model()
        toks = tokens(64)
        with SyncEngramClient(address, namespace="team-a") as c:
            fp = c.register_model(spec)
            s1 = list(c.put(fp, toks, random_kv(spec, 64)).keys)
            c.open_session(fp, mode="persist", session_id="s1", tokens=toks)
            c.open_session(fp, mode="persist", session_id="parent-of-s2", tokens=toks)
            c.fork_session("parent-of-s2", session_id="s2", position=32)
            c.close_session("parent-of-s2")
            own = tokens(16, seed=5)
            c.append_session("s2", own, expect_back_ms=4000)  # a tool call's usual time
            s2_keys = c.put(fp, [*toks[:32], *own], random_kv(spec, 48, seed=1)).keys
            assert list(s2_keys[:2]) == s1[:2]
            tb = tokens(40, seed=9)
            b = list(c.put(fp, tb, random_kv(spec, 40, seed=2), namespace="team-b").keys)
        yield Content(address, fp, s1, s2_keys[2], b)


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def as_json(result: Result) -> dict:  # type: ignore[type-arg]
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_ls_lists_namespaces_and_sessions(content: Content) -> None:
    data = as_json(cli("ls", "--json", "-a", content.address))
    ns = {n["namespace"]: n for n in data["namespaces"]}
    assert set(ns) == {"team-a", "team-b"}
    assert (ns["team-a"]["blocks"], ns["team-a"]["tokens"], ns["team-a"]["sessions"]) == (5, 80, 2)
    assert (ns["team-b"]["blocks"], ns["team-b"]["tokens"], ns["team-b"]["sessions"]) == (3, 40, 0)
    assert ns["team-a"]["stored_bytes"] == tiny_model().layout.block_nbytes(16) * 5
    sessions = {s["info"]["session_id"]: s for s in data["sessions"]}
    assert set(sessions) == {"s1", "s2"}
    s1, s2 = sessions["s1"], sessions["s2"]
    assert (s1["info"]["tokens"], s1["cached_tokens"], s1["blocks"], s1["tiers"]) == (64, 64, 4, ["dram"])
    assert (s2["info"]["tokens"], s2["cached_tokens"], s2["blocks"]) == (48, 48, 3)
    assert s1["info"]["mode"] == "persist" and s1["info"]["model_fingerprint"] == content.fp.hex()
    assert s2["info"]["parent"] == "parent-of-s2" and s2["age_s"] >= 0

    table = cli("ls", "-a", content.address)
    assert table.exit_code == 0
    lines = table.stdout.splitlines()
    s1_line = next(line for line in lines if " s1 " in line)
    assert "team-a" in s1_line and "64" in s1_line and "dram" in s1_line and "persist" in s1_line and "cold" in s1_line
    assert any("team-b" in line and " 40 " in line for line in lines)

    only_b = as_json(cli("ls", "--json", "-n", "team-b", "-a", content.address))
    assert only_b == {"sessions": []}


def test_show_session_chain_and_blocks(content: Content) -> None:
    data = as_json(cli("show", "s1", "-n", "team-a", "--json", "-a", content.address))
    assert data["session"]["info"]["session_id"] == "s1"
    blocks = data["blocks"]
    assert [b["key"] for b in blocks] == [k.hex() for k in content.s1]
    assert [b["start_token"] for b in blocks] == [0, 16, 32, 48]
    # Blocks 0 and 1 are shared with s2 (its fork point is 32): two sessions each; block 1 has two children.
    assert [b["sessions"] for b in blocks] == [2, 2, 1, 1]
    assert [b["children"] for b in blocks] == [1, 2, 1, 0]
    assert [b["refcount"] for b in blocks] == [3, 4, 2, 1]
    assert all(b["tiers"] == ["dram"] and b["codec"] == "raw" and re.fullmatch("[0-9a-f]{16}", b["checksum"])
               and b["checksum"] != "0" * 16 and b["pins"] == 0
               for b in blocks)

    # One block by a unique key prefix, found in whichever namespace holds it.
    key = content.b[2].hex()
    one = as_json(cli("show", key[:12], "--json", "-a", content.address))
    assert [b["key"] for b in one["blocks"]] == [key]
    assert one["session"] is None
    b = one["blocks"][0]
    assert (b["namespace"], b["num_tokens"], b["full"], b["parent"], b["start_token"]) == \
        ("team-b", 8, False, content.b[1].hex(), 32)

    table = cli("show", "s2", "-n", "team-a", "-a", content.address)
    assert table.exit_code == 0
    assert "session s2" in table.stdout and "48 cached in 3 blocks" in table.stdout
    assert "its client said back in 4 s" in table.stdout
    assert as_json(cli("show", "s2", "-n", "team-a", "--json", "-a", content.address))["session"]["info"][
        "expect_back_ms"] == 4000
    assert content.s2_own.hex()[:16] in table.stdout


def test_show_unknown_and_ambiguous_names(content: Content) -> None:
    missing = cli("show", "nosuch", "-a", content.address)
    assert missing.exit_code == 3 and "no session 'nosuch'" in missing.stderr and "engram ls" in missing.stderr
    all_keys = [k.hex() for k in (*content.s1, content.s2_own, *content.b)]
    absent = next(p for p in (f"{i:x}" * 6 for i in range(16)) if not any(k.startswith(p) for k in all_keys))
    gone = cli("show", absent, "-a", content.address)
    assert gone.exit_code == 3 and "no session and no block" in gone.stderr
    # Another namespace's block is not found when a namespace is named.
    hidden = cli("show", content.b[0].hex(), "-n", "team-a", "-a", content.address)
    assert hidden.exit_code == 3
    first = [k[0] for k in all_keys]
    shared = next((c for c in first if first.count(c) > 1), None)
    assert shared is not None  # 8 keys of 16 possible first digits: the seeded keys do share one
    ambiguous = cli("show", shared, "-a", content.address)
    assert ambiguous.exit_code == 4 and "give more hex digits" in ambiguous.stderr


def test_pin_blocks_eviction_until_forced_and_closure(content: Content) -> None:
    addr = content.address
    pinned = as_json(cli("pin", content.s1[2].hex()[:16], "--json", "-a", addr))
    assert pinned == {"changed": 1, "keys": [content.s1[2].hex()]}
    shown = as_json(cli("show", content.s1[2].hex(), "--json", "-a", addr))
    assert shown["blocks"][0]["pins"] == 1 and shown["blocks"][0]["refcount"] == 3  # child + s1 + pin

    # Block 1's descendants include the pinned block 2: refused, and nothing is evicted.
    refused = cli("evict", content.s1[1].hex(), "-a", addr)
    assert refused.exit_code == 4 and "pinned" in refused.stderr and "--force" in refused.stderr
    assert as_json(cli("ls", "--json", "-a", addr))["namespaces"][0]["blocks"] == 5

    # Evicting s1 takes only the blocks no other session uses (2 and 3), pinned 2 only with --force.
    assert cli("evict", "--session", "s1", "-n", "team-a", "-a", addr).exit_code == 4
    out = as_json(cli("evict", "--session", "s1", "-n", "team-a", "--force", "--json", "-a", addr))
    assert out["evicted"] == [content.s1[3].hex(), content.s1[2].hex()] and out["unpinned"] == 1
    s1 = as_json(cli("show", "s1", "-n", "team-a", "--json", "-a", addr))
    assert s1["session"]["cached_tokens"] == 32 and len(s1["blocks"]) == 2

    # Evicting block 0 evicts what extends it: block 1 and s2's own block.
    out = as_json(cli("evict", content.s1[0].hex(), "--json", "-a", addr))
    assert set(out["evicted"]) == {content.s1[0].hex(), content.s1[1].hex(), content.s2_own.hex()}
    assert out["evicted"][-1] == content.s1[0].hex()  # the root goes last: no block is ever orphaned

    text = cli("evict", "--whole-namespace", "-n", "team-b", "-a", addr)
    assert text.exit_code == 0 and "evicted 3 blocks" in text.stdout
    listing = as_json(cli("ls", "--json", "-a", addr))
    assert {n["namespace"]: n["blocks"] for n in listing["namespaces"]} == {"team-a": 0}
    stats = as_json(cli("stats", "--json", "-a", addr))
    assert int(stats["blocks_evicted_on_request"]) == 8 and int(stats["tiers"][0]["blocks"]) == 0


def test_pins_count_and_unpin(content: Content) -> None:
    addr = content.address
    assert as_json(cli("pin", "--session", "s2", "-n", "team-a", "--json", "-a", addr))["changed"] == 3
    assert as_json(cli("pin", content.s1[0].hex(), "--json", "-a", addr))["changed"] == 1
    stats = as_json(cli("stats", "--json", "-a", addr))
    assert int(stats["tiers"][0]["pinned_blocks"]) == 3  # s1[0] twice: pins count, blocks do not
    first = as_json(cli("show", content.s1[0].hex(), "--json", "-a", addr))["blocks"][0]
    assert first["pins"] == 2
    out = cli("unpin", content.s1[0].hex(), content.s2_own.hex(), "-a", addr)
    assert out.exit_code == 0 and "unpinned 2 of 2 blocks" in out.stdout
    again = cli("unpin", content.s2_own.hex(), "-a", addr)
    assert "unpinned 0 of 1 blocks" in again.stdout
    assert as_json(cli("show", content.s1[0].hex(), "--json", "-a", addr))["blocks"][0]["pins"] == 1


def test_bad_input_names_what_to_change(content: Content) -> None:
    addr = content.address
    none = cli("evict", "-a", addr)
    assert none.exit_code == 4 and "name what to evict" in none.stderr
    assert "--namespace" in cli("evict", "--whole-namespace", "-a", addr).stderr
    typo = cli("evict", "--whole-namespace", "-n", "team-aa", "-a", addr)  # as a key prefix matching nothing
    assert typo.exit_code == 3 and "'team-aa' holds no blocks" in typo.stderr
    bad = cli("evict", "xyz!", "-a", addr)
    assert bad.exit_code == 4 and "not a hex block key" in bad.stderr
    assert cli("pin", "-a", addr).exit_code == 4
    assert cli("show", "s1", "-n", "default", "-a", addr).exit_code == 3  # s1 lives in team-a


def test_show_finds_a_session_without_its_namespace_when_only_one_has_it(content: Content) -> None:
    addr = content.address
    assert as_json(cli("show", "s1", "--json", "-a", addr))["session"]["info"]["namespace"] == "team-a"
    assert cli("pin", "--session", "s1", "-a", addr).exit_code == 0
    assert as_json(cli("show", content.s1[3].hex(), "--json", "-a", addr))["blocks"][0]["pins"] == 1
    with SyncEngramClient(addr, namespace="team-b") as c:  # now a second s1, in team-b
        c.register_model(tiny_model())
        c.open_session(content.fp, mode="persist", session_id="s1", tokens=tokens(16, seed=9))
    both = cli("show", "s1", "-a", addr)
    assert both.exit_code == 4 and "namespaces team-a, team-b" in both.stderr and "--namespace" in both.stderr
    assert as_json(cli("show", "s1", "-n", "team-b", "--json", "-a", addr))["session"]["info"]["tokens"] == 16


@pytest.mark.parametrize("command", [["ls"], ["show", "s1"], ["evict", "ab12"], ["pin", "ab12"], ["unpin", "ab12"]])
def test_unreachable_daemon(tmp_path: Path, command: list[str]) -> None:
    out = cli(*command, "-a", f"unix:{tmp_path / 'nobody.sock'}")
    assert out.exit_code == 2 and "no Engram daemon answers" in out.stderr


def test_stats_reports_tokens_per_tier(content: Content) -> None:
    stats = as_json(cli("stats", "--json", "-a", content.address))
    dram = stats["tiers"][0]
    assert int(dram["tokens"]) == 64 + 16 + 40
    assert int(dram["used_bytes"]) == tiny_model().layout.block_nbytes(16) * 7 + tiny_model().layout.block_nbytes(8)
    table = cli("stats", "-a", content.address)
    per_token = tiny_model().layout.bytes_per_token()
    assert table.exit_code == 0 and f" {per_token} " in table.stdout


def conforms(value: object, tp: typing.Any, where: str) -> None:
    """value is what cli/format.py makes of an engram.api value of type tp (docs/JSON.md): every field present
    and no other, integers as JSON numbers, bytes as hex, checksums as 16 hex digits, enums by their value."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        assert isinstance(value, dict), where
        hints = typing.get_type_hints(tp)
        assert set(value) == set(hints), f"{where}: {sorted(set(value) ^ set(hints))}"
        for name, sub in hints.items():
            if name == "checksum":
                assert isinstance(value[name], str) and re.fullmatch("[0-9a-f]{16}", value[name]), where
            else:
                conforms(value[name], sub, f"{where}.{name}")
    elif origin in (typing.Union, types.UnionType):
        assert any(_ok(value, a, where) for a in args), f"{where}: {value!r} is none of {args}"
    elif origin is tuple:
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            conforms(item, args[0], f"{where}[{i}]")
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        assert value in [m.value for m in tp], f"{where}: {value!r}"
    elif tp is bytes:
        assert isinstance(value, str) and re.fullmatch("([0-9a-f]{2})*", value), f"{where}: {value!r}"
    elif tp is bool:
        assert isinstance(value, bool), where
    elif tp is int:
        assert isinstance(value, int) and not isinstance(value, bool), f"{where}: {value!r} is not an integer"
    elif tp is float:
        assert isinstance(value, int | float) and not isinstance(value, bool), f"{where}: {value!r}"
    elif tp is str:
        assert isinstance(value, str), where
    elif tp is type(None):
        assert value is None, where
    else:
        raise AssertionError(f"{where}: no rule for {tp}")


def _ok(value: object, tp: typing.Any, where: str) -> bool:
    try:
        conforms(value, tp, where)
    except AssertionError:
        return False
    return True


def test_json_output_follows_the_api_dataclasses(content: Content) -> None:
    addr = content.address
    conforms(as_json(cli("stats", "--json", "-a", addr)), api.Stats, "stats")
    listing = as_json(cli("ls", "--json", "-a", addr))
    assert set(listing) == {"namespaces", "sessions"}
    conforms(listing["namespaces"], tuple[api.NamespaceSummary, ...], "ls.namespaces")
    conforms(listing["sessions"], tuple[api.SessionSummary, ...], "ls.sessions")
    assert {s["info"]["mode"] for s in listing["sessions"]} == {"persist"}  # the enum's value, not PERSIST
    conforms(as_json(cli("show", "s1", "--json", "-a", addr)), api.BlockDescription, "show")
    conforms(as_json(cli("show", content.b[0].hex(), "--json", "-a", addr)), api.BlockDescription, "show block")
    frame = as_json(cli("top", "--json", "-i", "0.05", "-a", addr))
    conforms(frame["stats"], api.Stats, "top.stats")
    conforms(frame["sessions"], tuple[api.SessionSummary, ...], "top.sessions")
    assert all(isinstance(v, float) for k, v in frame["rates_per_s"].items() if k != "tiers")
    conforms(as_json(cli("evict", content.b[2].hex(), "--json", "-a", addr)), api.EvictResult, "evict")
    pinned = as_json(cli("pin", content.s1[0].hex(), "--json", "-a", addr))
    assert pinned == {"changed": 1, "keys": [content.s1[0].hex()]}
    forgot = as_json(cli("models", "forget", content.fp.hex(), "--force", "--json", "-a", addr))  # the last one
    conforms(forgot, api.ForgetResult, "models forget")


def test_piped_tables_keep_whole_keys(content: Content) -> None:
    """Piped (not a terminal), the tables are as wide as they need: no column is cut with an ellipsis."""
    long_id = "agent-run-" + "0123456789abcdef" * 6
    with SyncEngramClient(content.address, namespace="team-a-with-a-rather-long-name") as c:
        fp = c.register_model(tiny_model())
        c.open_session(fp, mode="persist", session_id=long_id, tokens=tokens(16))
    for args in (["ls"], ["show", "s1"], ["stats"]):
        out = subprocess.run([*ENGRAM, *args, "-a", content.address], capture_output=True, text=True, timeout=60,
                             cwd=NEUTRAL_CWD)
        assert out.returncode == 0 and "…" not in out.stdout, out.stdout
        if args == ["ls"]:
            assert long_id in out.stdout
        if args == ["show", "s1"]:
            assert all(k.hex()[:16] in out.stdout for k in content.s1)


def test_tokens_a_grpc_header_cannot_carry_and_endless_intervals_are_bad_input(content: Content, tmp_path: Path) -> None:
    """A token with a CRLF ending (read from a file) or a non-ASCII character failed deep in gRPC with a
    traceback; `top --json -i inf` never ended; verify-isolation took a missing --tls-ca file for a traceback
    (exit 1, its "leak found" code) and a bad address for an unreachable daemon. Each is exit 4 with a line."""
    addr = content.address
    for token in ("tok\r", "tök", "a b"):
        out = cli("stats", "-a", addr, "--token", token)
        assert out.exit_code == 4 and "printable ASCII" in out.stderr and "Traceback" not in out.stderr
    endless = cli("top", "--json", "-i", "inf", "-a", addr)
    assert endless.exit_code == 4 and "--interval" in endless.stderr
    live = ["verify-isolation", "--token", "a", "--other-token", "b"]
    missing = cli(*live, "-a", addr, "--tls-ca", str(tmp_path / "absent.pem"))
    assert missing.exit_code == 4 and "--tls-ca" in missing.stderr
    assert cli(*live, "-a", "notanaddress").exit_code == 4


def test_a_call_the_daemon_fails_itself_is_not_reported_as_no_daemon(content: Content) -> None:
    """INTERNAL (a daemon's bug) was Unavailable, and the CLI said "no Engram daemon answers ... start one" with
    exit 2 while the daemon ran: it is a DaemonError, shown with the daemon's message, exit 10. A daemon that
    does not answer is still exit 2, with the reason."""
    import grpc

    from engram import errors as engram_errors
    from engram.cli.common import EXIT_DAEMON_ERROR, Target, call
    from engram.wire.status import error_from_rpc

    internal = error_from_rpc(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(),
                                                   grpc.aio.Metadata(), details="Is a directory"))
    assert isinstance(internal, engram_errors.DaemonError) and isinstance(internal, engram_errors.Unavailable)
    down = error_from_rpc(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               details="connection refused"))
    assert type(down) is engram_errors.Unavailable

    async def fails(_: object) -> None:
        raise internal

    with pytest.raises(typer.Exit) as info:
        call(Target(content.address, "", None), fails)
    assert info.value.exit_code == EXIT_DAEMON_ERROR


def test_a_tenant_without_namespace_finds_its_blocks_and_sessions_in_each_of_its_namespaces(tmp_path: Path) -> None:
    """A token of two namespaces: `show`, `pin`, `evict` and `top` without -n looked only in its first one (or
    were refused: all_namespaces is an admin's), so a session or block in the second was "not found" (exit 3)
    or "denied" (exit 6). They now look in each of the token's namespaces; another tenant's stay out of reach."""
    env = {"ENGRAM_AUTH__TENANTS__BOB__TOKEN": "bob-token", "ENGRAM_AUTH__TENANTS__BOB__NAMESPACES": "bob,bob-ci",
           "ENGRAM_AUTH__TENANTS__EVE__TOKEN": "eve-token", "ENGRAM_AUTH__SALT_SECRET": "s"}
    with engram_daemon(tmp_path, env=env) as (addr, _):
        spec = tiny_model()
        with SyncEngramClient(addr, token="bob-token", namespace="bob-ci") as c:
            fp = c.register_model(spec)
            toks = tokens(32, seed=4)
            keys = list(c.put(fp, toks, random_kv(spec, 32)).keys)
            c.open_session(fp, mode="persist", session_id="ci-run", tokens=toks)
        with SyncEngramClient(addr, token="bob-token", namespace="bob") as c:
            c.register_model(spec)
            c.put(fp, tokens(16, seed=5), random_kv(spec, 16))  # his first namespace holds something too
        bob = ("-a", addr, "--token", "bob-token")
        shown = as_json(cli("show", "ci-run", "--json", *bob))
        assert shown["session"]["info"]["namespace"] == "bob-ci"
        assert as_json(cli("show", keys[1].hex(), "--json", *bob))["blocks"][0]["namespace"] == "bob-ci"
        assert cli("pin", keys[1].hex(), *bob).exit_code == 0
        top = as_json(cli("top", "--json", "-i", "0.1", *bob))
        assert [s["info"]["session_id"] for s in top["sessions"]] == ["ci-run"]
        evicted = as_json(cli("evict", keys[1].hex(), "--force", "--json", *bob))
        assert {bytes.fromhex(k) for k in evicted["evicted"]} == {keys[1]}
        eve = ("-a", addr, "--token", "eve-token")
        assert cli("show", keys[0].hex(), *eve).exit_code == 3 and cli("evict", keys[0].hex(), *eve).exit_code == 3


@dataclass
class TwoNamespaces:
    """A tenant whose token covers alice and alice-ci, each holding 32-token puts (2 blocks: a root and its leaf),
    and a share of pinned bytes of three of those blocks (13,421 bytes)."""

    tenant: tuple[str, ...]  # the CLI's -a and --token
    a: list[bytes]  # in alice
    c: list[bytes]  # in alice-ci
    d: list[bytes]  # in alice-ci


@pytest.fixture
def two_namespaces(tmp_path: Path) -> Iterator[TwoNamespaces]:
    env = {"ENGRAM_AUTH__TENANTS__ALICE__TOKEN": "alice-token", "ENGRAM_AUTH__SALT_SECRET": "s",
           "ENGRAM_AUTH__TENANTS__ALICE__NAMESPACES": "alice,alice-ci",
           "ENGRAM_SERVER__MAX_PINNED_FRACTION_PER_TENANT": "0.0002"}  # of 64 MiB: 13,421 bytes
    with engram_daemon(tmp_path, env=env) as (addr, _):
        spec = tiny_model()
        with SyncEngramClient(addr, token="alice-token", namespace="alice") as client:
            fp = client.register_model(spec)

            def put(seed: int, namespace: str) -> list[bytes]:
                return list(client.put(fp, tokens(32, seed=seed), random_kv(spec, 32, seed=seed),
                                       namespace=namespace).keys)

            yield TwoNamespaces(("-a", addr, "--token", "alice-token"), put(1, "alice"), put(2, "alice-ci"),
                                put(3, "alice-ci"))


def test_a_refused_evict_over_two_namespaces_evicts_nothing_where_a_pin_is_seen(two_namespaces: TwoNamespaces
                                                                                ) -> None:
    """A tenant's evict of keys in two namespaces is one call per namespace; alice's went first and was done
    when alice-ci's was refused (a pinned block), and the command said only "refused" (exit 4). The namespace
    whose call a named block's pin (or descendants) may refuse now goes first: refused, nothing evicted."""
    t, shown = two_namespaces, lambda key: cli("show", key.hex(), *two_namespaces.tenant)
    assert cli("pin", t.c[1].hex(), *t.tenant).exit_code == 0
    for named in ([t.a[1], t.c[1]], [t.a[1], t.c[0]]):  # the pinned block itself; its parent, pinned below
        refused = cli("evict", *(k.hex() for k in named), *t.tenant)
        assert refused.exit_code == 4 and "pinned" in refused.stderr, refused.output
        assert shown(t.a[1]).exit_code == 0  # alice's block is still there
    forced = as_json(cli("evict", t.a[1].hex(), t.c[1].hex(), "--force", "--json", *t.tenant))
    assert set(forced["evicted"]) == {t.a[1].hex(), t.c[1].hex()} and forced["unpinned"] == 1


def test_an_evict_refused_part_way_says_what_it_evicted_with_its_own_exit_code(two_namespaces: TwoNamespaces
                                                                               ) -> None:
    """Both namespaces' named blocks have descendants, which a tenant cannot list: the first call evicts, the
    second is refused (a pinned descendant). Exit 11, the evicted blocks listed, and the refusal saying so."""
    t = two_namespaces
    assert cli("pin", t.c[1].hex(), *t.tenant).exit_code == 0
    out = cli("evict", t.a[0].hex(), t.c[0].hex(), *t.tenant)
    assert out.exit_code == 11, out.output
    assert "evicted 2 blocks" in out.stdout and t.a[0].hex() in out.stdout and t.a[1].hex() in out.stdout
    assert "pinned" in out.stderr and "refused part-way" in out.stderr and "namespace 'alice'" in out.stderr
    assert cli("show", t.a[0].hex(), *t.tenant).exit_code == 3 and cli("show", t.c[0].hex(), *t.tenant).exit_code == 0


def test_a_pin_over_two_namespaces_refused_by_the_share_pins_nothing(two_namespaces: TwoNamespaces) -> None:
    """Pin checks the tenant's share per call: alice's root (4 KiB) fitted and was pinned, alice-ci's then passed
    the share and the command was refused (exit 4) with alice's pin left. The earlier calls' pins are lifted."""
    t = two_namespaces

    def pins(key: bytes) -> int:
        return int(as_json(cli("show", key.hex(), "--json", *t.tenant))["blocks"][0]["pins"])

    assert cli("pin", t.c[1].hex(), *t.tenant).exit_code == 0  # 8 KiB of 13,421 bytes: c[1] and its parent
    assert cli("pin", t.a[0].hex(), *t.tenant).exit_code == 0  # pinned once already: a pin counts
    refused = cli("pin", t.a[0].hex(), t.d[0].hex(), *t.tenant)
    assert refused.exit_code == 4 and "share" in refused.stderr, refused.output
    assert pins(t.a[0]) == 1 and pins(t.d[0]) == 0


def test_show_of_an_empty_name_is_bad_input(content: Content) -> None:
    """`engram show ""` was "no session ''" (exit 3, not found): an empty name names nothing, exit 4."""
    for name in ("", " "):
        out = cli("show", name, "-a", content.address)
        assert out.exit_code == 4 and "empty name" in out.stderr, out.output


def test_ls_and_stats_of_a_namespace_holding_nothing_agree(content: Content) -> None:
    """`ls -n nosuch` printed an empty table (exit 0) where `stats -n nosuch` said not found (exit 3): a typo
    looked like a namespace without sessions. Both exit 3 with one message; a namespace of blocks alone (team-b)
    still lists its (no) sessions."""
    listed, stated = (cli(command, "-n", "nosuch", "-a", content.address) for command in ("ls", "stats"))
    assert listed.exit_code == stated.exit_code == 3, listed.output
    assert listed.stderr == stated.stderr and "holds nothing this caller may see" in listed.stderr
    assert as_json(cli("ls", "--json", "-n", "team-b", "-a", content.address)) == {"sessions": []}
