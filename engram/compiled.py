"""Which of the store's hot modules run compiled.

`ENGRAM_COMPILE=1 pip install .` compiles them with mypyc (setup.py): the same source, typed and checked by mypy,
turned into C, so that the per-block work of a lookup, a put and an eviction costs less interpreter time (the trace
replayer runs about 2-3x faster; benchmarks/RESULTS.md trace_speed). A plain install runs them interpreted; both
behave the same (tests/test_compiled.py builds the compiled ones and replays traces through both).

Compiled code differs in two ways a developer meets: argument types are checked at run time (an annotation that
lies is a TypeError), and a compiled class's methods cannot be replaced at run time (monkeypatching). And a
compiled module keeps running after its source changed (an editable install, compiled once, then edited):
`status` reports it stale, `engram serve` and `engram bench trace` say so.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

MODULES = ("engram.eviction", "engram.index", "engram.store.core", "engram.store.placement", "engram.store.counters",
           "engram.tiers.budget", "engram.tiers.dram")

COMPILED, INTERPRETED, STALE = "compiled", "interpreted", "stale"


def _built_from() -> dict[str, str]:
    """sha256 of each compiled module's source when it was compiled (setup.py writes it); {} if none was."""
    try:
        from engram._compiled_sources import SOURCES  # type: ignore[import-not-found]
    except ImportError:
        return {}
    return dict(SOURCES)


def state(module: str, built_from: dict[str, str]) -> str:
    """COMPILED, INTERPRETED or STALE (compiled, but from another source than the one beside it now)."""
    spec = importlib.util.find_spec(module)
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    if origin is None or origin.suffix == ".py":
        return INTERPRETED
    source = origin.with_name(module.rsplit(".", 1)[-1] + ".py")
    if not source.is_file() or built_from.get(module) != hashlib.sha256(source.read_bytes()).hexdigest():
        return STALE
    return COMPILED


def status(modules: tuple[str, ...] = MODULES) -> dict[str, str]:
    """Each module's state (`state`)."""
    built = _built_from()
    return {m: state(m, built) for m in modules}


def summary(states: dict[str, str] | None = None) -> str:
    """One line: "compiled (mypyc)", "interpreted", or which modules are stale or mixed."""
    states = status() if states is None else states
    values = set(states.values())
    if values == {COMPILED}:
        return "compiled (mypyc)"
    if values == {INTERPRETED}:
        return "interpreted (ENGRAM_COMPILE=1 pip install . compiles the store's hot modules)"
    stale = sorted(m for m, s in states.items() if s == STALE)
    if stale:
        return (f"STALE: {', '.join(stale)} run(s) compiled from an older source; reinstall (ENGRAM_COMPILE=1 pip "
                "install ...) or delete the modules' .so files")
    return "partly compiled: " + ", ".join(f"{m} {s}" for m, s in sorted(states.items()))
