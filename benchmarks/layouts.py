"""Bytes per token of every preset layout (engram/presets.py) in every codec, against bf16, as a Markdown table:
what `engram layouts --json` reports, with the ratios. "persisted": what Engram stores, SWA replayed (the global
layers' streams; a full block's real size, headers and scales included, per token); "every layer": plus the
sliding layers' and branches' KV of every token, which a cache without replay keeps. Pure arithmetic on the
block formats: the same on any machine.

  python -m benchmarks.layouts            # Markdown
  python -m benchmarks.layouts --json     # the rows of `engram layouts --json`
"""

from __future__ import annotations

import argparse
import json
import sys

from engram.presets import CODECS, table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = table()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = (*CODECS, "preset")
    print("| layout | layers (stored) | streams | " + " | ".join("bf16" if c == "raw" else c for c in cols) + " |")
    print("| --- | ---: | --- | " + " | ".join("---:" for _ in cols) + " |")
    for r in rows:
        costs = r["bytes_per_token"]
        assert isinstance(costs, dict)
        streams = ", ".join(f"{s['name']} {'x'.join(map(str, s['shape']))}"
                            f"{'/' + str(s['compress']) if s['compress'] > 1 else ''} {s['codec']}"
                            for s in r["streams"])  # type: ignore[attr-defined]
        base = costs["raw"]["persisted"]
        cells = []
        for c in cols:
            v = costs[c]
            ratio = "" if c == "raw" else f" ({v['persisted'] / base:.3f}x)"
            cells.append(f"{v['persisted']:,.0f}{ratio} / {v['all_layers']:,.0f}")
        print(f"| {r['name']} | {r['layers']} ({r['persisted_layers']}) | {streams} | " + " | ".join(cells) + " |")
    print("\ncells: persisted, SWA replayed (ratio to bf16 persisted) / every layer persisted; bytes per token. "
          "preset: each stream in the codec the layout gives it.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
