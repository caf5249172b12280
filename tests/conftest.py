"""Shared fixtures: a tiny layout, and a real Engram daemon (grpc.aio, in this process's event loop)
over loopback TCP or a unix socket."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engram.client import EngramClient
from engram.config import load_config
from engram.server import RunningServer, start_server

from helpers import free_port, start_redis

ServerFactory = Callable[..., Any]


@pytest.fixture(params=["tcp", "unix"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def server_factory(transport: str, tmp_path: Path) -> AsyncIterator[ServerFactory]:
    """Start daemons with config overrides; every one is stopped at teardown."""
    started: list[RunningServer] = []

    async def start(**overrides: Any) -> RunningServer:
        # 256 MiB pools, not the 4 GiB default: several daemons at once fit a small /dev/shm.
        # No prefault: a background thread per daemon would only slow the suite (tests/test_shared_pool.py checks it).
        base: dict[str, Any] = {"server.port": 0, "tiers.dram.capacity": "256MiB", "tiers.dram.prefault": False}
        if transport == "unix":
            base["server.unix_socket"] = str(tmp_path / f"engram-{len(started)}.sock")
        cfg = load_config(env={}, overrides={**base, **overrides})
        srv = await start_server(cfg)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        await srv.stop(0)


@pytest.fixture
async def server(server_factory: ServerFactory) -> RunningServer:
    srv: RunningServer = await server_factory()
    return srv


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[EngramClient]:
    async with EngramClient(server.address, namespace="tenant-a") as c:
        yield c


@pytest.fixture(scope="module")
def model() -> Any:
    """The tiny seeded hybrid model (gpt-oss's layer pattern, a window of 8) the replay tests' daemons run."""
    import torch

    from engram.replay import HybridConfig, HybridDecoder, gpt_oss_pattern

    return HybridDecoder(HybridConfig(layers=gpt_oss_pattern(4), window=8, dtype=torch.float32, seed=3))


@pytest.fixture
def model_file(model: Any, tmp_path: Path) -> Path:
    """`model` saved as a decoder file, for replay.models."""
    from engram.replay import save_decoder

    path = tmp_path / "replay-model.safetensors"
    save_decoder(model, path)
    return path


@pytest.fixture
def redis_port() -> Iterator[int]:
    """A real redis-server of the test's own on a free port (the cluster tier's tests; some start theirs so)."""
    port = free_port()
    proc = start_redis(port)
    yield port
    proc.kill()
    proc.wait()
