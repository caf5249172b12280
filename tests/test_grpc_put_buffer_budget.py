"""gRPC Put streams' reassembly under the daemon's one receive budget (server.receive_buffer_bytes,
engram/server/recvbudget.py), the data channel's too, against a real daemon over TCP and a unix socket: each Put
stream reassembled a block of up to server.max_block_bytes from its chunks with no bound across streams (32
streams each sending 28 of a 32 MiB block grew an `engram serve` by 1.3 GiB); now a block's announced bytes are
taken before more of it is read, the streams past the budget wait unread and are stored once room comes, or are
refused RESOURCE_EXHAUSTED past server.receive_buffer_wait_s; what a stream holds goes back on every exit; one
tenant holds at most its share."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from rawgrpc import RawCall
from test_data_channel import block_header, four_mib_model, raw_payload

from engram import errors
from engram.client import EngramClient
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc

from helpers import random_kv, tokens

BLOCK = 4 * 2**20  # four_mib_model's raw block
CHUNK = 2**20
# server.max_message_bytes: a chunk and its block's header. Each Put stream holds that much of the budget for its
# message, beside the blocks' bytes.
ROOM = CHUNK + 2**16
BUDGET = 16 * 2**20  # for blocks
SMALL = {"server.max_block_bytes": "4MiB", "server.receive_buffer_bytes": BUDGET + 12 * 2**20,
         "server.max_message_bytes": ROOM, "server.chunk_bytes": CHUNK, "server.data_channel": False}


class StalledPut:
    """A gRPC Put stream of one 4 MiB block sending all its chunks but the last, then waiting for `finish` (a
    sender that has almost finished), on a channel of its own; its chunks wait for `gate`, when given, after the
    stream's PutHeader."""

    def __init__(self, srv, ns: str, fp: bytes, seed: int, token: str = "",  # type: ignore[no-untyped-def]
                 gate: asyncio.Event | None = None) -> None:
        spec = four_mib_model()
        payload = raw_payload(random_kv(spec, 512, seed=seed))
        self.header = block_header(spec, tokens(512, seed=seed), payload)
        self.ns, self.fp, self.payload = ns, fp, payload
        self.go_on = asyncio.Event()
        self.gate = gate
        self.channel = grpc.aio.insecure_channel(srv.address, options=[("grpc.max_send_message_length", 2**26)])
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.call = pb_grpc.EngramStub(self.channel).Put(self._messages(), metadata=metadata)

    async def _messages(self) -> AsyncIterator[pb.PutRequest]:
        yield pb.PutRequest(header=pb.PutHeader(namespace=self.ns, model_fingerprint=self.fp))
        if self.gate is not None:
            await self.gate.wait()
        for off in range(0, BLOCK, CHUNK):
            last = off + CHUNK >= BLOCK
            if last:
                await self.go_on.wait()
            yield pb.PutRequest(chunk=pb.BlockChunk(header=self.header if off == 0 else None,
                                                    data=self.payload[off:off + CHUNK], last=last))

    async def finish(self) -> pb.PutResponse:
        self.go_on.set()
        return await self.call

    async def close(self) -> None:
        await self.channel.close()


async def stalled_puts(srv, n: int, *, ns: str = "tenant-a", token: str = "", seed: int = 0,  # type: ignore[no-untyped-def]
                       gate: asyncio.Event | None = None) -> list[StalledPut]:
    async with EngramClient(srv.address, namespace=ns, token=token, zero_copy=False) as c:
        fp = await c.register_model(four_mib_model())
    return [StalledPut(srv, ns, fp, seed + i, token, gate) for i in range(n)]


def blocks_held(srv) -> int:  # type: ignore[no-untyped-def]
    """The receive budget taken for blocks' bytes (the rest is the streams' message room)."""
    budget = srv.service.receive_budget
    return int(budget.used - budget.meta_used)


