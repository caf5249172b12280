"""Synthetic agent workloads: token sequences with shared prefixes and deterministic KV for them.

The KV of a block is drawn from a generator seeded by the block's key, so it depends on the whole prefix
(as a real model's KV does) and any process can recompute what a hit must return. Used by the demo, the
benchmarks and the tests; not a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engram.keys import chain_keys
from engram.layout import KVLayout


def synthetic_kv(layout: KVLayout, namespace: str, fingerprint: bytes, tokens: np.ndarray) -> torch.Tensor:
    """KV of shape (persisted_layers, 2, len(tokens), kv_heads, head_dim) in the layout's dtype."""
    blocks = []
    for key, start, end in chain_keys(namespace, fingerprint, tokens, layout.block_tokens):
        gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
        shape = layout.block_shape(end - start)
        blocks.append(torch.randn(shape, generator=gen, dtype=torch.float32).to(layout.dtype.torch_dtype))
    return torch.cat(blocks, dim=2)


@dataclass(frozen=True)
class AgentSessions:
    """Token sequences of agent sessions sharing a system prompt and a repository read."""

    system_prompt: np.ndarray
    repository: np.ndarray
    sessions: tuple[np.ndarray, ...]  # each: system_prompt + repository + its own history

    @property
    def shared_tokens(self) -> int:
        return len(self.system_prompt) + len(self.repository)


def agent_sessions(
    n_sessions: int = 2,
    system_tokens: int = 1024,
    repository_tokens: int = 3072,
    history_tokens: int = 600,
    vocab: int = 50_000,
    seed: int = 0,
) -> AgentSessions:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, system_tokens, dtype=np.int32)
    repo = rng.integers(0, vocab, repository_tokens, dtype=np.int32)
    sessions = tuple(
        np.concatenate([system, repo, rng.integers(0, vocab, history_tokens, dtype=np.int32)])
        for _ in range(n_sessions)
    )
    return AgentSessions(system, repo, sessions)
