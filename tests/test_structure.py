"""The shape of the package: the worker library stands alone, modules import on their own (no cycles that
only import order hides), protobuf stays at the gRPC edge, and every block served is counted once, whichever
path served it (bytes, zero-copy descriptors)."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import engram
from engram.client import EngramClient

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

PACKAGE = Path(engram.__file__).parent
REPO = PACKAGE.parent


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_client_imports_none_of_the_daemon() -> None:
    loaded = json.loads(_run("import json, sys, engram.client; print(json.dumps(sorted(sys.modules)))"))
    daemon = [m for m in loaded if m.split(".")[0] in ("redis", "prometheus_client")
              or m.startswith(("engram.store", "engram.tiers", "engram.server"))]
    assert daemon == []
    assert "engram.client" in loaded and "engram.wire.convert" in loaded  # it did import what it needs


def _modules() -> list[str]:
    """Every module of the distribution: engram/, and cli/ and kernels/, which the build maps into the
    engram namespace (pyproject's package-dir)."""
    names = {"engram"}
    for package in ("engram", "engram.cli", "engram.kernels"):
        mod = importlib.import_module(package)
        names.add(package)
        names.update(info.name for info in pkgutil.walk_packages(mod.__path__, f"{package}."))
    return sorted(n for n in names if not n.endswith(".__main__"))  # __main__ runs the CLI by design


# Modules that subclass an optional package's classes, and that package: where it is not installed, the module's
# ImportError of it (and of nothing else) is expected.
OPTIONAL = {"engram.integrations.vllm.connector": "vllm"}


def test_every_module_imports_on_its_own() -> None:
    """Each module is imported with no Engram module loaded before it, so a cycle (a -> b -> a) that works
    only when something else imported b first fails here. Third-party modules (torch) stay loaded between
    imports: they cannot take part in our cycles, and reloading torch 80 times would take minutes."""
    modules = _modules()
    assert {"engram.client", "engram.server.peers", "engram.store.core", "engram.cli.main",
            "engram.kernels.fp4", *OPTIONAL} <= set(modules)
    code = f"""
import importlib, importlib.util, json, sys, traceback
failed = {{}}
for name in {modules!r}:
    for loaded in [m for m in sys.modules if m == "engram" or m.startswith("engram.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        optional = {OPTIONAL!r}.get(name)
        if not (optional and (exc.name or "").split(".")[0] == optional and importlib.util.find_spec(optional) is None):
            failed[name] = traceback.format_exc(limit=-3)
    except Exception:
        failed[name] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""
    failed = json.loads(_run(code).splitlines()[-1])
    assert failed == {}, "\n".join(f"{k}:\n{v}" for k, v in failed.items())


EDGE = ("engram/wire/", "engram/server/", "engram/client.py", "engram/control.py", "engram/v1/")


def test_protobuf_stays_at_the_grpc_edge() -> None:
    """Only the wire, the server and the client build or read messages; the CLI, the store, sessions and
    everything else speak engram.api's dataclasses."""
    offenders = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(REPO / "cli").rglob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(EDGE):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.startswith(("engram.v1", "google.protobuf")) for n in names):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []


async def test_stats_and_show_count_every_block_served_once_on_every_path(server_factory) -> None:  # type: ignore[no-untyped-def]
    """Zero-copy descriptors and bytes are two ways of serving the same hit: both count in Stats (blocks and
    bytes served, the serving tier's hits, the faster tier's misses) and in each block's hit count."""
    srv = await server_factory(**{"tiers.hbm.capacity": "1MiB", "tiers.hbm.device": "cpu"})
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as putter:  # a Put lands in HBM
        fp = await putter.register_model(spec)
        toks = tokens(4 * BLOCK_TOKENS)
        keys = list((await putter.put(fp, toks, random_kv(spec, len(toks)))).keys)
    async with EngramClient(srv.address, namespace="t") as c:
        await c.register_model(spec)
        # Put lands in HBM (the top tier); demote two blocks to the shared DRAM pool by evicting their HBM copy.
        store = srv.store
        for key in keys[:2]:
            meta = store.block(key)
            assert meta is not None
            await store.placement._demote(meta, 0, 1)
        assert [store.block(k).locations for k in keys] == [["dram"], ["dram"], ["hbm"], ["hbm"]]  # type: ignore[union-attr]
        before = await c.stats()
        await c.get(fp, keys[:2], zero_copy=True)  # descriptors into the DRAM segment
        await c.get(fp, keys[:2], zero_copy=False)  # the same blocks as bytes (then promoted to HBM)
        await c.get(fp, keys[2:], zero_copy=False)  # bytes from HBM
        after = await c.stats()
        shown = {b.key: b.hits for b in (await c.describe_blocks(key_prefixes=[k.hex() for k in keys])).blocks}
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    assert after.blocks_served - before.blocks_served == 6
    assert after.bytes_served - before.bytes_served == 6 * block
    hbm, dram = after.tier("hbm"), after.tier("dram")
    assert (dram.hits - before.tier("dram").hits, hbm.misses - before.tier("hbm").misses) == (4, 4)
    assert hbm.hits - before.tier("hbm").hits == 2
    assert shown == {keys[0]: 2, keys[1]: 2, keys[2]: 1, keys[3]: 1}
