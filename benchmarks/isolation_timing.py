"""Can another tenant tell from Lookup's answer time whether a prefix is held? 1,000 Lookups by tenant B of
prefixes tenant A holds against 1,000 of prefixes nobody holds, in a random interleaving, against a real
`engram serve` subprocess with tenancy on (loopback TCP); the ROC AUC of the answer time as a classifier of
"held" (0.5: no signal; the bar is <= 0.6). The same measure inside A's namespace shows what a signal
looks like (A's held prefixes are real hits: more blocks walked and returned).
Run: .venv/bin/python -m benchmarks.isolation_timing [--samples 1000] [--blocks 32] [--json]"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json

from benchmarks._harness import engram_daemon, machine
from engram.client import EngramClient
from engram.isolation import Prober

TOKENS = {"a": "bench-token-a", "b": "bench-token-b"}
AUTH = ("--set", f"auth.tenants.a.token={TOKENS['a']}", "--set", f"auth.tenants.b.token={TOKENS['b']}",
        "--set", "auth.salt_secret=bench-salt-secret")


async def measure(address: str, samples: int, blocks: int) -> dict[str, object]:
    async with EngramClient(address, token=TOKENS["a"], namespace="a") as a, \
            EngramClient(address, token=TOKENS["b"], namespace="b") as b:
        prober = Prober(a, b, "a", "b")
        fp = await prober.register()
        t = await prober.timing(fp, samples, pool=50, blocks=blocks, repeat=1, seed=1)  # one lookup per sample
    return {"samples": samples, "prefix_blocks": blocks, "prefix_tokens": blocks * prober.spec.layout.block_tokens,
            "across_auc": round(t.across_auc, 4), "within_auc": round(t.within_auc, 4),
            "across_median_us": [round(x, 1) for x in t.across_median_us],
            "within_median_us": [round(x, 1) for x in t.within_median_us],
            "machine": machine(), "date": datetime.date.today().isoformat()}


def main(samples: int, blocks: int) -> dict[str, object]:
    with engram_daemon("tcp", dram="256MiB", extra=AUTH) as address:
        return asyncio.run(measure(address, samples, blocks))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--blocks", type=int, default=32, help="blocks per prefix (16 tokens each)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = main(args.samples, args.blocks)
    print(json.dumps(out, indent=2) if args.json else
          f"across namespaces: ROC AUC {out['across_auc']:.3f} (held/absent median {out['across_median_us']} us); "
          f"within one: {out['within_auc']:.3f} ({out['within_median_us']} us); {out['samples']} lookups per class")
