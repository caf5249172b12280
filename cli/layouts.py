"""`engram layouts [--json]`: the named layouts (engram/presets.py) with what a token costs stored in each codec,
persisted as Engram stores it (SWA replayed) and with every layer persisted. Needs no daemon."""

from __future__ import annotations

import typer
from rich.table import Table

from .common import console
from .format import dumps
from .options import JsonOpt


def _streams(row: dict) -> str:  # type: ignore[type-arg]
    parts = []
    for s in row["streams"]:
        dims = "x".join(str(d) for d in s["shape"])
        every = f"/{s['compress']}" if s["compress"] > 1 else ""
        parts.append(f"{s['name']} {dims}{every} {s['codec']}")
    return ", ".join(parts)


def layouts(json_: JsonOpt = False) -> None:
    """Named KV layouts (llama-3-8b .. deepseek-v3.2, csa2) and their bytes per token per codec: persisted with
    SWA replayed / with every layer persisted."""
    from engram.presets import CODECS, table  # the layouts and codecs: loaded only when this command runs

    rows = table()
    if json_:
        typer.echo(dumps(rows))
        return
    t = Table(title="bytes per token: SWA replayed / every layer persisted", title_justify="left")
    t.add_column("layout")
    t.add_column("layers (stored)", justify="right")
    t.add_column("streams")
    for c in (*CODECS, "preset"):
        t.add_column("bf16" if c == "raw" else c, justify="right")
    for row in rows:
        costs = row["bytes_per_token"]
        assert isinstance(costs, dict)
        cells = [f"{costs[c]['persisted']:,.0f} / {costs[c]['all_layers']:,.0f}" for c in (*CODECS, "preset")]
        t.add_row(str(row["name"]), f"{row['layers']} ({row['persisted_layers']})", _streams(row), *cells)
    console.print(t)
    console.print("preset: each stream in the codec the layout gives it; csa2's shapes are assumptions "
                  "(docs/LAYOUTS.md)")
