"""Codecs wired into the daemon: the registry, block format v1, encode on put (daemon or client), decode on
get (client or daemon), and bad blocks rejected with a clear status."""

from __future__ import annotations

import struct

import grpc
import pytest
import torch
import xxhash

from engram import errors
from engram.block import checksum
from engram.client import EngramClient
from engram.codec import base, blockformat
from engram.codec.base import Axis
from engram.layout import DType
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

CODECS = ["fp8_e4m3", "nvfp4", "mxfp4"]


def stored_form(kv: torch.Tensor, codec: str) -> torch.Tensor:
    enc = base.codec_by_name(codec)
    return torch.cat([blockformat.decode(blockformat.encode(kv[:, :, s : s + BLOCK_TOKENS], enc))
                      for s in range(0, kv.shape[2], BLOCK_TOKENS)], dim=2)


def test_block_format_round_trip_and_rejections() -> None:
    kv = torch.randn(2, 2, 16, 2, 16).to(torch.bfloat16)
    for name in ["raw", *CODECS]:
        codec = base.codec_by_name(name)
        blob = blockformat.encode(kv, codec)
        assert len(blob) == blockformat.encoded_nbytes(codec, tuple(kv.shape), DType.BF16)
        fmt = blockformat.parse(blob)
        assert (fmt.codec.name, fmt.shape, fmt.dtype) == (name, tuple(kv.shape), DType.BF16)
        out = blockformat.decode(blob)
        assert out.shape == kv.shape and out.dtype == kv.dtype
        if name == "raw":
            assert torch.equal(out, kv)
    blob = bytearray(blockformat.encode(kv, base.codec_by_name("nvfp4")))
    cases = {
        "bad magic": lambda b: b.__setitem__(0, ord("X")),
        "version": lambda b: b.__setitem__(4, 9),
        "header checksum": lambda b: b.__setitem__(20, b[20] ^ 1),
        "body checksum": lambda b: b.__setitem__(len(b) - 1, b[-1] ^ 1),
    }
    for match, damage in cases.items():
        bad = bytearray(blob)
        damage(bad)
        with pytest.raises(errors.InvalidArgument, match=match):
            blockformat.decode(bytes(bad))
    with pytest.raises(errors.InvalidArgument, match="needs"):
        blockformat.decode(bytes(blob[:-3]))
    with pytest.raises(errors.InvalidArgument, match="shorter"):
        blockformat.parse(bytes(blob[:10]))
    with pytest.raises(errors.InvalidArgument, match="unknown codec"):
        base.codec_by_name("int3")


def test_nan_or_inf_is_a_clear_error() -> None:
    kv = torch.randn(1, 2, 16, 1, 16)
    kv[0, 1, 3, 0, 5] = float("nan")
    with pytest.raises(errors.InvalidArgument, match="nvfp4"):
        blockformat.encode(kv, base.codec_by_name("nvfp4"))


@pytest.mark.parametrize("codec", CODECS)
async def test_daemon_encodes_raw_puts_and_client_decodes(client: EngramClient, codec: str) -> None:
    spec = tiny_model(codec=codec)
    fp = await client.register_model(spec)
    toks = tokens(3 * BLOCK_TOKENS + 5)
    kv = random_kv(spec, len(toks))
    await client.put(fp, toks, kv)
    want = stored_form(kv, codec)
    n, got = await client.get_prefix(fp, toks)
    assert n == len(toks) and got is not None and torch.equal(got, want)
    keys = [b.key for b in (await client.lookup(fp, toks)).blocks]
    got_server = torch.cat(await client.get(fp, keys, decode_on_server=True), dim=2)
    assert torch.equal(got_server, want)  # the same bytes, decoded on either side
    stats = await client.stats()
    m = next(m for m in stats.models if m.model_fingerprint == fp)
    assert m.codec == codec and m.raw_bytes == spec.layout.block_nbytes(len(toks))
    assert m.stored_bytes < m.raw_bytes  # fp8 halves, fp4 quarters (plus scales and headers)


