"""Sessions and Resume through a real daemon that replays with its own model instance: a session whose
blocks were demoted and whose window was dropped resumes to the same next-token logits as an
uninterrupted run."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from engram import errors
from engram.api import SessionMode
from engram.client import EngramClient
from engram.replay import (
    HybridConfig,
    HybridDecoder,
    ReplayMode,
    SwaWindow,
    decode_next,
    exact_bound,
    gpt_oss_pattern,
    reconstruct_swa,
    save_decoder,
    window_error,
)
from engram.replay.runtime import model_spec_for
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc

BT = 16  # block tokens
P = 53  # a prefix that ends inside a block


@pytest.fixture
async def daemon(server_factory, model_file: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    return await server_factory(**{"replay.models": str(model_file), "tiers.dram.capacity": "64KiB",
                                   "tiers.nvme.path": str(tmp_path / "nvme")})


def tokens_for(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.int32)


def block_tensor(model: HybridDecoder, toks: np.ndarray) -> torch.Tensor:
    """The stored form of a prefill's global KV: (global layers, 2, T, kv heads, head dim)."""
    res = model.prefill(torch.as_tensor(toks, dtype=torch.long), logits=False)
    return torch.stack([torch.stack((k, v)) for k, v in res.global_kv])


async def put_session(client: EngramClient, model: HybridDecoder, toks: np.ndarray, mode: str = "exact",
                      **kw: object) -> tuple[bytes, str]:
    fp = await client.register_model(model_spec_for(model, block_tokens=BT, codec="raw"))
    await client.put(fp, toks, block_tensor(model, toks))
    info = await client.open_session(fp, mode=mode, tokens=toks, **kw)  # type: ignore[arg-type]
    return fp, info.session_id


async def next_logits(client: EngramClient, model: HybridDecoder, fp: bytes, sid: str, toks: np.ndarray,
                      position: int = 0) -> tuple[torch.Tensor, str]:
    r, global_kv = await client.resume_kv(fp, sid, position=position)
    window = SwaWindow(r.position, r.window_start, tuple((layer[0], layer[1]) for layer in r.window))
    step = decode_next(model, int(toks[r.position]), global_kv, window)
    return step.logits, r.source


def reference_logits(model: HybridDecoder, toks: np.ndarray, p: int) -> torch.Tensor:
    out = model.prefill(torch.as_tensor(toks[: p + 1], dtype=torch.long))
    assert out.logits is not None
    return out.logits[-1]


async def test_resumed_session_gives_the_uninterrupted_logits(daemon, model: HybridDecoder) -> None:  # type: ignore[no-untyped-def]
    toks = tokens_for(P + 1)
    async with EngramClient(daemon.address, namespace="agents") as client:
        fp, sid = await put_session(client, model, toks[:P])
        # Other live sessions' blocks push this one's out of DRAM: its global KV now lives on NVMe. (They
        # must be sessions: eviction takes blocks no session references first.)
        others = []
        for s in range(6):
            other = tokens_for(4 * BT, seed=100 + s)
            await client.put(fp, other, block_tensor(model, other))
            others.append((await client.open_session(fp, tokens=other)).session_id)
        for sid_other in others:
            await client.close_session(sid_other)
        stats = await client.stats()
        assert stats.tiers[0].demotions > 0
        assert any(b.tier == "nvme" for b in (await client.lookup(fp, toks[:P])).blocks)
        await client.suspend_session(sid)  # leaves the hot tiers: no window anywhere

        logits, source = await next_logits(client, model, fp, sid, toks)
        assert source == "replay"
        assert torch.equal(logits, reference_logits(model, toks, P))  # bit for bit (batch-invariant numerics)

        again, source = await next_logits(client, model, fp, sid, toks)
        assert source == "hot" and torch.equal(again, logits)
        await client.suspend_session(sid)
        _, source = await next_logits(client, model, fp, sid, toks)
        assert source == "replay"

        stats = await client.stats()
        assert stats.replay.replays == 2 and stats.replay.sessions == 1
        assert stats.replay.replayed_tokens == 2 * min(P, exact_bound(model.replay_spec))
        m = next(m for m in stats.models if m.model_fingerprint == fp)
        assert m.replayable
        # Only the 2 global layers of 4 are persisted: half the bytes of keeping every layer.
        assert m.stored_bytes * 2 == m.all_layers_bytes


