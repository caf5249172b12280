"""Build hook for one opt-in: `ENGRAM_COMPILE=1 pip install .` compiles the store's hot modules with mypyc.

Everything else is in pyproject.toml (the package, its dependencies, the C codec extension). The compiled modules
are the same source as the interpreted ones, typed and checked by mypy; compiled, the index, the eviction order and
the store's put and read paths run about 2-3x faster (benchmarks/RESULTS.md trace_speed), which is what the trace
replayer spends its time in. `engram.compiled` says at run time which modules run compiled, and which were
compiled from a source that has changed since (an editable install, compiled once, then edited: the compiled
module would still run; it is reported stale).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from setuptools import setup

# Keep in step with engram/compiled.py's MODULES (tests/test_compiled.py checks they agree).
COMPILED = ["engram/eviction.py", "engram/index.py", "engram/store/core.py", "engram/store/placement.py",
            "engram/store/counters.py", "engram/tiers/budget.py", "engram/tiers/dram.py"]


def _compiled_modules() -> list:  # list of setuptools Extension
    try:
        from mypyc.build import mypycify  # mypy ships mypyc; a build without ENGRAM_COMPILE needs neither
    except ImportError:
        raise SystemExit("ENGRAM_COMPILE=1 needs mypy (its mypyc) where the package is built: pyproject.toml's "
                         "build requirements bring it, or `pip install mypy` before --no-build-isolation") from None

    root = Path(__file__).resolve().parent
    sources = {p[:-3].replace("/", "."): hashlib.sha256((root / p).read_bytes()).hexdigest() for p in COMPILED}
    # What each module was compiled from: engram.compiled compares it with the source beside the module.
    (root / "engram" / "_compiled_sources.py").write_text(
        '"""Written by setup.py when it compiles modules (ENGRAM_COMPILE=1): sha256 of each one\'s source."""\n\n'
        f"SOURCES = {sources!r}\n")
    return mypycify(COMPILED, opt_level="3", debug_level="0", group_name="engram_compiled")


if os.environ.get("ENGRAM_COMPILE", "0") not in ("", "0"):
    setup(ext_modules=_compiled_modules())  # the codec extension of pyproject.toml is built beside them
else:
    setup()
