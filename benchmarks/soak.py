"""Soak: 32 clients mixing put, get, lookup, resume, pin and evict against one daemon for a long time; the
daemon's memory, open files, leases, pins and sessions must stay bounded, and no byte may come back wrong.

The daemon is a real `engram serve` subprocess (DRAM + NVMe write-back, a replay model for Resume, a small
DRAM tier so demotion, promotion and eviction run all the time). Each client (its own channel) loops over
a random mix: put a sequence from a bounded pool (they share a system prompt, so prefixes are shared and
deduplicated), get a prefix back and compare every byte, look one up, open a session on one and Resume it
(replay against the stored global KV; the KV is read back and compared too), pin and unpin, evict a
sequence's last block. Every `--sample-s` it records the daemon's RSS, open files, leases, pinned blocks,
sessions, hot windows, ops/s and p99 latency of the interval.

Bounded means, after the warm-up (the first fifth of the run, at least 10 s): RSS at most 10% + 64 MiB over
its value at the end of the warm-up, open files at most 16 over it, leases, pinned blocks and sessions never
above what 32 clients can hold at once (each holds at most one pin, one session, one Get's leases). Expected
errors of a cache under concurrent eviction (a parent evicted between Lookup and Put: FAILED_PRECONDITION;
a block evicted between Lookup and Get: NOT_FOUND) are counted, not failures; anything else is.

    .venv/bin/python -m benchmarks.soak [--seconds 1800] [--clients 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks._harness import _wait_health, machine
from engram import errors
from engram.client import EngramClient

BT = 16
POOL = 64  # sequences per client
EXPECTED = (errors.FailedPrecondition, errors.NotFound)


@dataclass
class Sample:
    t: float
    rss_mib: float
    open_files: int
    leases: int
    pinned_blocks: int
    sessions: int
    hot_windows: int
    dram_used_mib: float
    nvme_blocks: int
    pending_blocks: int  # held only in DRAM: what a crash now would lose (the write-back window)
    flushed: int
    ops_per_s: float
    p99_ms: float


@dataclass
class Result:
    seconds: float
    clients: int
    ops: Counter[str] = field(default_factory=Counter)
    expected_errors: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    wrong_bytes: int = 0
    samples: list[Sample] = field(default_factory=list)
    bounded: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.wrong_bytes and all(self.bounded.values())


class Workload:
    """The model, the replay model and the sequences the clients put (seeded: every client rebuilds them)."""

    def __init__(self, tmp: Path) -> None:
        from engram.replay import HybridConfig, HybridDecoder, gpt_oss_pattern, save_decoder
        from engram.replay.runtime import model_spec_for

        self.model = HybridDecoder(HybridConfig(layers=gpt_oss_pattern(4), window=8, dtype=torch.float32, seed=3))
        self.path = tmp / "replay.safetensors"
        save_decoder(self.model, self.path)
        self.spec = model_spec_for(self.model, block_tokens=BT, codec="raw")
        self.system = np.random.default_rng(0).integers(0, 256, 3 * BT, dtype=np.int32)  # a shared prompt
        self._kv: dict[tuple[int, int], tuple[np.ndarray, torch.Tensor]] = {}

    def sequence(self, client: int, i: int) -> tuple[np.ndarray, torch.Tensor]:
        key = (client, i)
        if key not in self._kv:
            rng = np.random.default_rng(client * 1000 + i)
            tail = rng.integers(0, 256, int(rng.integers(BT // 2, 4 * BT)), dtype=np.int32)
            toks = np.concatenate([self.system, tail])
            res = self.model.prefill(torch.as_tensor(toks, dtype=torch.long), logits=False)
            kv = torch.stack([torch.stack((k, v)) for k, v in res.global_kv])
            self._kv[key] = (toks, kv)
        return self._kv[key]


def daemon_rss_and_files(pid: int) -> tuple[float, int]:
    rss = 0.0
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


async def client_loop(c: int, address: str, work: Workload, deadline: float, res: Result,
                      latencies: list[float], rng: random.Random) -> None:
    async with EngramClient(address, namespace="soak") as client:
        fp = await client.register_model(work.spec)
        pinned: list[bytes] = []
        while time.monotonic() < deadline:
            op = rng.choices(["put", "get", "lookup", "resume", "pin", "evict"], [35, 25, 15, 10, 10, 5])[0]
            toks, kv = work.sequence(c, rng.randrange(POOL))
            t0 = time.perf_counter()
            try:
                if op == "put":
                    await client.put(fp, toks, kv)
                elif op == "get":
                    n, got = await client.get_prefix(fp, toks)
                    if n and not torch.equal(got, kv[:, :, :n]):
                        res.wrong_bytes += 1
                elif op == "lookup":
                    await client.lookup(fp, toks)
                elif op == "resume":
                    await client.put(fp, toks, kv)
                    sid = (await client.open_session(fp, mode="exact", tokens=toks)).session_id
                    try:
                        r, global_kv = await client.resume_kv(fp, sid)
                        if not torch.equal(global_kv, kv[:, :, : r.position]):
                            res.wrong_bytes += 1
                    finally:
                        await client.close_session(sid)
                elif op == "pin":
                    if pinned:
                        await client.pin(fp, pinned, unpin=True)
                        pinned = []
                    else:
                        hit = await client.lookup(fp, toks)
                        if hit.blocks:
                            await client.pin(fp, [hit.blocks[0].key])
                            pinned = [hit.blocks[0].key]
                else:
                    hit = await client.lookup(fp, toks)
                    # Only this sequence's own last block: evicting a block evicts its descendants, and the
                    # shared prompt's blocks are every sequence's ancestors.
                    if len(hit.blocks) > len(work.system) // BT and hit.blocks[-1].key not in pinned:
                        await client.evict(key_prefixes=[hit.blocks[-1].key.hex()])
                res.ops[op] += 1
                latencies.append(time.perf_counter() - t0)
            except EXPECTED as exc:
                res.expected_errors[f"{op}: {type(exc).__name__}"] += 1
            except Exception as exc:  # every unexpected error is a finding of the soak
                res.failures.append(f"client {c} {op}: {type(exc).__name__}: {exc}")
                if len(res.failures) > 50:
                    return  # enough to go on; the verdict fails
        if pinned:
            await client.pin(fp, pinned, unpin=True)


async def sampler(pid: int, address: str, t0: float, deadline: float, every: float, res: Result,
                  latencies: list[float]) -> None:
    async with EngramClient(address, namespace="soak") as client:
        last_ops = 0
        while time.monotonic() < deadline:
            await asyncio.sleep(every)
            rss, files = daemon_rss_and_files(pid)
            st = await client.stats()
            ops = sum(res.ops.values())
            lat = sorted(latencies)
            latencies.clear()
            res.samples.append(Sample(
                t=time.monotonic() - t0, rss_mib=rss, open_files=files, leases=st.leases,
                pinned_blocks=sum(t.pinned_blocks for t in st.tiers), sessions=st.replay.sessions,
                hot_windows=st.replay.hot_sessions, dram_used_mib=st.tier("dram").used_bytes / 2**20,
                nvme_blocks=st.tier("nvme").blocks, pending_blocks=st.write_back_pending_blocks,
                flushed=st.blocks_flushed, ops_per_s=(ops - last_ops) / every,
                p99_ms=lat[int(0.99 * (len(lat) - 1))] * 1e3 if lat else 0.0))
            last_ops = ops


def judge(res: Result, clients: int, warmup_s: float) -> None:
    after = [s for s in res.samples if s.t >= warmup_s]
    if not after:
        res.bounded["samples after warm-up"] = False
        return
    base = after[0]
    res.bounded["rss"] = max(s.rss_mib for s in after) <= base.rss_mib * 1.10 + 64
    res.bounded["open files"] = max(s.open_files for s in after) <= base.open_files + 16
    res.bounded["leases"] = max(s.leases for s in res.samples) <= clients * 8
    res.bounded["pinned blocks"] = max(s.pinned_blocks for s in res.samples) <= clients
    res.bounded["sessions"] = max(s.sessions for s in res.samples) <= clients


async def run(seconds: float, clients: int, sample_s: float, extra: list[str]) -> Result:
    res = Result(seconds, clients)
    with tempfile.TemporaryDirectory(prefix="engram-soak-") as tmp_s:
        tmp = Path(tmp_s)
        work = Workload(tmp)
        sock = tmp / "e.sock"
        # Small tiers, so the store reaches its steady state early: demotion, promotion and eviction all the time.
        cmd = [sys.executable, "-m", "engram", "serve", "--unix-socket", str(sock), "--log-level", "warning",
               "--dram-capacity", "2MiB", "--set", f"tiers.nvme.path={tmp / 'nvme'}", "--set",
               "tiers.nvme.capacity=16MiB", "--set", f"replay.models={work.path}", "--set", "server.lease_s=5", *extra]
        log = open(tmp / "daemon.log", "w")  # noqa: SIM115 - closed in finally
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        try:
            _wait_health(f"unix:{sock}", proc, timeout=120)
            for c in range(clients):  # build every client's sequences before the clock starts
                for i in range(POOL):
                    work.sequence(c, i)
            t0 = time.monotonic()
            deadline = t0 + seconds
            latencies: list[float] = []
            rngs = [random.Random(c) for c in range(clients)]
            await asyncio.gather(sampler(proc.pid, f"unix:{sock}", t0, deadline, sample_s, res, latencies),
                                 *(client_loop(c, f"unix:{sock}", work, deadline, res, latencies, rngs[c])
                                   for c in range(clients)))
            async with EngramClient(f"unix:{sock}", namespace="soak") as client:
                st = await client.stats()
                if sum(t.pinned_blocks for t in st.tiers) or st.replay.sessions:
                    res.failures.append(f"after the run: {sum(t.pinned_blocks for t in st.tiers)} pinned blocks, "
                                        f"{st.replay.sessions} sessions left (every client released its own)")
                if (await client.check(fix=False)).findings:
                    res.failures.append("check found problems after the run")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
            log.close()
            if res.failures:
                res.failures += ["daemon log: " + line for line in (tmp / "daemon.log").read_text().splitlines()[-30:]]
    judge(res, clients, max(10.0, seconds / 5))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1800)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--set", action="append", default=[], help="extra daemon config, key=value")
    ap.add_argument("--json", help="write the samples and the verdict here")
    args = ap.parse_args()
    res = asyncio.run(run(args.seconds, args.clients, args.sample_s, [a for s in args.set for a in ("--set", s)]))
    print(f"# soak: {datetime.date.today()} on {machine()}; {args.clients} clients for {args.seconds:g} s\n")
    print("| t s | RSS MiB | open files | leases | pinned | sessions | hot windows | DRAM MiB | NVMe blocks | "
          "DRAM-only blocks | flushed | ops/s | p99 ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    step = max(1, len(res.samples) // 12)
    for s in res.samples[::step]:
        print(f"| {s.t:.0f} | {s.rss_mib:.0f} | {s.open_files} | {s.leases} | {s.pinned_blocks} | {s.sessions} | "
              f"{s.hot_windows} | {s.dram_used_mib:.1f} | {s.nvme_blocks} | {s.pending_blocks} | {s.flushed} | "
              f"{s.ops_per_s:.0f} | {s.p99_ms:.0f} |")
    print(f"\nops: {dict(res.ops)}; expected errors: {dict(res.expected_errors)}; wrong bytes: {res.wrong_bytes}; "
          f"failures: {len(res.failures)}; bounded: {res.bounded}; verdict: {'ok' if res.ok else 'FAILED'}")
    for line in [f for f in res.failures if not f.startswith("daemon log")][:10]:
        print(f"- {line}")
    for line in [f for f in res.failures if f.startswith("daemon log")]:
        print(line)
    if args.json:
        out = {"seconds": res.seconds, "clients": res.clients, "ops": dict(res.ops),
               "expected_errors": dict(res.expected_errors), "failures": res.failures, "wrong_bytes": res.wrong_bytes,
               "samples": [asdict(x) for x in res.samples], "bounded": res.bounded, "ok": res.ok}
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    sys.exit(0 if res.ok else 1)


if __name__ == "__main__":
    main()
