"""Prefix-contiguous hit ratio of Engram's eviction (the real store) against LRU and Belady (the offline
optimum) on synthetic agent traces, at several capacities, and how much of the gap from LRU to the optimum
Engram closes. Run: .venv/bin/python benchmarks/trace_policy.py [--json | --sweep | --conversations]

--sweep: engram against LRU only (hit blocks), on 12 more trace shapes (seeds 4-7; default, 12 concurrent
sessions with half of them sub-agents, 12 turns of 2-6 blocks) at 16-256 blocks, for checking a policy change
against the previous commit's figures.
--conversations: the chat shape without sessions (synth.conversation_trace), where Engram's order was LRU's.
--mooncake DIR: the public Mooncake traces (conversation_trace.jsonl and synthetic_trace.jsonl from
kvcache-ai/Mooncake's FAST25-release/traces, downloaded into DIR) at 1k / 10k / 100k blocks.
--hints: the agent workloads (`engram trace synth`'s default W64, and BUSY: 68 agents at once whose contexts
outgrow 10k blocks) at 1k / 10k blocks, the store without and with its sessions' back_ms hints (exact, and
with log-normal errors of sigma 0.5 and 1).
--prefetch: W64 over a DRAM tier and an NVMe tier (a stand-in: trace time is not wall time), blocks served from
each with and without prefetching hinted sessions' blocks 1 s before they are due."""

from __future__ import annotations

import json
import sys
from typing import Any

from engram.trace import agent_trace, replay_all
from engram.trace.synth import conversation_trace

CAPACITIES = [32, 64, 128, 256, 512, 1024]


SHAPES: list[dict[str, Any]] = [{}, {"concurrent": 12, "fork_p": 0.5}, {"turns": 12, "turn_blocks": (2, 6)}]


def sweep() -> None:
    below = 0
    for seed in (4, 5, 6, 7):
        for shape in SHAPES:
            trace = agent_trace(sessions=40, seed=seed, **shape)
            res = replay_all(trace, [16, 32, 64, 128, 256], policies=("engram", "lru"))
            for e, lru in zip(res[::2], res[1::2], strict=True):
                below += e.hit_blocks < lru.hit_blocks
                print(json.dumps({"seed": seed, "shape": shape, "capacity": e.capacity_blocks,
                                  "engram": e.hit_blocks, "lru": lru.hit_blocks}))
    print(f"engram below lru in {below} of {len(SHAPES) * 4 * 5}")


def conversations() -> None:
    """The conversation shape (synth.conversation_trace: no sessions, long flat think times), 3 seeds."""
    print("| seed | capacity (blocks) | engram | lru | belady | gap to belady closed |")
    print("|---|---|---|---|---|---|")
    for seed in (1, 2, 3):
        trace = conversation_trace(2000, seed=seed)
        res = replay_all(trace, (300, 1000, 3000))
        for cap in (300, 1000, 3000):
            h = {r.policy: r.hit_ratio for r in res if r.capacity_blocks == cap}
            gap = h["belady"] - h["lru"]
            closed = f"{(h['engram'] - h['lru']) / gap:.0%}" if gap > 0 else "-"
            print(f"| {seed} | {cap} | {100 * h['engram']:.2f}% | {100 * h['lru']:.2f}% | {100 * h['belady']:.2f}% | "
                  f"{closed} |")


def mooncake(directory: str) -> None:
    """The issue's Mooncake-format traces, replayed as `engram bench trace` does (timestamp order, 512-token
    blocks), with the share of the LRU-to-optimum gap the store closes."""
    from pathlib import Path

    from engram.trace import in_time_order, read_trace

    print("| trace | capacity (blocks) | engram | lru | belady | gap closed |")
    print("|---|---|---|---|---|---|")
    for name in ("conversation_trace", "synthetic_trace"):
        trace, _ = in_time_order(read_trace(Path(directory) / f"{name}.jsonl"))
        res = replay_all(trace, (1000, 10000, 100000))
        for cap in (1000, 10000, 100000):
            h = {r.policy: r for r in res if r.capacity_blocks == cap}
            gap = h["belady"].hit_blocks - h["lru"].hit_blocks
            closed = f"{(h['engram'].hit_blocks - h['lru'].hit_blocks) / gap:.0%}" if gap > 0 else "-"
            print(f"| {name} | {cap} | " + " | ".join(f"{100 * h[p].hit_ratio:.2f}% ({h[p].hit_blocks:,})"
                                                      for p in ("engram", "lru", "belady")) + f" | {closed} |")