async def test_client_encoded_puts_store_the_same_bytes(client: EngramClient) -> None:
    spec = tiny_model(codec="nvfp4")
    fp = await client.register_model(spec)
    a, b = tokens(2 * BLOCK_TOKENS, seed=1), tokens(2 * BLOCK_TOKENS, seed=2)
    kv = random_kv(spec, 2 * BLOCK_TOKENS)
    await client.put(fp, a, kv, encode=True)
    await client.put(fp, b, kv)  # the daemon encodes the same KV
    _, ga = await client.get_prefix(fp, a)
    _, gb = await client.get_prefix(fp, b)
    assert ga is not None and gb is not None and torch.equal(ga, gb)


def test_auto_default_codec_follows_where_the_daemon_encodes() -> None:
    assert base.resolve_default_codec("auto", "triton")[0] == "nvfp4"
    assert base.resolve_default_codec("auto", "cpu")[0] == "nvfp4"
    codec, why = base.resolve_default_codec("auto", "reference")
    assert codec == "raw" and "no GPU or compiled CPU codec" in why
    assert base.resolve_default_codec("mxfp4", "reference") == ("mxfp4", "codec.default")


async def test_default_codec_is_the_daemons_and_in_the_fingerprint(client: EngramClient) -> None:
    stats = await client.stats()
    expected = "nvfp4" if stats.codec_backend in base.FAST_BACKENDS else "raw"
    assert stats.default_codec == expected and stats.default_codec_reason.startswith("auto")
    fp_default = await client.register_model(tiny_model(codec=""))
    assert client.codec_of(fp_default) == expected
    fp_same = await client.register_model(tiny_model(codec=expected))
    fp_other = await client.register_model(tiny_model(codec="mxfp4"))
    assert fp_default == fp_same != fp_other
    with pytest.raises(errors.InvalidArgument, match="unknown codec"):
        await client.register_model(tiny_model(codec="int3"))