async def peak_held(srv, seconds: float) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """The most of the receive budget taken for blocks, and in all, sampled over `seconds`."""
    budget, peak, peak_all, end = srv.service.receive_budget, 0, 0, time.monotonic() + seconds
    while time.monotonic() < end:
        peak, peak_all = max(peak, blocks_held(srv)), max(peak_all, budget.used)
        await asyncio.sleep(0.005)
    return peak, peak_all


async def settles_to_zero(srv) -> bool:  # type: ignore[no-untyped-def]
    for _ in range(500):
        if srv.service.receive_budget.used == 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_put_streams_past_receive_buffer_bytes_wait_unread_and_are_all_stored(server_factory) -> None:  # type: ignore[no-untyped-def]
    """Ten Put streams each sending 3 of a 4 MiB block's 4 chunks to a daemon with a budget of 16 MiB for blocks
    (beside their messages' room): four hold their blocks' bytes, the other six wait for room unread (each had reassembled its block's chunks with no bound
    at all), and every block is stored once the senders finish: backpressure, not failure; the budget is all
    given back (engram_receive_buffer_budget_held_bytes 0)."""
    srv = await server_factory(**SMALL, **{"server.receive_buffer_wait_s": 60, "server.metrics_port": -1})
    budget = srv.service.receive_budget
    gate = asyncio.Event()  # the blocks once every stream holds its message room: four fit, whatever the order
    puts = await stalled_puts(srv, 10, gate=gate)
    for _ in range(500):
        if budget.meta_used == 10 * ROOM:
            break
        await asyncio.sleep(0.01)
    assert budget.meta_used == 10 * ROOM, "the ten Put streams never took their messages' room"
    gate.set()
    peak, peak_all = await peak_held(srv, 1.5)
    assert budget.waits >= 6, f"only {budget.waits} Put streams waited for room for 16 MiB of blocks"
    assert peak == 4 * BLOCK and peak_all <= budget.total
    assert srv.metrics.registry.get_sample_value("engram_receive_buffer_budget_held_bytes") == budget.used
    replies = await asyncio.wait_for(asyncio.gather(*(p.finish() for p in puts)), 60)
    assert all(r.stored == 1 for r in replies)
    assert len(srv.store) == 10 and budget.refusals == 0
    assert await settles_to_zero(srv)
    assert srv.metrics.registry.get_sample_value("engram_receive_buffer_budget_held_bytes") == 0
    for p in puts:
        await p.close()


async def test_a_put_stream_past_receive_buffer_wait_s_is_refused_and_a_cancelled_or_gone_one_gives_its_bytes_back(
        server_factory) -> None:  # type: ignore[no-untyped-def]
    """While four stalled Put streams hold the budget (their blocks and their messages' room), a client's put waits server.receive_buffer_wait_s and
    is told RESOURCE_EXHAUSTED naming the setting (before, it was stored past the budget); a holder cancelled, and
    one whose client went (its channel closed), give their bytes back, and the next put is stored."""
    # Room for four blocks and five streams' messages: the client's stream reads, its block waits.
    srv = await server_factory(**{**SMALL, "server.receive_buffer_bytes": BUDGET + 6 * 2**20,
                                  "server.receive_buffer_wait_s": 0.5})
    budget = srv.service.receive_budget
    holders = await stalled_puts(srv, 4)
    for _ in range(500):
        if blocks_held(srv) == 4 * BLOCK:
            break
        await asyncio.sleep(0.01)
    assert blocks_held(srv) == 4 * BLOCK, "the four stalled puts never took their blocks"
    spec = four_mib_model()
    async with EngramClient(srv.address, namespace="tenant-a", zero_copy=False, timeout_s=10) as c:
        fp = await c.register_model(spec)
        t0 = time.monotonic()
        with pytest.raises(errors.ResourceExhausted, match=r"server\.receive_buffer_bytes.*receive_buffer_wait_s"):
            await c.put(fp, tokens(512, seed=90), random_kv(spec, 512, seed=90))
        assert 0.5 <= time.monotonic() - t0 < 8
        assert budget.refusals == 1 and blocks_held(srv) == 4 * BLOCK
        holders[0].call.cancel()
        await holders[1].close()  # the client gone
        for _ in range(500):
            if blocks_held(srv) == 2 * BLOCK and budget.meta_used == 2 * ROOM:
                break
            await asyncio.sleep(0.01)
        assert blocks_held(srv) == 2 * BLOCK and budget.meta_used == 2 * ROOM, "a cancelled or abandoned Put stream kept its block's bytes"
        assert (await c.put(fp, tokens(512, seed=91), random_kv(spec, 512, seed=91))).stored == 1
    assert all(r.stored == 1 for r in await asyncio.gather(*(h.finish() for h in holders[2:])))
    assert await settles_to_zero(srv)
    for h in holders:
        await h.close()


