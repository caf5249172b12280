"""Block accesses per second of the trace replayer's engram policy (the real BlockStore, ChainIndex, eviction order
and Placement), on a synthetic agent trace of about 100k block accesses, at a few capacities in blocks.
Runs against whatever `engram` is importable, so the same command times an older tree with
PYTHONPATH=that/tree. --profile: cProfile of the first capacity's run, top functions by own time.
--workload: the agent workload generator's trace (engram.trace.synth.agent_workload) instead of agent_trace;
--file: a trace file (so an older tree without the generator replays the same trace).
Timed twice: the whole replay_all call (with the trace's ids made global and its keys hashed, once per call), and
the run alone (PolicyResult.seconds: the replay through the store). Prints whether the store's modules run compiled
(engram/compiled.py). Blocks weigh 64 x 890 bytes (64 tokens of an FP4 global KV; the engram run's capacity is in
blocks, so the size changes no decision). --policy lru or belady times the replayer's plain simulators instead.
Prints the process's peak resident memory (the trace included), and each call's CPU time (this process's: on a
machine other jobs load, it moves less than the wall time does). Run: .venv/bin/python benchmarks/trace_speed.py
[--workload] [--sessions N] [--capacity 32,256,4096] [--policy engram] [--profile] [--json]"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import time

from engram.trace import agent_trace, replay_all


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=None, help="default 400 (agent_trace), 6 (--workload)")
    ap.add_argument("--capacity", default="32,256,4096")
    ap.add_argument("--workload", action="store_true")
    ap.add_argument("--file", help="replay this trace file instead (e.g. one `engram trace synth` wrote)")
    ap.add_argument("--policy", default="engram", choices=("engram", "lru", "belady"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.file:
        from engram.trace import read_trace

        trace = read_trace(args.file)
    elif args.workload:
        from engram.trace.synth import agent_workload

        trace = agent_workload(sessions=args.sessions or 6, seed=1)
    else:
        trace = agent_trace(sessions=args.sessions or 400, turns=8, seed=1)
    accesses = sum(len(r.hash_ids) for r in trace)
    caps = [int(c) for c in args.capacity.split(",")]
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(replay_all, trace, caps[:1], 64 * 890, policies=(args.policy,))
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    rows = []
    for cap in caps:
        t0, c0 = time.perf_counter(), time.process_time()
        r = replay_all(trace, [cap], 64 * 890, policies=(args.policy,))[0]
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        rows.append({"capacity": cap, "requests": len(trace), "accesses": accesses, "hit_blocks": r.hit_blocks,
                     "seconds": round(dt, 3), "accesses_per_s": round(accesses / dt), "cpu_seconds": round(cpu, 3),
                     "replay_seconds": round(r.seconds, 3), "replay_accesses_per_s": round(accesses / r.seconds)})
    from engram import compiled

    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # Linux: KiB

    if args.json:
        print(json.dumps({"store": compiled.summary(), "policy": args.policy, "rows": rows,
                          "peak_rss_mb": peak_mb}, indent=2))
        return
    print(f"policy {args.policy}; the store's modules: {compiled.summary()}; peak resident memory {peak_mb} MB")
    for row in rows:
        print(f"{row['capacity']:>6} blocks: {row['requests']} requests, {row['accesses']} accesses, "
              f"{row['hit_blocks']} hits, {row['seconds']:.2f} s, {row['accesses_per_s']:,} accesses/s; the run "
              f"alone {row['replay_seconds']:.2f} s, {row['replay_accesses_per_s']:,}/s; the call's CPU time "
              f"{row['cpu_seconds']:.2f} s")


if __name__ == "__main__":
    main()