async def test_bad_encoded_blocks_are_rejected(server, client: EngramClient) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model(codec="nvfp4")
    fp = await client.register_model(spec)
    toks = tokens(BLOCK_TOKENS)
    kv = random_kv(spec, BLOCK_TOKENS)

    async def put(payload: bytes, codec: str, shape: list[int] | None = None) -> None:
        async def gen():  # type: ignore[no-untyped-def]
            yield pb.PutRequest(header=pb.PutHeader(namespace="tenant-a", model_fingerprint=fp))
            yield pb.PutRequest(chunk=pb.BlockChunk(header=pb.BlockHeader(
                tokens=toks.tolist(), dtype=pb.DTYPE_BF16, shape=shape or list(kv.shape),
                payload_nbytes=len(payload), checksum=checksum(payload), codec=codec), data=payload, last=True))

        async with grpc.aio.insecure_channel(server.address) as ch:
            await pb_grpc.EngramStub(ch).Put(gen())

    good = bytearray(blockformat.encode(kv, base.codec_by_name("nvfp4")))
    bad = bytearray(good)
    bad[-1] ^= 1
    for payload, codec, match in [
        (bytes(bad), "nvfp4", "body checksum"),
        (blockformat.encode(kv, base.codec_by_name("mxfp4")), "mxfp4", "this model stores nvfp4"),
        (bytes(good), "fp8_e4m3", "payload_nbytes"),
        # K per token, V per channel: as valid, the same size, but not what the hit path's batched decode reads
        (blockformat.encode(kv, base.codec_by_name("nvfp4"), k_axis=Axis.TOKEN, v_axis=Axis.CHANNEL), "nvfp4",
         "K per channel and V per token"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await put(payload, codec)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in (info.value.details() or "")
    nan = kv.clone()
    nan[0, 0, 0, 0, 0] = float("inf")
    with pytest.raises(errors.InvalidArgument, match="cannot encode"):
        await client.put(fp, toks, nan)
    assert (await client.lookup(fp, toks)).matched_tokens == 0
    await put(bytes(good), "nvfp4")  # and the daemon still takes a good one
    n, got = await client.get_prefix(fp, toks)
    assert n == BLOCK_TOKENS and got is not None and torch.equal(got, stored_form(kv, "nvfp4"))


async def test_encoded_blocks_survive_the_nvme_tier(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model(codec="nvfp4")
    srv = await server_factory(**{"tiers.dram.capacity": 2 * 2000, "tiers.nvme.path": str(tmp_path / "n")})
    async with EngramClient(srv.address) as c:
        fp = await c.register_model(spec)
        seqs = [tokens(2 * BLOCK_TOKENS, seed=s) for s in range(4)]
        kvs = [random_kv(spec, len(t), seed=s) for s, t in enumerate(seqs)]
        for t, kv in zip(seqs, kvs, strict=True):
            await c.put(fp, t, kv)
        for t, kv in zip(seqs, kvs, strict=True):
            n, got = await c.get_prefix(fp, t)
            assert n == len(t) and got is not None and torch.equal(got, stored_form(kv, "nvfp4"))
        assert (await c.stats()).tiers[0].demotions > 0


def _rescaled_v1(kv: torch.Tensor, codec: str, tensor_scale: float) -> bytes:
    """kv as a v1 block whose K tensor scale (the body's first float32: NVFP4's and FP8's) another encoder set."""
    good = blockformat.encode(kv, base.codec_by_name(codec))
    body = bytearray(good[blockformat.HEADER_LEN:])
    struct.pack_into("<f", body, 0, tensor_scale)
    fmt = blockformat.parse_header(good)
    head = blockformat.header_fields(fmt.codec, fmt.k_axis, fmt.v_axis, fmt.dtype, fmt.shape, len(body),
                                     xxhash.xxh3_64_intdigest(bytes(body)))
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + bytes(body)


@pytest.mark.parametrize("codec", ["nvfp4", "fp8_e4m3"])
async def test_a_float16_block_whose_scales_decode_to_inf_is_refused(server, client: EngramClient, codec: str) -> None:  # type: ignore[no-untyped-def]
    """A worker's own float16 block with a tensor scale in the format's range but far above what float16 values
    give (2^20): its codes decode past 65504, to Inf, so every hit would hand the model Inf. Refused at put
    (INVALID_ARGUMENT); the same bytes as a bfloat16 block decode to finite values and are stored."""
    toks = tokens(BLOCK_TOKENS)
    for dtype, pb_dtype, refused in ((DType.FP16, pb.DTYPE_FP16, True), (DType.BF16, pb.DTYPE_BF16, False)):
        spec = tiny_model(dtype=dtype, codec=codec)
        fp = await client.register_model(spec)
        kv = random_kv(spec, BLOCK_TOKENS)
        payload = _rescaled_v1(kv, codec, 2.0**20)

        async def gen():  # type: ignore[no-untyped-def]
            yield pb.PutRequest(header=pb.PutHeader(namespace="tenant-a", model_fingerprint=fp))  # noqa: B023
            yield pb.PutRequest(chunk=pb.BlockChunk(header=pb.BlockHeader(
                tokens=toks.tolist(), dtype=pb_dtype, shape=list(kv.shape), payload_nbytes=len(payload),  # noqa: B023
                checksum=checksum(payload), codec=codec), data=payload, last=True))  # noqa: B023

        async with grpc.aio.insecure_channel(server.address) as ch:
            if refused:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await pb_grpc.EngramStub(ch).Put(gen())
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "Inf in torch.float16" in (info.value.details() or "")
                assert (await client.lookup(fp, toks)).matched_tokens == 0
            else:
                assert (await pb_grpc.EngramStub(ch).Put(gen())).stored == 1
                n, got = await client.get_prefix(fp, toks)
                assert n == BLOCK_TOKENS and bool(torch.isfinite(got).all())


@pytest.mark.parametrize("data_channel", [True, False])
async def test_a_block_the_client_cannot_encode_fails_the_put_before_anything_is_sent(server, data_channel: bool) -> None:  # type: ignore[no-untyped-def]
    """A NaN in the fourth block of a chain the client encodes itself: InvalidArgument naming it, and nothing
    stored, over the data channel and over gRPC (where the error was raised inside the call's request iterator:
    the caller got a bare CancelledError, and the three blocks before it were stored)."""
    spec = tiny_model(codec="nvfp4")
    async with EngramClient(server.address, namespace="tenant-a", zero_copy=False, data_channel=data_channel) as c:
        fp = await c.register_model(spec)
        toks = tokens(4 * BLOCK_TOKENS, seed=7)
        kv = random_kv(spec, len(toks))
        kv[:, :, 3 * BLOCK_TOKENS + 2] = float("nan")
        with pytest.raises(errors.InvalidArgument, match="cannot encode"):
            await c.put(fp, toks, kv, encode=True)
        assert (await c.lookup(fp, toks, probe=True)).matched_tokens == 0