async def test_one_tenants_stalled_put_streams_hold_at_most_its_share_and_another_tenant_is_served(
        server_factory) -> None:  # type: ignore[no-untyped-def]
    """Bob's six stalled Put streams against a 48 MiB budget of which a tenant may hold half: they hold at most 24
    MiB (four blocks and their messages' room), the rest of his wait, and Alice's put is stored at once meanwhile; Bob's are all stored once he finishes
    sending."""
    srv = await server_factory(**{**SMALL, "server.receive_buffer_bytes": 2 * (BUDGET + 8 * 2**20),
                                  "server.receive_buffer_wait_s": 60, "auth.tenants.alice.token": "a-tok",
                                  "auth.tenants.bob.token": "b-tok", "auth.salt_secret": "s"})
    budget = srv.service.receive_budget
    bobs = await stalled_puts(srv, 6, ns="bob", token="b-tok")
    peak, peak_all = await peak_held(srv, 1.5)
    assert peak == 4 * BLOCK and peak_all <= budget.tenant_share, (
        f"Bob's Put streams held {peak_all} bytes, {peak} for blocks; his share is {budget.tenant_share}")
    assert budget.waits >= 2
    spec = four_mib_model()
    async with EngramClient(srv.address, token="a-tok", namespace="alice", zero_copy=False, timeout_s=10) as c:
        fp = await c.register_model(spec)
        t0 = time.monotonic()
        assert (await c.put(fp, tokens(512, seed=80), random_kv(spec, 512, seed=80))).stored == 1
        assert time.monotonic() - t0 < 5, "Alice waited behind Bob's share"
    assert all(r.stored == 1 for r in await asyncio.wait_for(asyncio.gather(*(b.finish() for b in bobs)), 60))
    assert await settles_to_zero(srv)
    for b in bobs:
        await b.close()


def thirty_two_mib_model():  # type: ignore[no-untyped-def]
    """four_mib_model's layout with 4096-token blocks: 32 MiB raw."""
    from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec

    return ModelSpec(name="thirty-two", weights_id="w", codec="raw", layout=KVLayout(
        layers=(LayerSpec(LayerKind.GLOBAL),) * 2, num_kv_heads=8, head_dim=128, dtype=DType.BF16,
        block_tokens=4096))


