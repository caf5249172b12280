"""docs/API.md is generated from the client's docstrings (scripts/gen_api_docs.py): it must be fresh, cover
every public method, and its example must run, as a user's script, against a real daemon."""

from __future__ import annotations

import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

from engram.client import EngramClient, SyncEngramClient
from engram.control import ControlClient

from helpers import NEUTRAL_CWD, engram_daemon

REPO = Path(__file__).resolve().parent.parent


def generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_api_docs", REPO / "scripts" / "gen_api_docs.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen
    spec.loader.exec_module(gen)
    return gen


def test_api_reference_is_fresh_and_complete() -> None:
    text = (REPO / "docs" / "API.md").read_text()
    assert text == generator().generate(), "docs/API.md is stale: run `python scripts/gen_api_docs.py`"
    for cls in (ControlClient, EngramClient):
        for name, fn in vars(cls).items():
            if not name.startswith("_") and inspect.isfunction(fn):
                assert re.search(rf"^#### `(async )?{name}\(", text, re.M), f"{cls.__name__}.{name} is not documented"
                assert inspect.getdoc(fn), f"{cls.__name__}.{name} has no docstring"
    assert SyncEngramClient.__doc__


def test_the_sync_example_runs(tmp_path: Path) -> None:
    example = re.search(r"```python\n(.*?)```", (REPO / "docs" / "API.md").read_text(), re.S)
    assert example is not None
    with engram_daemon(tmp_path) as (address, _):
        script = tmp_path / "example.py"
        script.write_text(example.group(1).replace("unix:/run/engram.sock", address))
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                             cwd=NEUTRAL_CWD)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["40", "3"]
