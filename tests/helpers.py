"""Small real objects the tests share: a tiny layout and model, seeded KV and tokens, free ports, and
waiting for a daemon subprocess to become healthy. (Imported as `helpers`: pytest puts tests/ on sys.path,
and not the repository root, whose kernels/ directory would shadow Hugging Face's `kernels` package.)"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec

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


def wait_for(address: str, proc: subprocess.Popen[str], timeout: float = 20.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"engram serve exited early: {proc.stdout.read() if proc.stdout else ''}")
        try:
            with grpc.insecure_channel(address) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            time.sleep(0.1)
    raise AssertionError("daemon did not become healthy")


ENGRAM = [sys.executable, "-m", "engram"]
# Subprocesses run outside the checkout: `python -m` puts its working directory on sys.path, and the
# repository root's kernels/ would shadow Hugging Face's `kernels` package there.
NEUTRAL_CWD = tempfile.gettempdir()


@contextlib.contextmanager
def engram_daemon(tmp_path: Path, *args: str, env: dict[str, str] | None = None
                  ) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A real `engram serve` subprocess on a unix socket in tmp_path; yields (address, process), killed at exit.
    Its stdout and stderr go to one pipe (read it after it stops)."""
    sock = tmp_path / "engram.sock"
    full_env = {**os.environ, "ENGRAM_TIERS__DRAM__CAPACITY": "64MiB", **(env or {})}
    proc = subprocess.Popen([*ENGRAM, "serve", "--unix-socket", str(sock), "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=NEUTRAL_CWD)
    address = f"unix:{sock}"
    try:
        wait_for(address, proc)
        yield address, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