class CountedPut:
    """A gRPC Put stream of one 32 MiB block that sends up to `upto` of its bytes in 1 MiB chunks and then waits,
    counting the bytes whose message grpc has written (the generator is asked for the next message only once the
    one before was sent): what the daemon's HTTP/2 window let it push."""

    def __init__(self, channel: grpc.aio.Channel, ns: str, fp: bytes, seed: int, upto: int) -> None:
        spec = thirty_two_mib_model()
        self.payload = bytes(spec.layout.block_nbytes(4096))
        self.header = block_header(spec, tokens(4096, seed=seed), self.payload)
        self.ns, self.fp, self.upto, self.pushed = ns, fp, upto, 0
        self.call = pb_grpc.EngramStub(channel).Put(self._messages())

    async def _messages(self) -> AsyncIterator[pb.PutRequest]:
        yield pb.PutRequest(header=pb.PutHeader(namespace=self.ns, model_fingerprint=self.fp))
        for off in range(0, self.upto, CHUNK):
            last = off + CHUNK >= len(self.payload)
            yield pb.PutRequest(chunk=pb.BlockChunk(header=self.header if off == 0 else None,
                                                    data=self.payload[off:off + CHUNK], last=last))
            self.pushed += CHUNK
        if self.upto < len(self.payload):
            await asyncio.Event().wait()  # stalled: never the last chunk


class SlowLink:
    """A TCP relay to a daemon that delays every byte `delay_s` each way: a link of a longer round trip than
    loopback's, over which grpc's BDP probing grows a connection's windows with its traffic (over loopback they
    stayed near grpc's 4 MiB floor unless the machine was loaded, when they grew to whole blocks)."""

    def __init__(self, target: str, delay_s: float) -> None:
        self.host, port = target.rsplit(":", 1)
        self.target_port, self.delay_s = int(port), delay_s
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        self.writers += [writer, up_writer]
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get())[1]:
                await asyncio.sleep(item[0] - time.monotonic())
                dst.write(item[1])
                await dst.drain()

        delivering = asyncio.create_task(deliver())
        try:
            while data := await src.read(2**20):
                queue.put_nowait((time.monotonic() + self.delay_s, data))
            queue.put_nowait((0.0, b""))
            await delivering
        except ConnectionError:
            pass
        finally:
            delivering.cancel()
            dst.close()

    async def close(self) -> None:
        """Both ends of every relayed connection closed: the daemon sees its client gone."""
        self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await self.server.wait_closed()


async def pushed_when_settled(put: CountedPut, quiet_s: float = 1.5, most_s: float = 20.0) -> int:
    """The bytes `put` had pushed once it pushed nothing more for quiet_s."""
    last, since, end = -1, time.monotonic(), time.monotonic() + most_s
    while time.monotonic() < end and time.monotonic() - since < quiet_s:
        if put.pushed != last:
            last, since = put.pushed, time.monotonic()
        await asyncio.sleep(0.05)
    return put.pushed


@pytest.mark.parametrize("transport", ["tcp"])
async def test_a_put_stream_waiting_for_the_budget_lets_its_sender_push_at_most_its_stream_window(
        server_factory) -> None:  # type: ignore[no-untyped-def]
    """Two stalled Put streams hold a 68 MiB budget (64 MiB of blocks); a third, whose 32 MiB block waits for room, has its sender
    push at most server.grpc_stream_window_bytes (4 MiB) past the chunk it was read to, plus the message grpc was
    asked for while reading it: what it holds in grpc's buffers, outside the budget. grpc's BDP probing grew that
    window with the traffic, and the waiting stream's sender pushed the block's whole 31 MiB into the daemon
    unread (96 such streams under a 256 MiB budget grew an `engram serve` by 3 GiB)."""
    srv = await server_factory(**{"server.max_block_bytes": "32MiB", "server.receive_buffer_bytes": "68MiB",
                                  "server.max_message_bytes": ROOM, "server.chunk_bytes": CHUNK,
                                  "server.receive_buffer_wait_s": 60, "server.data_channel": False})
    window = srv.service.config.grpc_stream_window_bytes
    assert window == 4 * 2**20
    budget = srv.service.receive_budget
    async with EngramClient(srv.address, namespace="tenant-a", zero_copy=False) as c:
        fp = await c.register_model(thirty_two_mib_model())
    link = SlowLink(srv.address, delay_s=0.05)
    channel = grpc.aio.insecure_channel(await link.start(), options=[("grpc.max_send_message_length", 2**26)])
    for seed in range(20, 22):  # traffic on the connection, from which grpc's BDP probing grew its window
        assert (await CountedPut(channel, "tenant-a", fp, seed, upto=32 * CHUNK).call).stored == 1
    holders = [CountedPut(channel, "tenant-a", fp, seed, upto=CHUNK) for seed in range(2)]
    for _ in range(500):
        if blocks_held(srv) == 64 * 2**20:
            break
        await asyncio.sleep(0.01)
    assert blocks_held(srv) == 64 * 2**20, "the two stalled puts never took their blocks"
    waiting = CountedPut(channel, "tenant-a", fp, 9, upto=31 * CHUNK)
    try:
        pushed = await pushed_when_settled(waiting)
        assert budget.waits >= 1 and blocks_held(srv) == 64 * 2**20
        assert pushed <= CHUNK + window + 2 * CHUNK, (
            f"a Put stream waiting for the receive budget let its sender push {pushed >> 20} MiB into the daemon; "
            f"its stream window is {window >> 20} MiB")
    finally:
        for p in (*holders, waiting):
            p.call.cancel()
        await channel.close()
        await link.close()
    assert await settles_to_zero(srv)