async def test_approx_mode_is_close_but_not_exact(daemon, model: HybridDecoder) -> None:  # type: ignore[no-untyped-def]
    toks = tokens_for(P + 1, seed=5)
    async with EngramClient(daemon.address) as client:
        fp, sid = await put_session(client, model, toks[:P], mode="approx", approx_k=1.0)
        logits, _ = await next_logits(client, model, fp, sid, toks)
        ref = reference_logits(model, toks, P)
        assert not torch.equal(logits, ref)  # R = W < L_swa * (W - 1): an approximation
        assert float((logits - ref).abs().max()) < 10 * float(ref.abs().max())
        info = await client.open_session(fp, mode="approx", approx_k=1.0, tokens=toks[:P])
        assert info.mode == SessionMode.APPROX and info.approx_k == 1.0


async def test_persist_mode_serves_the_uploaded_window_without_a_model(server_factory, model: HybridDecoder) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()  # no replay model at all
    toks = tokens_for(P + 1, seed=7)
    async with EngramClient(srv.address) as client:
        fp = await client.register_model(model_spec_for(model, block_tokens=BT, codec="raw"))
        await client.put(fp, toks[:P], block_tensor(model, toks[:P]))
        with pytest.raises(errors.FailedPrecondition, match="no replay model"):
            await client.open_session(fp, mode="exact", tokens=toks[:P])
        info = await client.open_session(fp, mode="persist")
        ref = model.prefill(torch.as_tensor(toks[:P], dtype=torch.long), logits=False).swa_window(P)
        win = torch.stack([torch.stack((k, v)) for k, v in ref.kv])
        await client.append_session(info.session_id, toks[:P], window=win, window_start=ref.start)
        await client.suspend_session(info.session_id)  # persisted windows survive going cold
        logits, source = await next_logits(client, model, fp, info.session_id, toks)
        assert source == "persisted" and torch.equal(logits, reference_logits(model, toks, P))
        stats = await client.stats()
        assert stats.replay.persisted_window_bytes == win.numel() * win.element_size()
        assert not stats.models[0].replayable
        # A window of the wrong shape, or for the wrong position, is refused.
        with pytest.raises(errors.InvalidArgument, match="does not fit"):
            await client.append_session(info.session_id, toks[P : P + 1], window=win[:, :, 1:], window_start=P - 5)
        with pytest.raises(errors.InvalidArgument, match="serves position"):
            await client.append_session(info.session_id, toks[P : P + 1], window=win, window_start=ref.start)
        with pytest.raises(errors.FailedPrecondition, match="persist mode"):
            await client.resume(info.session_id, position=P - 3)


async def test_fork_shares_the_prefix_and_resumes(daemon, model: HybridDecoder) -> None:  # type: ignore[no-untyped-def]
    toks = tokens_for(P + 1, seed=9)
    async with EngramClient(daemon.address) as client:
        fp, sid = await put_session(client, model, toks[:P])
        child = await client.fork_session(sid, position=40)
        assert child.tokens == 40 and child.parent == sid
        logits, source = await next_logits(client, model, fp, child.session_id, toks)
        assert source == "replay" and torch.equal(logits, reference_logits(model, toks, 40))
        stats = await client.stats()
        assert stats.models[0].blocks == 4  # no block was copied for the fork
        await client.close_session(child.session_id)
        with pytest.raises(errors.NotFound):
            await client.resume(child.session_id)


