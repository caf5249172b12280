"""Crash loop: N SIGKILLs at random moments under write-through load, then every acknowledged block checked.

Each cycle starts `engram serve` (write-through, NVMe in one directory kept across cycles) and times it from
exec to SERVING (`restart`), lets W writer threads put sequences of 1-3 blocks plus a partial tail (each its
own client), SIGKILLs the daemon after a random 0.05-1.5 s, and joins the writers. A put counts as
acknowledged only once the daemon answered it. At the start of the next cycle the puts acknowledged in the
previous one are read back (Lookup + Get through the restarted daemon); after the last cycle, every put
acknowledged in the whole run is. A block is `lost` when an acknowledged put's tokens no longer match in
full, `torn` when what comes back differs from what was put. A restart that does not answer within 120 s,
or exits, is a `failed restart` (the next cycle tries again).

    .venv/bin/python -m benchmarks.crash_loop [--kills 1000] [--writers 4] [--dir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks._harness import _wait_health, machine
from engram import errors
from engram.client import SyncEngramClient
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec

NS = "crash-loop"
BT = 16


def spec() -> ModelSpec:
    layout = KVLayout(layers=(LayerSpec(LayerKind.SLIDING, 8), LayerSpec(LayerKind.GLOBAL)) * 2, num_kv_heads=2,
                      head_dim=16, dtype=DType.BF16, block_tokens=BT)
    return ModelSpec(name="crash-loop", weights_id="w", layout=layout, codec="raw")


def sequence(seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """A put's tokens and KV, rebuilt from its seed (the run keeps seeds, not tensors)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 4)) * BT + int(rng.integers(0, BT))
    toks = rng.integers(0, 32_000, n, dtype=np.int32)
    shape = spec().layout.block_shape(n)
    kv = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return toks, kv


@dataclass
class Tally:
    kills: int = 0
    acknowledged_puts: int = 0
    acknowledged_blocks: int = 0
    lost: int = 0  # acknowledged puts whose blocks are not all there
    torn: int = 0  # blocks served with other bytes than were put
    failed_restarts: int = 0
    restart_s: list[float] = field(default_factory=list)
    verify_errors: list[str] = field(default_factory=list)


def start(sock: Path, nvme: Path, extra: list[str]) -> tuple[subprocess.Popen[bytes], float]:
    cmd = [sys.executable, "-m", "engram", "serve", "--unix-socket", str(sock), "--log-level", "error",
           "--dram-capacity", "32MiB", "--set", f"tiers.nvme.path={nvme}", "--set", "tiers.write_policy=write-through",
           *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=sock.parent)
    _wait_health(f"unix:{sock}", proc, timeout=120)
    return proc, time.perf_counter() - t0


def writer(address: str, fp_box: list[bytes], seeds: list[int], stop: threading.Event, first_seed: int) -> None:
    seed = first_seed
    try:
        with SyncEngramClient(address, namespace=NS) as client:
            fp = client.register_model(spec())
            fp_box[:] = [fp]
            while not stop.is_set():
                toks, kv = sequence(seed)
                client.put(fp, toks, kv)
                seeds.append(seed)  # acknowledged
                seed += 1
    except (errors.EngramError, RuntimeError, OSError):
        pass  # killed under us: the put in flight was not acknowledged


def verify(address: str, seeds: list[int], tally: Tally) -> None:
    with SyncEngramClient(address, namespace=NS) as client:
        fp = client.register_model(spec())  # the daemon answered its health check: it serves
        for seed in seeds:
            toks, kv = sequence(seed)
            try:
                n, got = client.get_prefix(fp, toks)
            except errors.EngramError as exc:
                tally.lost += 1
                tally.verify_errors.append(f"seed {seed}: {exc}")
                continue
            if n != len(toks):
                tally.lost += 1
                tally.verify_errors.append(f"seed {seed}: {n} of {len(toks)} tokens found")
            if n and not torch.equal(got, kv[:, :, :n]):
                tally.torn += 1
                tally.verify_errors.append(f"seed {seed}: bytes differ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--min-s", type=float, default=0.05, help="earliest kill, after the writers start")
    ap.add_argument("--max-s", type=float, default=1.5, help="latest kill")
    ap.add_argument("--dir", help="where the NVMe directory lives (default: a temp dir)")
    ap.add_argument("--set", action="append", default=[], help="extra daemon config, key=value")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the tally here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    base = Path(args.dir or tempfile.mkdtemp(prefix="engram-crash-"))
    nvme, sock = base / "nvme", base / "e.sock"
    shutil.rmtree(nvme, ignore_errors=True)
    extra = [a for s in args.set for a in ("--set", s)]
    tally = Tally()
    everything: list[int] = []
    previous: list[int] = []
    next_seed = 1
    t_start = time.time()
    for cycle in range(args.kills + 1):
        try:
            proc, restart = start(sock, nvme, extra)
        except RuntimeError:
            tally.failed_restarts += 1
            continue
        tally.restart_s.append(restart)
        verify(f"unix:{sock}", previous, tally)
        if cycle == args.kills:  # the last start: check everything acknowledged in the run, then stop
            verify(f"unix:{sock}", everything, tally)
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
            break
        stop = threading.Event()
        acked: list[list[int]] = [[] for _ in range(args.writers)]
        fp_box: list[bytes] = []
        threads = []
        for w in range(args.writers):
            threads.append(threading.Thread(target=writer, args=(f"unix:{sock}", fp_box, acked[w], stop,
                                                                 next_seed + w * 1_000_000)))
        next_seed += args.writers * 1_000_000
        for t in threads:
            t.start()
        time.sleep(rng.uniform(args.min_s, args.max_s))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
        tally.kills += 1
        stop.set()
        for t in threads:
            t.join(60)
        previous = [s for a in acked for s in a]
        everything += previous
        tally.acknowledged_puts += len(previous)
        tally.acknowledged_blocks += sum(-(-len(sequence(s)[0]) // BT) for s in previous)
        if (cycle + 1) % 25 == 0:
            print(f"  {cycle + 1} kills, {tally.acknowledged_puts} puts acknowledged, {tally.lost} lost, "
                  f"{tally.torn} torn, {tally.failed_restarts} failed restarts", file=sys.stderr, flush=True)
    shutil.rmtree(base, ignore_errors=True)
    rs = np.asarray(tally.restart_s)
    summary = {"kills": tally.kills, "acknowledged_puts": tally.acknowledged_puts,
               "acknowledged_blocks": tally.acknowledged_blocks, "lost": tally.lost, "torn": tally.torn,
               "failed_restarts": tally.failed_restarts,
               "restart_p50_s": float(np.percentile(rs, 50)) if len(rs) else 0.0,
               "restart_max_s": float(rs.max()) if len(rs) else 0.0, "minutes": (time.time() - t_start) / 60}
    print(f"# crash_loop: {datetime.date.today()} on {machine()}; {args.writers} writers, kills at "
          f"{args.min_s}-{args.max_s} s\n")
    print("| kills | acknowledged puts (blocks) | lost | torn | failed restarts | restart p50 / max s |")
    print("|---|---|---|---|---|---|")
    print(f"| {tally.kills} | {tally.acknowledged_puts} ({tally.acknowledged_blocks}) | {tally.lost} | {tally.torn} | "
          f"{tally.failed_restarts} | {summary['restart_p50_s']:.2f} / {summary['restart_max_s']:.2f} |")
    for line in tally.verify_errors[:20]:
        print(f"- {line}")
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "errors": tally.verify_errors[:100],
                                               "restart_s": tally.restart_s, **{"tally": asdict(tally)}}, indent=2))


if __name__ == "__main__":
    main()
