"""A model with nothing to rebuild (a sliding window of 1, or no sliding layer) through a real daemon: its Resume
answers the empty window starting at P at once, without a replay's turn, a read of the prefix or a replay, and
that start is the one a prefill's reference window (PrefillResult.swa_window) names. It took a turn behind
replays of seconds (refused when the queue was full) and decoded its whole prefix to replay 0 tokens; and a
prefill put the window of a model with no sliding layer at P-W+1."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from test_sessions_replay import P, block_tensor, put_session, reference_logits, tokens_for
from test_tenancy_replay import hold_replays

from engram import errors
from engram.client import EngramClient
from engram.replay import HybridConfig, HybridDecoder, SwaWindow, decode_next, gpt_oss_pattern, save_decoder


@pytest.mark.parametrize("layers,window", [(gpt_oss_pattern(4), 1), (("global",) * 3, 8)],
                         ids=["sliding-window-1", "no-sliding-layer"])
async def test_a_resume_with_nothing_to_rebuild_answers_while_the_only_replay_turn_is_held_and_the_queue_is_full(
        server_factory: Any, model_file: Path, model: HybridDecoder, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, layers: tuple[str, ...], window: int) -> None:
    """One replay at a time and none may wait: another model's replay holds the turn (at a gate), so a Resume that
    needs a replay is refused. The nothing-to-rebuild model's Resumes are still answered, with the global KV and
    without: an empty window at P (where its prefill's reference window starts too), no replay run or counted,
    no block decoded when the global KV is not asked for, and the next token's logits are the uninterrupted
    run's."""
    empty = HybridDecoder(HybridConfig(layers=layers, window=window, dtype=torch.float32, seed=5))
    save_decoder(empty, tmp_path / "empty.safetensors")
    srv = await server_factory(**{"replay.models": f"{model_file},{tmp_path / 'empty.safetensors'}",
                                  "replay.max_concurrent": 1, "replay.max_queued": 0})
    gate, ran = hold_replays(srv.sessions, monkeypatch)
    decodes = []
    real_decode = srv.sessions.store.decode

    def counted_decode(payload: Any, meta: Any) -> torch.Tensor:
        decodes.append(meta.key)
        return real_decode(payload, meta)

    monkeypatch.setattr(srv.sessions.store, "decode", counted_decode)
    toks = tokens_for(P + 1, seed=71)
    sliding = sum(1 for kind in layers if kind == "sliding")
    async with EngramClient(srv.address) as client:
        _, busy_sid = await put_session(client, model, tokens_for(P, seed=72))
        fp, sid = await put_session(client, empty, toks[:P])
        held = asyncio.create_task(client.resume(busy_sid))  # its replay waits at the gate, holding the turn
        while not ran:
            await asyncio.sleep(0.01)
        with pytest.raises(errors.ResourceExhausted, match=r"replay\.max_queued"):
            await client.resume(busy_sid, position=P - 1)  # the turn is held and no Resume may wait

        r, global_kv = await client.resume_kv(fp, sid)
        assert r.source == "replay" and r.replayed_tokens == 0 and r.position == P
        assert r.window_start == P == empty.prefill(torch.as_tensor(toks[:P])).swa_window(P).start
        assert tuple(r.window.shape) == (sliding, 2, 0, empty.config.n_kv_heads, empty.config.head_dim)
        assert torch.equal(global_kv, block_tensor(empty, toks[:P]))
        logits = decode_next(empty, int(toks[P]), global_kv, SwaWindow(
            r.position, r.window_start, tuple((la[0], la[1]) for la in r.window))).logits
        assert torch.equal(logits, reference_logits(empty, toks, P))

        await client.suspend_session(sid)  # its window goes: the next Resume finds none
        decodes.clear()
        again = await client.resume(sid)
        assert again.source == "replay" and again.window_start == P and again.window.shape[2] == 0
        assert decodes == [], f"{len(decodes)} blocks decoded to rebuild an empty window"
        assert ran == [P] and (await client.stats()).replay.replays == 0  # only the held replay ran, not yet done
        turns = srv.sessions._replay_turns
        assert turns.busy() and turns.waiting == 0

        gate.set()
        assert (await held).source == "replay"
        assert (await client.stats()).replay.replays == 1
