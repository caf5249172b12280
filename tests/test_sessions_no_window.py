"""Sessions of a model with nothing to rebuild (a sliding window of 1, or no sliding layer) on a real daemon that
has no replay model at all: its window has no row, so no mode needs the daemon's own model instance, and a
persist-mode session needs no uploaded window. Every mode opens (OpenSession, ForkSession) and resumes to the
empty window at P, whose next-token logits are the uninterrupted run's. Exact and approx sessions were refused
at open ("no replay model"), and a persist-mode Resume with no upload was refused FAILED_PRECONDITION. A model
with a window to rebuild is still refused both."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from test_sessions_replay import BT, P, block_tensor, put_session, reference_logits, tokens_for

from engram import errors
from engram.client import EngramClient, ResumeResult
from engram.replay import HybridConfig, HybridDecoder, SwaWindow, decode_next, gpt_oss_pattern
from engram.replay.runtime import model_spec_for

NOTHING_TO_REBUILD = pytest.mark.parametrize("layers,window", [(gpt_oss_pattern(4), 1), (("global",) * 3, 8)],
                                             ids=["sliding-window-1", "no-sliding-layer"])


def _model(layers: tuple[str, ...], window: int) -> HybridDecoder:
    return HybridDecoder(HybridConfig(layers=layers, window=window, dtype=torch.float32, seed=5))


async def _assert_resumes_empty(client: EngramClient, model: HybridDecoder, fp: bytes, sid: str, toks: np.ndarray,
                                p: int) -> ResumeResult:
    """The session resumes at p to the empty window there, and the next token's logits are the uninterrupted
    run's."""
    r, global_kv = await client.resume_kv(fp, sid)
    sliding = len(model.replay_spec.sliding_layers)
    assert r.position == p and r.window_start == p and r.replayed_tokens == 0
    assert tuple(r.window.shape) == (sliding, 2, 0, model.config.n_kv_heads, model.config.head_dim)
    assert torch.equal(global_kv, block_tensor(model, toks[:p]))
    window = SwaWindow(r.position, r.window_start, tuple((la[0], la[1]) for la in r.window))
    assert torch.equal(decode_next(model, int(toks[p]), global_kv, window).logits, reference_logits(model, toks, p))
    return r


@NOTHING_TO_REBUILD
async def test_exact_approx_and_auto_sessions_of_a_model_with_nothing_to_rebuild_work_on_a_daemon_without_models(
        server_factory: Any, model: HybridDecoder, layers: tuple[str, ...], window: int) -> None:
    """OpenSession and ForkSession in every replaying mode on a daemon with no replay.models, and each Resume
    answers the empty window at P; Stats counts no replay, and says its sessions can be resumed here (replayable: it
    needs no replay model; it said false, as if its sessions were refused) while a model with rows to rebuild is not."""
    empty = _model(layers, window)
    srv = await server_factory()
    assert srv.sessions.runtime.models == ()
    toks = tokens_for(P + 1, seed=81)
    async with EngramClient(srv.address) as client:
        for mode, k in (("exact", 0.0), ("approx", 1.0), ("auto", 0.0)):
            fp, sid = await put_session(client, empty, toks[:P], mode=mode, approx_k=k)
            assert (await _assert_resumes_empty(client, empty, fp, sid, toks, P)).source == "replay"
            assert (await _assert_resumes_empty(client, empty, fp, sid, toks, P)).source == "hot"
            child = await client.fork_session(sid, position=P - 5)
            assert child.mode.value == mode
            r, _ = await client.resume_kv(fp, child.session_id)
            assert r.position == r.window_start == P - 5 and r.window.shape[2] == 0
        stats = await client.stats()
        assert stats.replay.replays == 0
        assert next(m for m in stats.models if m.model_fingerprint == fp).replayable

        with pytest.raises(errors.FailedPrecondition, match="no replay model"):  # rows to rebuild: refused, as ever
            await put_session(client, model, toks[:P])
        rows = model_spec_for(model, block_tokens=BT, codec="raw").fingerprint  # registered by put_session
        assert not next(m for m in (await client.stats()).models if m.model_fingerprint == rows).replayable


@NOTHING_TO_REBUILD
async def test_a_persist_session_of_a_model_with_nothing_to_rebuild_resumes_without_an_uploaded_window(
        server_factory: Any, model: HybridDecoder, layers: tuple[str, ...], window: int) -> None:
    """No window was ever appended: each Resume answers the empty window at P, after an append of tokens too;
    none is kept or held (a persist-mode session holds only what its worker uploads). One with rows to rebuild is
    still refused."""
    empty = _model(layers, window)
    srv = await server_factory()
    toks = tokens_for(P + 9, seed=82)
    async with EngramClient(srv.address) as client:
        fp, sid = await put_session(client, empty, toks[:P], mode="persist")
        assert (await _assert_resumes_empty(client, empty, fp, sid, toks, P)).source == "replay"
        await client.put(fp, toks[:P + 8], block_tensor(empty, toks[:P + 8]))
        await client.append_session(sid, toks[P:P + 8])
        await client.suspend_session(sid)
        assert (await _assert_resumes_empty(client, empty, fp, sid, toks, P + 8)).source == "replay"
        stats = await client.stats()
        assert stats.replay.hot_sessions == 0 and stats.replay.persisted_window_bytes == 0
        assert stats.replay.replays == 0

        _, sliding_sid = await put_session(client, model, toks[:P], mode="persist")
        with pytest.raises(errors.FailedPrecondition, match=r"holds no window for position 53 \(none\)"):
            await client.resume(sliding_sid)