BUSY: dict[str, Any] = {"sessions": 68, "seed": 3, "turns": (30, 90), "arrival_ms": 3000,
                        "tool_result_blocks": (2, 48), "subagent_p": 0.03}


def hints() -> None:
    """The store with and without sessions' hints of when they are back, on agent workloads."""
    from engram.trace.synth import agent_workload

    print("| workload | capacity (blocks) | lru | belady | engram, no hints | engram, hints sigma 0.5 | "
          "sigma 1 | exact | gap closed (no hints / 0.5 / 1 / exact) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, params in (("W64", {}), ("BUSY", BUSY)):
        base = agent_workload(**params, hint_noise=-1)
        for cap in (1000, 10000):
            h = {r.policy: r for r in replay_all(base, [cap])}
            runs = [h["engram"]] + [replay_all(agent_workload(**params, hint_noise=sigma), [cap],
                                               policies=("engram",))[0] for sigma in (0.5, 1.0, 0.0)]
            gap = h["belady"].hit_blocks - h["lru"].hit_blocks
            closed = " / ".join(f"{(r.hit_blocks - h['lru'].hit_blocks) / gap:.0%}" if gap > 0 else "-"
                                for r in runs)
            cells = [h["lru"], h["belady"], *runs]
            print(f"| {name} | {cap} | " + " | ".join(f"{100 * r.hit_ratio:.2f}%" for r in cells) + f" | {closed} |",
                  flush=True)


def prefetch() -> None:
    """Where a tiered store serves W64's hits from, with and without prefetch by hint."""
    from engram.trace import TierSpec
    from engram.trace.replay import _BT, layout_for
    from engram.trace.synth import agent_workload

    block_bytes = 64 * 890
    nb = layout_for(block_bytes).block_nbytes(_BT)
    print("| hints | DRAM (blocks) | NVMe (blocks) | prefetch lead | hits | from DRAM | from NVMe | NVMe share of hits |")
    print("|---|---|---|---|---|---|---|---|")
    for sigma in (0.5, 0.0):
        trace = agent_workload(hint_noise=sigma)
        for dram in (1000, 3000):
            tiers = [TierSpec("dram", dram * nb), TierSpec("nvme", 10000 * nb)]
            for lead in (0.0, 1000.0):
                r = replay_all(trace, [], block_bytes, policies=("engram",), tiers=tiers, prefetch_lead_ms=lead)[0]
                d, n = (t.hits for t in r.tiers)
                print(f"| sigma {sigma:g} | {dram:,} | 10,000 | {'off' if not lead else f'{lead:g} ms'} | "
                      f"{r.hit_blocks:,} | {d:,} | {n:,} | {n / max(1, r.hit_blocks):.1%} |", flush=True)


def main() -> None:
    if "--prefetch" in sys.argv:
        prefetch()
        return
    if "--hints" in sys.argv:
        hints()
        return
    if "--mooncake" in sys.argv:
        mooncake(sys.argv[sys.argv.index("--mooncake") + 1])
        return
    if "--sweep" in sys.argv:
        sweep()
        return
    if "--conversations" in sys.argv:
        conversations()
        return
    rows = []
    for seed in (1, 2, 3):
        trace = agent_trace(sessions=60, turns=8, seed=seed)
        for r in replay_all(trace, CAPACITIES):
            rows.append({"seed": seed, "policy": r.policy, "capacity": r.capacity_blocks,
                         "hit_ratio": round(r.hit_ratio, 4), "gb_moved": round(r.bytes_moved / 1e9, 3)})
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=2))
        return
    print("| seed | capacity (blocks) | engram | lru | belady | engram / belady | gap to belady closed |")
    print("|---|---|---|---|---|---|---|")
    for seed in (1, 2, 3):
        for cap in CAPACITIES:
            h = {r["policy"]: r["hit_ratio"] for r in rows if r["seed"] == seed and r["capacity"] == cap}
            gap = h["belady"] - h["lru"]
            closed = f"{(h['engram'] - h['lru']) / gap:.0%}" if gap > 0 else "-"
            print(f"| {seed} | {cap} | {h['engram']:.3f} | {h['lru']:.3f} | {h['belady']:.3f} | "
                  f"{h['engram'] / max(h['belady'], 1e-9):.2f} | {closed} |")


if __name__ == "__main__":
    main()