async def test_bad_session_requests(daemon, model: HybridDecoder) -> None:  # type: ignore[no-untyped-def]
    toks = tokens_for(P, seed=11)
    async with EngramClient(daemon.address, namespace="a") as client:
        fp, sid = await put_session(client, model, toks)
        with pytest.raises(errors.InvalidArgument, match="past the session's end"):
            await client.resume(sid, position=P + 1)
        with pytest.raises(errors.NotFound, match="no session"):
            await client.resume("nope")
        with pytest.raises(errors.NotFound, match="no session"):
            await client.resume(sid, namespace="b")  # another tenant cannot see it
        with pytest.raises(errors.InvalidArgument, match="persist-mode"):
            await client.append_session(sid, [1], window=torch.zeros(2, 2, 7, 2, 16), window_start=P - 6)
        with pytest.raises(errors.InvalidArgument, match="approx_k"):
            await client.open_session(fp, mode="approx")
        with pytest.raises(errors.InvalidArgument, match="already exists"):
            await client.open_session(fp, session_id=sid)
        unstored = await client.open_session(fp, tokens=tokens_for(P, seed=12))
        with pytest.raises(errors.FailedPrecondition, match="not stored"):
            await client.resume(unstored.session_id)
        other = model_spec_for(HybridDecoder(HybridConfig(layers=gpt_oss_pattern(4), seed=99)), block_tokens=BT)
        fp_other = await client.register_model(other)
        with pytest.raises(errors.FailedPrecondition, match="no replay model"):
            await client.open_session(fp_other)
        # The daemon kept serving: the good session still resumes.
        assert (await client.resume(sid)).source == "replay"


