"""`engram demo`: an embedded daemon on its defaults (no GPU, no Redis) and two agent sessions that share
a long prefix (a system prompt and a repository read). Session A pays for the prefix and stores its KV;
session B finds the prefix cached, gets it back, checks it bit for bit, and only stores its own history."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from engram.client import EngramClient
from engram.codec import blockformat
from engram.codec.base import codec_by_name
from engram.config import load_config
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.server import start_server
from engram.workload import agent_sessions, synthetic_kv

from .common import start_failures
from .stats import human_bytes, stats_renderable

# A gpt-oss-20b-like layout: 24 layers alternating sliding (W=128) and global, 8 KV heads of 64.
DEMO_LAYOUT = KVLayout(
    layers=tuple(LayerSpec(LayerKind.SLIDING, 128) if i % 2 == 0 else LayerSpec(LayerKind.GLOBAL) for i in range(24)),
    num_kv_heads=8, head_dim=64, dtype=DType.BF16, block_tokens=256,
)
DEMO_MODEL = ModelSpec(name="demo-gpt-oss-like", weights_id="random-seed-0", layout=DEMO_LAYOUT)


@dataclass
class SessionReport:
    name: str
    tokens: int
    cached_tokens: int
    verified: bool  # what came back is exactly what the daemon stored (the decode of its FP4 blocks)
    rel_error: float  # relative RMS error of what came back against the KV the session computed
    stored: int
    deduplicated: int
    skipped: int
    bytes_got: int
    seconds: float


def stored_form(kv: torch.Tensor, codec: str, block_tokens: int) -> torch.Tensor:
    """What the daemon keeps of kv: each block through the model's codec and back (bit-exact CPU reference)."""
    enc = codec_by_name(codec)
    blocks = [blockformat.decode(blockformat.encode(kv[:, :, s : s + block_tokens], enc))
              for s in range(0, kv.shape[2], block_tokens)]
    return torch.cat(blocks, dim=2)


async def run_session(client: EngramClient, fp: bytes, name: str, tokens: np.ndarray) -> SessionReport:
    t0 = time.perf_counter()
    cached, kv_hit = await client.get_prefix(fp, tokens)
    kv_all = synthetic_kv(DEMO_LAYOUT, client.namespace, fp, tokens)  # what "prefill" would compute
    verified, err = True, 0.0
    if cached:
        want = kv_all[:, :, :cached]
        verified = torch.equal(kv_hit, stored_form(want, client.codec_of(fp), DEMO_LAYOUT.block_tokens))
        err = float((kv_hit.float() - want.float()).norm() / want.float().norm())
    put = await client.put(fp, tokens, kv_all)
    return SessionReport(name, len(tokens), cached, verified, err, put.stored, put.deduplicated, put.skipped,
                         kv_hit.numel() * kv_hit.element_size(), time.perf_counter() - t0)


DEMO_DRAM = 256 * 2**20  # the demo's sessions take ~40 MiB; a fresh machine may have little shared memory


async def run_demo(console: Console, socket_dir: Path) -> list[SessionReport]:
    overrides: dict[str, object] = {"server.unix_socket": str(socket_dir / "engram.sock"),
                                    "tiers.dram.capacity": DEMO_DRAM}
    shm = Path("/dev/shm")
    if not shm.is_dir() or shutil.disk_usage(shm).free < 2 * DEMO_DRAM:
        # A small /dev/shm (docker's 64 MiB default): the pool's segment goes in the demo's own directory.
        overrides |= {"tiers.dram.shm_dir": str(socket_dir), "tiers.dram.pin": False}
    with start_failures():  # a start that fails (a socket path too long in $TMPDIR): serve's line and code
        cfg = load_config(env={}, overrides=overrides)
        server = await start_server(cfg)
    console.print(f"[bold]engram demo[/]: embedded daemon on [cyan]{server.address}[/] "
                  f"(DRAM tier {human_bytes(cfg.tiers.dram.capacity)}, blocks stored as "
                  f"{server.store.registry.default_codec}, "
                  "no GPU, no Redis)")
    work = agent_sessions(n_sessions=2, system_tokens=1024, repository_tokens=3072, history_tokens=600)
    console.print(f"two agent sessions share a {work.shared_tokens}-token prefix (system prompt + repository), "
                  f"then {len(work.sessions[0]) - work.shared_tokens} tokens of their own; "
                  f"layout {DEMO_LAYOUT.bytes_per_token()} bytes/token")
    reports = []
    try:
        async with EngramClient(server.address, namespace="demo-team") as client:
            fp = await client.register_model(DEMO_MODEL)
            for name, tokens in zip(("session A", "session B"), work.sessions, strict=True):
                reports.append(await run_session(client, fp, name, tokens))
            stats = await client.stats()
    finally:
        await server.stop()

    table = Table(title="sessions", title_justify="left")
    for col in ("session", "tokens", "cached", "KV served", "intact", "FP4 err", "stored", "sent", "time"):
        table.add_column(col, justify="left" if col == "session" else "right")
    for r in reports:
        table.add_row(r.name, str(r.tokens), f"{r.cached_tokens} ({100 * r.cached_tokens / r.tokens:.0f}%)",
                      human_bytes(r.bytes_got), "yes" if r.verified else "[red]NO[/]",
                      f"{r.rel_error:.3f}" if r.cached_tokens else "-",
                      f"{r.stored} blk", f"{r.stored + r.deduplicated}/{r.stored + r.deduplicated + r.skipped} blk",
                      f"{r.seconds * 1000:.0f} ms")
    console.print(table)
    console.print(stats_renderable(stats))
    return reports


def demo(console: Console | None = None) -> list[SessionReport]:
    console = console or Console()
    with tempfile.TemporaryDirectory(prefix="engram-demo-") as tmp:
        return asyncio.run(run_demo(console, Path(tmp)))