MESSAGE = 8 * 2**20  # server.max_message_bytes of test_a_put_streams_unfinished_messages_...
WINDOW = 2**20  # its server.grpc_stream_window_bytes


@pytest.mark.parametrize("transport", ["tcp"])
async def test_a_put_streams_unfinished_message_is_held_within_the_receive_budget_and_given_back_when_cut(
        server_factory) -> None:  # type: ignore[no-untyped-def]
    """Eight raw Put streams each announce a first message of almost server.max_message_bytes (8 MiB) and send all
    but its last byte: grpc grows a stream's window to fit a message the handler has asked for, so whatever the
    senders pushed beyond each stream's window (1 MiB) must be room the budget has given them; with a 64 MiB
    budget (32 MiB for metadata) four streams have it and read, four wait for it unread. Before, every stream
    pushed its whole 8 MiB into grpc with nothing taken (128 streams of 64 MiB messages: 8 GiB). Cut, they give
    it all back, and a client's put is stored."""
    srv = await server_factory(**{"server.max_block_bytes": "4MiB", "server.receive_buffer_bytes": "64MiB",
                                  "server.max_message_bytes": MESSAGE, "server.chunk_bytes": "1MiB",
                                  "server.grpc_stream_window_bytes": WINDOW, "server.receive_buffer_wait_s": 60,
                                  "server.data_channel": False})
    budget = srv.service.receive_budget
    calls = [RawCall(srv.address, "/engram.v1.Engram/Put") for _ in range(8)]
    try:
        for call in calls:
            await call.open()
        size = MESSAGE - 1024
        pushed = await asyncio.gather(*(call.push_message(size, size - 1) for call in calls))
        assert not any(call.ended for call in calls), "the daemon ended a stream whose message was under its limit"
        outside = sum(pushed) - budget.used  # what the senders pushed into the daemon that the budget does not hold
        assert outside <= len(calls) * (WINDOW + 64 * 2**10), (
            f"Put streams pushed {sum(pushed) >> 20} MiB of unfinished messages into the daemon, {outside >> 20} MiB "
            f"of it past the {budget.used >> 20} MiB its receive budget holds and their {WINDOW >> 20} MiB windows")
        assert budget.used == budget.meta_used == 4 * MESSAGE and budget.waits >= 4
    finally:
        for call in calls:
            await call.close()
    assert await settles_to_zero(srv), "a cut Put stream kept its message's room"
    spec = four_mib_model()
    async with EngramClient(srv.address, namespace="tenant-a", zero_copy=False, timeout_s=10) as c:
        fp = await c.register_model(spec)
        assert (await c.put(fp, tokens(512, seed=70), random_kv(spec, 512, seed=70))).stored == 1
    assert await settles_to_zero(srv)
