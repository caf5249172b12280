"""The store's hot modules compiled with mypyc (setup.py, ENGRAM_COMPILE=1; engram/compiled.py): a compiled build
replays traces to the same decisions and serves a client as the interpreted one does, and a module compiled from
an older source is told apart from a current one."""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from engram import compiled

from helpers import NEUTRAL_CWD, engram_daemon

REPO = Path(__file__).resolve().parent.parent


def test_setup_compiles_the_modules_that_compiled_names() -> None:
    tree = ast.parse((REPO / "setup.py").read_text())
    listed = next(ast.literal_eval(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "COMPILED")
    assert [p[:-3].replace("/", ".") for p in listed] == list(compiled.MODULES)


def test_a_module_is_interpreted_compiled_or_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    source = pkg / "mod.py"
    source.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert compiled.state("fakepkg.mod", {}) == compiled.INTERPRETED
    # An extension module beside the source is what the import system loads first (only located here, not loaded).
    (pkg / f"mod{sysconfig.get_config_var('EXT_SUFFIX')}").write_bytes(b"")
    importlib.invalidate_caches()
    built = {"fakepkg.mod": hashlib.sha256(source.read_bytes()).hexdigest()}
    assert compiled.state("fakepkg.mod", built) == compiled.COMPILED
    source.write_text("X = 2\n")  # edited after it was compiled: the compiled module still runs the old code
    assert compiled.state("fakepkg.mod", built) == compiled.STALE
    assert compiled.state("fakepkg.mod", {}) == compiled.STALE  # compiled, but nothing says from what
    assert "STALE: fakepkg.mod" in compiled.summary({"fakepkg.mod": compiled.STALE, "engram.index": compiled.COMPILED})
    assert compiled.summary({m: compiled.INTERPRETED for m in compiled.MODULES}).startswith("interpreted")


# The replays both builds run: the traces whose engram counts tests/test_trace.py pins, one DRAM tier at a few
# capacities (learned order warm), and a three-tier run (demotion, promotion) through the fast path and the verbs.
_REPLAYS = """
import dataclasses, json
from engram import compiled
from engram.trace import TierSpec, agent_trace, replay_all
from engram.trace.synth import agent_workload

def run():
    out = []
    for trace, caps in ((agent_trace(sessions=30, turns=6, seed=5), [16, 48, 128, 512]),
                        (agent_trace(sessions=40, turns=8, seed=7, concurrent=12, fork_p=0.5), [16, 32, 64, 256])):
        out.append([r.hit_blocks for r in replay_all(trace, caps, policies=("engram",))])
    tiers = [TierSpec("hbm", 16 * 4096), TierSpec("dram", 32 * 4096), TierSpec("nvme", 64 * 4096)]
    small = agent_workload(sessions=4, seed=2, system_blocks=8, tool_blocks=4, repo_blocks=6, turns=(4, 8),
                           tool_result_blocks=(1, 4), subagent_p=0.3)
    for fast in (True, False):
        r = replay_all(small, [], block_bytes=4096, tiers=tiers, policies=("engram",), fast=fast)[0]
        out.append([r.hit_blocks, [list(dataclasses.astuple(t)) for t in r.tiers]])
    return out

if __name__ == "__main__":
    print(json.dumps({"status": compiled.status(), "replays": run()}))
"""


@pytest.fixture(scope="module")
def compiled_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the source with the store's modules compiled in place, as `ENGRAM_COMPILE=1 pip install -e .`
    leaves them (about two minutes: mypyc type-checks the package, then gcc -O3)."""
    root = tmp_path_factory.mktemp("compiled")
    skip = shutil.ignore_patterns("*.so", "__pycache__", "_compiled_sources.py")
    for name in ("engram", "cli", "kernels"):
        shutil.copytree(REPO / name, root / name, ignore=skip)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, root / name)
    (root / "engram" / "cli").symlink_to("../cli")  # as the installed package maps them (pyproject package-dir)
    (root / "engram" / "kernels").symlink_to("../kernels")
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=root, text=True,
                           capture_output=True, timeout=900, env={**os.environ, "ENGRAM_COMPILE": "1"})
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    # What goes on sys.path: the package and the compiled modules' shared runtime only, not the tree's root,
    # whose kernels/ would shadow the `kernels` package transformers imports.
    path = root / "path"
    path.mkdir()
    (path / "engram").symlink_to(root / "engram")
    for lib in root.glob("engram_compiled__mypyc*"):
        (path / lib.name).symlink_to(lib)
    return path


def _in(path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(path)}


def test_a_compiled_build_decides_as_the_interpreted_one(compiled_tree: Path) -> None:
    script = compiled_tree.parent / "replays.py"
    script.write_text(_REPLAYS)
    out = subprocess.run([sys.executable, str(script)], cwd=NEUTRAL_CWD, env=_in(compiled_tree), text=True,
                         capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["status"] == {m: compiled.COMPILED for m in compiled.MODULES}
    mine: dict[str, object] = {}
    exec(compile(_REPLAYS, "replays", "exec"), mine)  # the same replays, interpreted, in this process
    assert compiled.status() == {m: compiled.INTERPRETED for m in compiled.MODULES}
    expected = json.loads(json.dumps(mine["run"]()))  # type: ignore[operator]
    assert got["replays"] == expected
    assert expected[0] == [2072, 3324, 4168, 4192] and expected[1] == [3292, 4237, 5975, 9263]  # test_trace's pins
    assert expected[2] == expected[3]  # fast path and verbs agree, in both builds


_IMPORT_ALL = """
import importlib, inspect, pkgutil, sys, engram
def compiled(cls):  # a class of one of the package's compiled modules
    module = sys.modules.get(cls.__module__)
    return cls.__module__.startswith("engram.") and getattr(module, "__file__", "").endswith(".so")
failed = []
for m in pkgutil.walk_packages(engram.__path__, "engram."):
    if m.name.endswith("__main__"):
        continue
    try:
        mod = importlib.import_module(m.name)
    except ModuleNotFoundError as exc:  # an optional integration's framework (vllm) not installed here
        if (exc.name or "").startswith("engram"):
            failed.append(f"{m.name}: {exc}")
        continue
    except Exception as exc:
        failed.append(f"{m.name}: {type(exc).__name__}: {exc}")
        continue
    for name, cls in inspect.getmembers(mod, inspect.isclass):
        if cls.__module__ == m.name and not compiled(cls):
            bad = [base.__qualname__ for base in cls.__mro__[1:] if compiled(base)]
            if bad:
                failed.append(f"{m.name}.{name} subclasses compiled {bad}")
print("\\n".join(failed))
"""


def test_no_interpreted_class_subclasses_a_compiled_one(compiled_tree: Path) -> None:
    # An interpreted subclass of a compiled class imports, then raises TypeError at its first instance: compiling
    # tiers/budget.py once broke every daemon with an NVMe tier (NvmeTier subclassed ByteBudget; it holds one now).
    # Every module of the package is imported beside the compiled ones and its classes checked.
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=NEUTRAL_CWD, env=_in(compiled_tree), text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "", out.stdout


def test_a_compiled_daemon_serves_puts_from_the_data_channel(compiled_tree: Path, tmp_path: Path) -> None:
    # The data channel hands the store a view of its receive buffer: an annotation that said `bytes` there was a
    # TypeError in compiled code. The API reference's example puts and gets through it.
    example = re.search(r"```python\n(.*?)```", (REPO / "docs" / "API.md").read_text(), re.S)
    assert example is not None
    with engram_daemon(tmp_path, env=_in(compiled_tree)) as (address, proc):
        script = tmp_path / "example.py"
        script.write_text(example.group(1).replace("unix:/run/engram.sock", address))
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                             cwd=NEUTRAL_CWD, env=_in(compiled_tree))
        assert proc.poll() is None  # the daemon is still up
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["40", "3"]


def test_an_edited_source_makes_its_compiled_module_stale(compiled_tree: Path) -> None:
    counters = compiled_tree / "engram" / "store" / "counters.py"  # (through the link: the tree's own file)
    original = counters.read_text()
    counters.write_text(original + "\n# edited after the build\n")
    try:
        probe = "from engram import compiled; print(compiled.summary())"
        out = subprocess.run([sys.executable, "-c", probe], cwd=NEUTRAL_CWD, env=_in(compiled_tree), text=True,
                             capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("STALE: engram.store.counters "), out.stdout
    finally:
        counters.write_text(original)
