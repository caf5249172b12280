"""A gRPC Put the daemon refuses fails with the daemon's status, not grpc.aio's INTERNAL "Internal error from Core".

Against a real `engram serve` subprocess, puts over gRPC only (data_channel=False, zero_copy=False). The daemon
refuses a multi-message Put at its first block; the send then in flight fails, and grpc.aio replaced the
daemon's status with its own INTERNAL: a wrong dtype came back DaemonError in 14 puts of 4,000 tokens in 15, and
after a restart put(pin=True) and put_blocks got INTERNAL instead of UnknownModel, registered nothing again and
failed (an audit, session 48: t2_grpc_dtype.py, t8_restart_grpc_put.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engram import errors
from engram.client import SyncEngramClient

from helpers import RestartingDaemon, engram_daemon, random_kv, tiny_model, tokens

SPEC = tiny_model()
N = 4000  # 250 blocks: many messages after the one the daemon refuses
TRIES = 12
GRPC_ONLY = {"data_channel": False, "zero_copy": False}


def test_a_grpc_put_of_the_wrong_dtype_fails_invalid_argument_every_time(tmp_path: Path) -> None:
    with engram_daemon(tmp_path) as (address, _), SyncEngramClient(address, **GRPC_ONLY) as client:
        fp = client.register_model(SPEC)
        got = []
        for i in range(TRIES):
            kv = random_kv(SPEC, N, seed=i).float()  # the layout is bf16
            try:
                client.put(fp, tokens(N, seed=i), kv)
                got.append("stored")
            except errors.EngramError as exc:
                got.append(f"{type(exc).__name__}: {exc}")
        assert all(g.startswith("InvalidArgument") and "dtype" in g for g in got), got


def test_grpc_puts_after_a_restart_register_the_model_again_every_time(tmp_path: Path) -> None:
    with RestartingDaemon(tmp_path) as daemon, \
            SyncEngramClient(daemon.address, timeout_s=5, **GRPC_ONLY) as client:
        fp = client.register_model(SPEC)
        kv = random_kv(SPEC, N)
        failed = []
        for i in range(4):
            daemon.restart(client)
            toks = tokens(N, seed=i)
            try:
                assert len(client.put(fp, toks, kv, pin=True).keys) == N // 16  # pinned: every block is sent
            except errors.EngramError as exc:
                failed.append(f"put: {type(exc).__name__}: {exc}")
            daemon.restart(client)
            blocks = [(toks[j : j + 16], kv[:, :, j : j + 16]) for j in range(0, N, 16)]
            try:
                assert len(client.put_blocks(fp, blocks).keys) == len(blocks)
            except errors.EngramError as exc:
                failed.append(f"put_blocks: {type(exc).__name__}: {exc}")
        assert not failed, failed
        matched, got = client.get_prefix(fp, toks)
        assert matched == N and torch.equal(got, kv)