async def test_resume_sends_the_global_kv_decoded_reading_each_block_as_it_sends_it(daemon, model: HybridDecoder,  # type: ignore[no-untyped-def]
                                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay reads and decodes the session's blocks; the global KV the worker gets is sent decoded in the
    Resume, each block read and decoded once more as it is sent (keeping the replay's decode for the stream held
    the whole prefix for a slow reader: tests/test_resume_memory.py), and none by a Get on the worker (a spy on
    the daemon's real store counts reads, by gRPC or the data channel, and decodes; the calls go through)."""
    toks = tokens_for(P + 1, seed=11)
    reads: list[bytes] = []
    decodes: list[bytes] = []
    store = daemon.store
    real_read, real_view, real_decode = store.read, store.read_view, store.decode

    async def read(meta, **kw):  # type: ignore[no-untyped-def]
        reads.append(meta.key)
        return await real_read(meta, **kw)

    async def read_view(meta, **kw):  # type: ignore[no-untyped-def]  # the data channel's Get reads this way
        reads.append(meta.key)
        return await real_view(meta, **kw)

    def decode(payload, meta, **kw):  # type: ignore[no-untyped-def]
        decodes.append(meta.key)
        return real_decode(payload, meta, **kw)

    async with EngramClient(daemon.address) as client:
        fp, sid = await put_session(client, model, toks[:P])
        monkeypatch.setattr(store, "read", read)
        monkeypatch.setattr(store, "read_view", read_view)
        monkeypatch.setattr(store, "decode", decode)
        r, global_kv = await client.resume_kv(fp, sid)
        assert r.source == "replay"
        keys = [b.key for b in r.blocks]
        assert len(keys) == -(-P // BT) and sorted(reads) == sorted(keys * 2) and sorted(decodes) == sorted(keys * 2)
        assert torch.equal(global_kv, block_tensor(model, toks[:P]))
        # A hot window was not replayed: asked for the KV, the daemon reads and decodes it, once.
        reads.clear(), decodes.clear()
        r, again = await client.resume_kv(fp, sid)
        assert r.source == "hot" and sorted(reads) == sorted(keys) and sorted(decodes) == sorted(keys)
        assert torch.equal(again, global_kv)
        # Without it, a hot Resume reads nothing.
        reads.clear(), decodes.clear()
        plain = await client.resume(sid)
        assert plain.global_kv is None and not reads and not decodes
        logits = decode_next(model, int(toks[P]), global_kv,
                             SwaWindow(r.position, r.window_start, tuple((la[0], la[1]) for la in r.window))).logits
        assert torch.equal(logits, reference_logits(model, toks, P))


async def test_a_rebuilt_window_is_dropped_when_its_blocks_leave_memory(daemon, model: HybridDecoder) -> None:  # type: ignore[no-untyped-def]
    toks = tokens_for(P + 1, seed=21)
    async with EngramClient(daemon.address) as client:
        fp, sid = await put_session(client, model, toks[:P])
        kept = await client.open_session(fp, mode="persist")  # a persisted window: nothing could rebuild it
        short = tokens_for(BT + 3, seed=22)
        await client.put(fp, short, block_tensor(model, short))
        ref = model.prefill(torch.as_tensor(short, dtype=torch.long), logits=False).swa_window(len(short))
        win = torch.stack([torch.stack((k, v)) for k, v in ref.kv])
        await client.append_session(kept.session_id, short, window=win, window_start=ref.start)
        assert (await client.resume(sid)).source == "replay"
        stats = await client.stats()
        assert stats.replay.hot_sessions == 1 and stats.replay.windows_dropped_cold == 0
        assert (await client.resume(sid)).source == "hot"
        # Other sessions' blocks push this one's out of DRAM to NVMe (open sessions' blocks: eviction takes
        # unreferenced ones first, and there are none).
        others = []
        for s in range(6):
            other = tokens_for(4 * BT, seed=200 + s)
            await client.put(fp, other, block_tensor(model, other))
            others.append((await client.open_session(fp, tokens=other)).session_id)
        for sid_other in others:
            await client.close_session(sid_other)
        assert any(b.tier == "nvme" for b in (await client.lookup(fp, toks[:P])).blocks)
        stats = await client.stats()
        assert stats.replay.hot_sessions == 0 and stats.replay.windows_dropped_cold == 1
        assert stats.replay.hot_window_bytes == 0
        assert (await client.resume(kept.session_id)).source == "persisted"
        logits, source = await next_logits(client, model, fp, sid, toks)
        assert source == "replay" and torch.equal(logits, reference_logits(model, toks, P))


async def test_another_tenant_cannot_resume_a_session_or_take_its_global_kv(server_factory, model_file: Path,  # type: ignore[no-untyped-def]
                                                                              model: HybridDecoder) -> None:
    """Bob asks for Alice's session with its decoded global KV, by id, in his namespace and in hers: the
    answers are NOT_FOUND and PERMISSION_DENIED, and nothing of her KV comes back."""
    auth = {"auth.tenants.alice.token": "alice-token", "auth.tenants.bob.token": "bob-token",
            "auth.salt_secret": "test-secret"}
    srv = await server_factory(**{"replay.models": str(model_file), **auth})
    toks = tokens_for(P + 1, seed=31)
    async with EngramClient(srv.address, token="alice-token", namespace="alice") as alice, \
            EngramClient(srv.address, token="bob-token", namespace="bob") as bob:
        fp, sid = await put_session(alice, model, toks[:P])
        with pytest.raises(errors.NotFound):
            await bob.resume(sid, with_global_kv=True)
        with pytest.raises(errors.PermissionDenied):
            await bob.resume(sid, namespace="alice", with_global_kv=True)
        r, kv = await alice.resume_kv(fp, sid)  # hers still answers, with her KV
        assert r.source == "replay" and torch.equal(kv, block_tensor(model, toks[:P]))


@pytest.mark.parametrize("layers,window", [(gpt_oss_pattern(4), 1), (("global",) * 3, 8)],
                         ids=["sliding-window-1", "no-sliding-layer"])
async def test_a_model_with_nothing_to_rebuild_resumes_with_an_empty_window(server_factory, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                            layers: tuple[str, ...], window: int) -> None:
    """A sliding window of 1 (a query sees only itself) or no sliding layer leaves no row to rebuild: Resume
    answers the global KV and a window of 0 rows, replayed and hot, and the next token's logits are the
    uninterrupted run's (every Resume failed in the client with frombuffer's bare ValueError on the empty window)."""
    model = HybridDecoder(HybridConfig(layers=layers, window=window, dtype=torch.float32, seed=5))
    save_decoder(model, tmp_path / "model.safetensors")
    srv = await server_factory(**{"replay.models": str(tmp_path / "model.safetensors")})
    toks = tokens_for(P + 1, seed=51)
    sliding = sum(1 for kind in layers if kind == "sliding")
    async with EngramClient(srv.address) as client:
        fp, sid = await put_session(client, model, toks[:P])
        for source in ("replay", "hot"):
            r, global_kv = await client.resume_kv(fp, sid)
            assert r.source == source and r.replayed_tokens == 0 and r.position == P and r.window_start == P
            assert tuple(r.window.shape) == (sliding, 2, 0, model.config.n_kv_heads, model.config.head_dim)
            assert torch.equal(global_kv, block_tensor(model, toks[:P]))
            logits = decode_next(model, int(toks[P]), global_kv, SwaWindow(
                r.position, r.window_start, tuple((la[0], la[1]) for la in r.window))).logits
            assert torch.equal(logits, reference_logits(model, toks, P))


async def test_exact_replay_of_a_quantized_model_is_exact_to_the_stored_kv_not_to_the_uninterrupted_run(  # type: ignore[no-untyped-def]
        daemon, model: HybridDecoder) -> None:
    """docs/REPLAY.md "Lossy codecs": with nvfp4 blocks, the daemon's exact replay rebuilds, bit for bit and on
    every replay, the window a replay over the stored KV as decoded gives (here, in process, at the bound and past
    it), and its logits are those of a decode over that KV; it is not the uninterrupted prefill's window (off by
    about 3%), which no worker computing per layer could match."""
    toks = tokens_for(P + 1, seed=61)
    async with EngramClient(daemon.address) as client:
        fp = await client.register_model(model_spec_for(model, block_tokens=BT, codec="nvfp4"))
        await client.put(fp, toks[:P], block_tensor(model, toks[:P]))
        sid = (await client.open_session(fp, mode="exact", tokens=toks[:P])).session_id
        r, stored_kv = await client.resume_kv(fp, sid)
        await client.suspend_session(sid)
        again, _ = await client.resume_kv(fp, sid)
    assert r.source == again.source == "replay" and torch.equal(r.window, again.window)
    window = SwaWindow(r.position, r.window_start, tuple((la[0], la[1]) for la in r.window))
    tokens = torch.as_tensor(toks[:P], dtype=torch.long)
    for extra in (0, 5):
        local = reconstruct_swa(model, tokens, stored_kv, ReplayMode.fixed(exact_bound(model.replay_spec) + extra))
        assert window_error(local.window, window) == 0.0
    uninterrupted = model.prefill(tokens, logits=False).swa_window(P)
    assert window_error(window, uninterrupted) > 1e-3
    assert torch.equal(decode_next(model, int(toks[P]), stored_kv, window).logits,
                       decode_next(model, int(toks[P]), stored_kv, local.window).logits)


async def test_a_resume_asking_for_the_global_kv_as_one_tensor_is_refused_before_any_replay(daemon, model: HybridDecoder) -> None:  # type: ignore[no-untyped-def]
    """A client from before ResumeRequest.global_kv_by_block asks for the global KV as one tensor under one
    checksum, which the daemon could only send by decoding the whole prefix first and holding it for the stream:
    FAILED_PRECONDITION saying what to do, before any replay, and the same session still resumes."""
    toks = tokens_for(P + 1, seed=41)
    async with EngramClient(daemon.address) as client:
        fp, sid = await put_session(client, model, toks[:P])
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            req = pb.ResumeRequest(session=pb.SessionRef(namespace="default", session_id=sid), with_global_kv=True)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in engram_pb2_grpc.EngramStub(channel).Resume(req):
                    pass
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block by block" in (refused.value.details() or "") and "upgrade the client" in (refused.value.details() or "")
        assert (await client.stats()).replay.replays == 0
        r, global_kv = await client.resume_kv(fp, sid)
        assert r.source == "replay" and torch.equal(global_kv, block_tensor(model, toks[:P]))


async def test_a_hot_resume_answers_the_window_it_found_when_a_suspend_lands_meanwhile(daemon, model: HybridDecoder,  # type: ignore[no-untyped-def]
                                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A Resume with the global KV reads the stored blocks after finding the hot window; a Suspend landing during
    that read (the first block's, through the daemon's real store) drops the session's window. The answer is the
    window found, for its position, with the whole global KV (it was None: the RPC failed INTERNAL; another
    position's Resume meanwhile made it that position's window)."""
    toks = tokens_for(P + 1, seed=31)
    async with EngramClient(daemon.address) as client:
        fp, sid = await put_session(client, model, toks[:P])
        first = await client.resume(sid)
        assert first.source == "replay"
        sessions, store = daemon.sessions, daemon.store
        real_read = store.read
        suspended: list[str] = []

        async def read_suspending(meta, **kw):  # type: ignore[no-untyped-def]
            if not suspended:
                suspended.append(sessions.suspend("default", sid).id)  # the window goes
            return await real_read(meta, **kw)

        monkeypatch.setattr(store, "read", read_suspending)
        resumed, global_kv = await client.resume_kv(fp, sid)
        monkeypatch.setattr(store, "read", real_read)
        assert suspended and not sessions.get("default", sid).info().hot
        assert resumed.source == "hot" and resumed.position == P and resumed.window_start == P - (model.config.window - 1)
        assert torch.equal(global_kv, block_tensor(model, toks[:P]))
        logits = decode_next(model, int(toks[P]), global_kv, SwaWindow(
            resumed.position, resumed.window_start, tuple((la[0], la[1]) for la in resumed.window))).logits
        assert torch.equal(logits, reference_logits(model, toks, P))
        logits, _ = await next_logits(client, model, fp, sid, toks)  # replayed again: still the right logits
        assert torch.equal(logits, reference_logits(model, toks, P))


async def test_with_no_hot_windows_kept_every_resume_replays_and_answers(server_factory, model_file: Path,  # type: ignore[no-untyped-def]
                                                                          model: HybridDecoder, tmp_path: Path) -> None:
    """replay.max_hot_windows = 0: no rebuilt window is kept hot, so each Resume replays, and answers the window
    it rebuilt (it answered INTERNAL: the window was dropped before the answer read it)."""
    srv = await server_factory(**{"replay.models": str(model_file), "replay.max_hot_windows": 0,
                                  "tiers.nvme.path": str(tmp_path / "nvme")})
    toks = tokens_for(P + 1, seed=32)
    async with EngramClient(srv.address) as client:
        fp, sid = await put_session(client, model, toks[:P])
        for _ in range(2):
            logits, source = await next_logits(client, model, fp, sid, toks)
            assert source == "replay" and torch.equal(logits, reference_logits(model, toks, P))
        assert (await client.stats()).replay.hot_sessions == 0


async def test_replays_run_a_bounded_number_at_once_and_a_cancelled_wait_never_runs(  # type: ignore[no-untyped-def]
        server_factory, model_file: Path, model: HybridDecoder, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One replay at a time here (replay.max_concurrent = 1), one Resume waiting (max_queued = 1): a third is
    refused RESOURCE_EXHAUSTED; the waiting one, cancelled, never runs; the daemon's own threads (decodes of the
    global KV) are not the replays'. Replays were unbounded on the shared executor: twelve cancelled Resumes
    kept running and slowed another tenant's Resume twenty-fold. The running replay is held at a gate (the real
    rebuild, run once the gate opens) so the others find it running."""
    srv = await server_factory(**{"replay.models": str(model_file), "replay.max_concurrent": 1,
                                  "replay.max_queued": 1, "tiers.nvme.path": str(tmp_path / "nvme")})
    sessions = srv.sessions
    gate, started = threading.Event(), []
    real_rebuild = sessions.runtime.rebuild

    def rebuild_after_the_gate(model_, tokens, global_kv, mode):  # type: ignore[no-untyped-def]
        started.append((len(tokens), threading.current_thread().name))
        assert gate.wait(30)
        return real_rebuild(model_, tokens, global_kv, mode)

    monkeypatch.setattr(sessions.runtime, "rebuild", rebuild_after_the_gate)
    reads = []
    real_read = srv.store.read

    async def counted_read(meta, *a, **k):  # type: ignore[no-untyped-def]
        reads.append(meta.key)
        return await real_read(meta, *a, **k)

    monkeypatch.setattr(srv.store, "read", counted_read)
    toks = tokens_for(P + 1, seed=33)
    async with EngramClient(srv.address) as client:
        fp, sid = await put_session(client, model, toks[:P])
        running = asyncio.create_task(client.resume(sid, position=P))
        while not started:
            await asyncio.sleep(0.01)
        read_by_the_running_one = len(reads)
        waiting = asyncio.create_task(client.resume(sid, position=P - 1))
        while sessions._replay_turns.waiting < 1:
            await asyncio.sleep(0.01)
        with pytest.raises(errors.ResourceExhausted, match=r"replay\.max_queued"):
            await client.resume(sid, position=P - 2)
        # Neither the waiting Resume nor the refused one read its prefix: each had read and decoded it all first
        assert len(reads) == read_by_the_running_one
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.set()
        assert (await running).source == "replay"
        logits, _ = await next_logits(client, model, fp, sid, toks)
        assert torch.equal(logits, reference_logits(model, toks, P))
    assert [n for n, _ in started] == [P]  # the cancelled one never ran
    assert all(name.startswith("engram-replay") for _, name in started)


async def test_a_session_suspended_while_its_replay_runs_stays_cold(server_factory, model_file: Path,  # type: ignore[no-untyped-def]
                                                                    model: HybridDecoder, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Suspend that lands while a Resume replays: the Resume still answers its window, but the session stays
    cold (it was made hot again when the replay ended, holding a window in memory its client had let go). The
    replay is held at a gate (the real rebuild, run once the gate opens) so the Suspend lands inside it."""
    srv = await server_factory(**{"replay.models": str(model_file), "tiers.nvme.path": str(tmp_path / "nvme")})
    gate, started = threading.Event(), threading.Event()
    real_rebuild = srv.sessions.runtime.rebuild

    def rebuild_after_the_gate(model_, tokens, global_kv, mode):  # type: ignore[no-untyped-def]
        started.set()
        assert gate.wait(30)
        return real_rebuild(model_, tokens, global_kv, mode)

    monkeypatch.setattr(srv.sessions.runtime, "rebuild", rebuild_after_the_gate)
    toks = tokens_for(P + 1, seed=34)
    async with EngramClient(srv.address) as client:
        fp, sid = await put_session(client, model, toks[:P])
        resume = asyncio.create_task(client.resume(sid))
        while not started.is_set():
            await asyncio.sleep(0.01)
        await client.suspend_session(sid)
        gate.set()
        resumed = await resume
        assert resumed.source == "replay" and resumed.position == P
        stats = await client.stats()
        assert stats.replay.hot_sessions == 0 and stats.replay.hot_window_bytes == 0
        monkeypatch.setattr(srv.sessions.runtime, "rebuild", real_rebuild)
        logits, source = await next_logits(client, model, fp, sid, toks)
        assert source == "replay" and torch.equal(logits, reference_logits(model, toks, P))


async def test_one_tenants_resumes_do_not_push_another_tenants_window_out_of_the_hot_set(  # type: ignore[no-untyped-def]
        server_factory, model_file: Path, model: HybridDecoder) -> None:
    """replay.max_hot_windows = 2, two tenants: Carol's Resume makes her window hot, then Bob resumes three sessions
    of his. Her session stays hot (ListSessions) and her next Resume is answered from it: the full set lets go of
    the least recent window of the tenant holding the most, Bob. One set pushed out least recent first, every
    tenant's: Bob's Resumes made Carol's next one replay (seconds on a real model), and her session going cold told
    her that others had resumed sessions, and how many (a review, session 51). Control: Bob's own first window
    went to his later ones (his Resume of it replays)."""
    srv = await server_factory(**{"replay.models": str(model_file), "replay.max_hot_windows": 2,
                                  "auth.salt_secret": "s", "auth.tenants.bob.token": "bob-tok",
                                  "auth.tenants.carol.token": "carol-tok"})
    toks = tokens_for(P + 1, seed=40)
    async with EngramClient(srv.address, token="carol-tok", namespace="carol") as c, \
            EngramClient(srv.address, token="bob-tok", namespace="bob") as b:
        fp, hers = await put_session(c, model, toks[:P])
        assert (await c.resume_kv(fp, hers))[0].source == "replay"
        his = [await put_session(b, model, toks[:P]) for _ in range(3)]
        for bfp, sid in his:
            assert (await b.resume_kv(bfp, sid))[0].source == "replay"
        assert [s.info.hot for s in await c.list_sessions()] == [True]
        assert (await c.resume_kv(fp, hers))[0].source == "hot"
        assert (await b.resume_kv(*his[0]))[0].source == "replay"
        assert (await b.stats()).replay.hot_sessions == 1 and (await c.stats()).replay.hot_sessions == 1
