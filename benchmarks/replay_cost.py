"""What bounded replay costs against loading the same SWA window from HBM, DRAM or NVMe, and how faithful it is
against R (issue 20). The same command as `engram bench replay`; the measuring code is engram/replay/bench.py,
which documents what is measured, and docs/REPLAY.md ("Benchmark: replay cost") the JSON it writes.

  python -m benchmarks.replay_cost --smoke --out /tmp/replay-cost      # tiny model on the CPU, seconds
  python -m benchmarks.replay_cost --model gpt-oss-20b --contexts 4K,16K,64K --nvme-dir /nvme/tmp --out out
"""

from __future__ import annotations

import typer

from engram.cli.bench import replay

if __name__ == "__main__":
    typer.run(replay)
