"""Shared fixtures: a tiny layout, and a real Engram daemon (grpc.aio, in this process's event loop)
over loopback TCP or a unix socket."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engram.client import EngramClient
from engram.config import load_config
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.server import RunningServer, start_server

BLOCK_TOKENS = 16


def tiny_layout(dtype: DType = DType.BF16, block_tokens: int = BLOCK_TOKENS) -> KVLayout:
    # 4 layers alternating sliding (W=8) and global: blocks carry the 2 global layers.
    layers = (LayerSpec(LayerKind.SLIDING, 8), LayerSpec(LayerKind.GLOBAL)) * 2
    return KVLayout(layers=layers, num_kv_heads=2, head_dim=16, dtype=dtype, block_tokens=block_tokens)


def tiny_model(dtype: DType = DType.BF16, weights_id: str = "seed-0", codec: str = "raw") -> ModelSpec:
    # raw by default, so round trips are bit-exact; the codec tests name their codec.
    return ModelSpec(name="tiny-hybrid", weights_id=weights_id, layout=tiny_layout(dtype), codec=codec)


def random_kv(spec: ModelSpec, n_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = spec.layout.block_shape(n_tokens)
    return torch.randn(shape, generator=gen).to(spec.layout.dtype.torch_dtype)


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32_000, n, dtype=np.int32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ServerFactory = Callable[..., Any]


@pytest.fixture(params=["tcp", "unix"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def server_factory(transport: str, tmp_path: Path) -> AsyncIterator[ServerFactory]:
    """Start daemons with config overrides; every one is stopped at teardown."""
    started: list[RunningServer] = []

    async def start(**overrides: Any) -> RunningServer:
        base: dict[str, Any] = {"server.port": 0}
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
