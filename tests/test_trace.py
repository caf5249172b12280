"""The trace replayer: formats, the synthetic agent generator, the three policies, and `engram bench trace`."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from engram.cli.main import app
from engram.trace import Request, agent_trace, block_tokens_of, read_trace, replay_all, write_trace


def test_mooncake_lines_and_session_lines_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]}\n'
                    '{"timestamp": 5, "input_length": 1536, "output_length": 3, "hash_ids": [0, 1, 2]}\n')
    reqs = read_trace(path)
    assert reqs[1] == Request(5, (0, 1, 2), 1536, 3)
    synth = agent_trace(sessions=5, turns=3, seed=2)
    write_trace(tmp_path / "s.jsonl", synth)
    assert read_trace(tmp_path / "s.jsonl") == synth


def test_synthetic_agents_share_the_system_prompt_and_fork_their_parents() -> None:
    trace = agent_trace(sessions=20, turns=4, seed=3, system_blocks=4, repo_blocks=12)
    firsts = {r.session: r for r in reversed(trace)}
    assert len({r.hash_ids[:4] for r in trace}) == 1  # every request starts with the same system prompt
    forks = [r for r in trace if r.parent]
    assert forks
    for f in forks:  # a sub-agent's first request extends its parent's prefix (system + repository at least)
        parent_first = firsts[f.parent]
        assert f.hash_ids[:16] == parent_first.hash_ids[:16]
        before = [r.hash_ids for r in trace if r.session == f.parent and r.timestamp < f.timestamp]
        if before:  # forked after the parent's turns: it carries the parent's whole history then
            assert any(f.hash_ids[: len(p)] == p for p in before)
    for s in {r.session for r in trace}:  # histories grow
        lens = [len(r.hash_ids) for r in trace if r.session == s]
        assert lens == sorted(lens)
    assert sum(r.close for r in trace) == 20


def test_prefix_contiguous_hits_are_counted_exactly() -> None:
    trace = [Request(0, (1, 2, 3)), Request(1, (1, 2, 4)), Request(2, (5, 2, 3))]
    for r in replay_all(trace, [100]):
        assert r.hit_blocks == 2, r.policy  # (1, 2) then nothing: block 2 after a miss does not count
    tight = {r.policy: r.hit_blocks for r in replay_all([Request(0, (1, 2, 3)), Request(1, (9,)),
                                                          Request(2, (1, 2, 3))], [3])}
    assert tight["lru"] == 0  # plain LRU dropped block 1, the head: nothing of the chain serves
    assert tight["engram"] == 2  # leaf-first eviction dropped the tail: the head still serves


def test_engram_policy_is_at_least_lru_at_every_capacity_on_agent_traces() -> None:
    trace = agent_trace(sessions=30, turns=6, seed=5)
    results = replay_all(trace, [16, 48, 128, 512])
    by = {(r.policy, r.capacity_blocks): r for r in results}
    for cap in (16, 48, 128, 512):
        assert by[("engram", cap)].hit_blocks >= by[("lru", cap)].hit_blocks
        assert by[("engram", cap)].bytes_moved <= by[("lru", cap)].bytes_moved


def test_bench_trace_cli_prints_every_policy(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, agent_trace(sessions=6, turns=3, seed=1))
    res = CliRunner().invoke(app, ["bench", "trace", str(path), "--capacity", "8,32", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert {(r["policy"], r["capacity_blocks"]) for r in rows} == {(p, c) for p in ("engram", "lru", "belady")
                                                                  for c in (8, 32)}
    bad = CliRunner().invoke(app, ["bench", "trace", str(tmp_path / "missing.jsonl")])
    assert bad.exit_code == 4 and "cannot read the trace" in bad.output


def _best_possible(trace: list[Request], capacity: int) -> int:
    """The most prefix-contiguous hits any cache of `capacity` blocks could get: every choice of what to keep
    after every request (blocks enter only when requested), tried exhaustively."""
    states: dict[frozenset[int], int] = {frozenset(): 0}
    for r in trace:
        nxt: dict[frozenset[int], int] = {}
        for cache, hits in states.items():
            got = 0
            for h in r.hash_ids:
                if h not in cache:
                    break
                got += 1
            pool = sorted(cache | set(r.hash_ids))
            for k in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, k):
                    key = frozenset(keep)
                    nxt[key] = max(nxt.get(key, -1), hits + got)
        states = nxt
    return max(states.values())


def _belady_hits(trace: list[Request], capacity: int) -> int:
    return next(r.hit_blocks for r in replay_all(trace, [capacity]) if r.policy == "belady")


def test_belady_evicts_the_deepest_of_blocks_needed_together() -> None:
    # Blocks 1, 2, 3 are all next needed by the second request. With room for 2, dropping the start (1)
    # loses every hit; dropping the end (3) keeps 2 hits, which is the most possible.
    trace = [Request(0, (1, 2, 3)), Request(1, (1, 2, 3))]
    assert _best_possible(trace, 2) == 2
    assert _belady_hits(trace, 2) == 2
    # Ids need not grow with depth: the rule goes by position in the chain, not by id.
    trace = [Request(0, (9, 5, 1)), Request(1, (9, 5, 1))]
    assert _belady_hits(trace, 2) == 2


def test_belady_is_the_optimum_on_small_chained_traces() -> None:
    rng = random.Random(4)
    for _ in range(60):
        ids: dict[tuple[int, int], int] = {}  # (parent id, content) -> chained id: equal prefixes, equal ids
        fresh = rng.sample(range(1000), 40)  # ids in no order of depth
        trace = []
        for t in range(rng.randint(3, 6)):
            chain_ids, parent = [], -1
            for _ in range(rng.randint(1, 4)):
                parent = ids.setdefault((parent, rng.randrange(2)), fresh[len(ids)])
                chain_ids.append(parent)
            trace.append(Request(t, tuple(chain_ids)))
        for cap in (1, 2, 3):
            assert _belady_hits(trace, cap) == _best_possible(trace, cap), (trace, cap)


def test_belady_bounds_the_other_policies_on_agent_traces() -> None:
    trace = agent_trace(sessions=30, turns=6, seed=5)
    by = {(r.policy, r.capacity_blocks): r.hit_blocks for r in replay_all(trace, [16, 32, 64])}
    for cap in (16, 32, 64):
        assert by[("belady", cap)] >= max(by[("engram", cap)], by[("lru", cap)]), cap


# ---- engram bench trace ------------------------------------------------------------------------------------


def _bench(path: Path, *args: str) -> Any:
    return CliRunner().invoke(app, ["bench", "trace", str(path), *args])


def test_bench_trace_replays_in_timestamp_order_and_warns_when_the_file_is_not(tmp_path: Path) -> None:
    trace = agent_trace(sessions=8, turns=4, seed=2)
    shuffled = list(trace)
    random.Random(1).shuffle(shuffled)
    write_trace(tmp_path / "shuffled.jsonl", shuffled)
    write_trace(tmp_path / "ordered.jsonl", trace)
    want = {(r.policy, r.capacity_blocks): r.hit_blocks for r in replay_all(trace, [8, 32], policies=("lru", "belady"))}
    for name in ("shuffled", "ordered"):
        res = _bench(tmp_path / f"{name}.jsonl", "--capacity", "8,32", "--policy", "lru,belady", "--json")
        assert res.exit_code == 0, res.output
        got = {(r["policy"], r["capacity_blocks"]): r["hit_blocks"] for r in json.loads(res.stdout)}
        assert got == want, name
        late = sum(1 for a, b in itertools.pairwise(shuffled) if b.timestamp < a.timestamp)
        assert (f"warning: {late} of {len(trace)} requests come before" in res.stderr) == (name == "shuffled")


def test_bench_trace_replays_only_the_policies_asked_for(tmp_path: Path) -> None:
    write_trace(tmp_path / "t.jsonl", agent_trace(sessions=4, turns=3, seed=1))
    res = _bench(tmp_path / "t.jsonl", "--capacity", "16", "--policy", "engram,lru", "--json")
    assert res.exit_code == 0, res.output
    assert [r["policy"] for r in json.loads(res.stdout)] == ["engram", "lru"]
    res = _bench(tmp_path / "t.jsonl", "--policy", "lru,fifo")
    assert res.exit_code == 4 and "--policy takes some of engram, lru, belady" in res.output


def test_bench_trace_table_has_exact_counts_two_decimals_and_timings(tmp_path: Path) -> None:
    # 9 blocks requested, 2 hits (see test_prefix_contiguous_hits_are_counted_exactly): 22.22%.
    write_trace(tmp_path / "t.jsonl", [Request(0, (1, 2, 3), 1536), Request(1, (1, 2, 4), 1536),
                                       Request(2, (5, 2, 3), 1536)])
    res = _bench(tmp_path / "t.jsonl", "--capacity", "100", "--policy", "lru")
    assert res.exit_code == 0, res.output
    row = next(line for line in res.stdout.splitlines() if " lru " in line)
    cells = [c.strip() for c in row.strip("│┃ ").split("│")]
    assert cells[:5] == ["100", "lru", "2 / 9", "22.22", f"{7 * 512 * 890 / 1e9:.2f}"]
    assert float(cells[5]) >= 0
    assert "replayed in" in res.stdout
    res = _bench(tmp_path / "t.jsonl", "--capacity", "100", "--policy", "lru", "--json")
    assert json.loads(res.stdout)[0]["seconds"] > 0


def test_bench_trace_takes_the_block_size_from_the_trace(tmp_path: Path) -> None:
    # 64-token blocks: 3 blocks hold 129-192 tokens, 2 hold 65-128.
    write_trace(tmp_path / "t.jsonl", [Request(0, (1, 2, 3), 150), Request(1, (1, 2), 100)])
    res = _bench(tmp_path / "t.jsonl", "--capacity", "10", "--policy", "lru", "--bytes-per-token", "100", "--json")
    row = json.loads(res.stdout)[0]
    assert (row["block_tokens"], row["block_bytes"]) == (64, 6400)
    assert row["bytes_moved"] == 3 * 6400  # 3 misses, then 2 hits
    res = _bench(tmp_path / "t.jsonl", "--capacity", "10", "--policy", "lru", "--block-tokens", "16", "--json")
    assert json.loads(res.stdout)[0]["bytes_moved"] == 3 * 16 * 890
    res = _bench(tmp_path / "t.jsonl", "--capacity", "10", "--policy", "lru", "--block-bytes", "7", "--json")
    assert json.loads(res.stdout)[0]["bytes_moved"] == 21
    write_trace(tmp_path / "bare.jsonl", [Request(0, (1, 2, 3)), Request(1, (1, 2))])  # no input lengths
    res = _bench(tmp_path / "bare.jsonl", "--capacity", "10")
    assert res.exit_code == 4 and "cannot tell the block size" in res.output


def test_block_tokens_are_the_power_of_two_every_request_allows() -> None:
    assert block_tokens_of([Request(0, (1, 2), 1024), Request(1, (1, 2, 3), 1100)]) == 512
    assert block_tokens_of([Request(0, (1, 2), 600), Request(1, (1, 2, 3), 1100)]) == 512  # 300-599 and 367-599
    assert block_tokens_of([Request(0, (1, 2), 1024), Request(1, (1, 2, 3), 2000)]) == 667  # no power of two fits
    assert block_tokens_of([Request(0, (1, 2), 100), Request(1, (1, 2, 3), 1000)]) is None  # they contradict
    assert block_tokens_of([Request(0, (1,), 100)]) is None  # one block says only b >= 100


def test_the_cli_names_the_replayers_policies() -> None:
    """cli/bench.py names the policies itself (importing engram.trace would load numpy at every CLI start)."""
    from engram.cli.bench import POLICIES as CLI_POLICIES
    from engram.trace import POLICIES

    assert CLI_POLICIES == POLICIES
