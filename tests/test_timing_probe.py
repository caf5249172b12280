"""The timing probe measures answer times, not dict reads: inside one namespace it tells a held prefix from
an absent one (so it can see a leak), across namespaces it cannot, and when isolation is broken so that a
lookup walks another namespace's chain, it sees that.

Robust on a loaded 2-core machine: each sample is the fastest of three back-to-back lookups (preemption
only ever adds time), each verdict is the majority of three measurements of 200 interleaved samples per
class, the statistic is the ROC AUC (rank based: no assumption on the time distribution), and the margins
are wide (held vs absent inside a namespace measured 0.78-0.93 with three busy loops on the two cores,
across namespaces 0.47-0.54, a lookup walking another namespace's 64-block chain five times 0.74-1.0)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from engram.client import EngramClient
from engram.config import load_config
from engram.isolation import LEAK, Prober, Timing, roc_auc
from engram.server import RunningServer, start_server
from engram.store.core import BlockStore

SAMPLES = 200


def test_roc_auc() -> None:
    assert roc_auc([2, 3, 4], [0, 1]) == 1.0 and roc_auc([0, 1], [2, 3]) == 0.0
    assert roc_auc([1, 1], [1, 1]) == 0.5  # ties count half
    rng = np.random.default_rng(0)
    assert abs(roc_auc(rng.normal(size=2000), rng.normal(size=2000)) - 0.5) < 0.03
    assert roc_auc(rng.normal(1, 1, 2000), rng.normal(0, 1, 2000)) == pytest.approx(0.76, abs=0.03)  # Phi(1/sqrt 2)


@pytest.fixture
async def daemon() -> AsyncIterator[RunningServer]:
    srv = await start_server(load_config(env={}, overrides={
        "server.port": 0, "tiers.dram.pool": "private", "auth.tenants.owner.token": "o",
        "auth.tenants.prober.token": "p", "auth.salt_secret": "s", "logging.level": "error"}))
    yield srv
    await srv.stop(0)


async def three_runs(srv: RunningServer) -> list[Timing]:
    async with EngramClient(srv.address, token="o", namespace="owner") as o, \
            EngramClient(srv.address, token="p", namespace="prober") as p:
        prober = Prober(o, p, "owner", "prober")
        fp = await prober.register()
        return [await prober.timing(fp, SAMPLES, seed=100 * i) for i in range(3)]


def majority(runs: list[Timing], ok: Any) -> bool:
    return sum(bool(ok(t)) for t in runs) >= 2


async def test_the_probe_sees_held_prefixes_in_its_own_namespace_and_not_across(daemon: RunningServer) -> None:
    runs = await three_runs(daemon)
    described = [(round(t.within_auc, 3), round(t.across_auc, 3)) for t in runs]
    assert majority(runs, lambda t: t.within_auc >= 0.7), f"no signal inside a namespace: {described}"
    assert majority(runs, lambda t: abs(t.across_auc - 0.5) <= 0.1), f"a signal across namespaces: {described}"


async def test_the_probe_sees_a_lookup_that_walks_another_namespace(daemon: RunningServer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Break isolation the way a shared index would: every lookup also walks the other namespaces' chains
    for the same tokens (five times over: one walk of a 64-block chain is tens of microseconds, and in a
    25-minute CI run the probe saw it at AUC 0.54-0.69, under its 0.6 verdict, session 53; five walks measured
    0.74-1.0 with a busy loop on the two cores). The answer is still a miss (the result is right), but its time
    now depends on what the owner holds, and the probe must say so."""
    lookup_walk = BlockStore.lookup_walk  # what Lookup and GetPrefix walk their prefix with

    async def shared_walk(self: BlockStore, walk: Any) -> None:
        for ns in self.namespaces_in_use():
            if ns != walk.namespace:
                for _ in range(5):
                    self.match(ns, walk.model_fingerprint, walk.tokens)
        await lookup_walk(self, walk)

    monkeypatch.setattr(BlockStore, "lookup_walk", shared_walk)
    runs = await three_runs(daemon)
    # Either way round is a leak: here a held prefix costs more (the owner's chain is walked to its end, an
    # absent one stops at its first block's probe), so the AUC rises above 0.5.
    assert majority(runs, lambda t: t.status == LEAK), [round(t.across_auc, 3) for t in runs]
