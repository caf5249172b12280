"""A stream layout (MLA latent + indexer keys; a compressed seed-like layout) through a real daemon: Put and Get
as bytes, the same-host paths (in-place puts into the shared pool, hits copied out of it), the daemon encoding
raw streams, decoding on request, the NVMe tier across a restart, and the hit path into per-stream
destinations. Raw streams come back bit for bit; quantized ones within their codec's error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engram import errors
from engram.client import EngramClient
from engram.codec import stored, streamformat
from engram.destinations import PagedStreamsKV, StreamsKV
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec, StreamSpec

from helpers import BLOCK_TOKENS, tokens


def mla_spec(codec: str = "raw") -> ModelSpec:
    """DeepSeek-V3.2-like, narrowed: 2 global layers beside 2 sliding ones, a 64 + 16 latent in the model's codec
    and a 32-wide indexer key in FP8; 16-token blocks."""
    layout = KVLayout((LayerSpec(LayerKind.SLIDING, 8), LayerSpec(LayerKind.GLOBAL)) * 2, block_tokens=BLOCK_TOKENS,
                      streams=(StreamSpec("latent", (80,)), StreamSpec("index_k", (32,), codec="fp8_e4m3")),
                      window_streams=(StreamSpec("k", (1, 16)), StreamSpec("v", (1, 16))))
    return ModelSpec("tiny-mla", "seed-0", layout, codec)


def csa_spec() -> ModelSpec:
    """Seed-like: Full / Reindex / Reuse layers with sliding branches, a latent and indexer keys compressed 4:1
    (nvfp4), and a raw stream that must stay exact."""
    layers = tuple(LayerSpec(k, 8) for k in (LayerKind.GLOBAL, LayerKind.REINDEX, LayerKind.REUSE)) * 2
    layout = KVLayout(layers, block_tokens=BLOCK_TOKENS, streams=(
        StreamSpec("latent", (64,), codec="nvfp4", compress=4), StreamSpec("index_k", (32,), codec="nvfp4", compress=4),
        StreamSpec("exact", (2, 8), DType.FP32, codec="raw")), window_streams=(StreamSpec("window", (64,)),))
    return ModelSpec("tiny-csa2", "seed-0", layout, "nvfp4")


def streams_for(spec: ModelSpec, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lay = spec.layout
    return {s.name: torch.randn(lay.stream_shape(s, n), generator=gen).to(s.dtype.torch_dtype)
            for s in lay.stream_specs}


def check_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], spec: ModelSpec) -> None:
    assert set(got) == set(want)
    for s in spec.streams:
        g, w = got[s.name], want[s.name]
        assert g.shape == w.shape and g.dtype == w.dtype, s.name
        if s.codec == "raw" or not w.numel():
            assert torch.equal(g, w), s.name
        else:
            err = float((g.double() - w.double()).pow(2).mean().sqrt() / w.double().pow(2).mean().sqrt())
            assert err < {"nvfp4": 0.105, "fp8_e4m3": 0.03, "mxfp4": 0.125}[s.codec], (s.name, err)


def cat(blocks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([b[k] for b in blocks], dim=1) for k in blocks[0]}


@pytest.mark.parametrize("codec", ["raw", "nvfp4"])
async def test_streams_put_lookup_get_and_hit(client: EngramClient, codec: str) -> None:
    spec = mla_spec(codec)
    fp = await client.register_model(spec)
    toks = tokens(3 * BLOCK_TOKENS + 5)
    data = streams_for(spec, len(toks))
    put = await client.put(fp, toks, data)
    assert put.stored == 4
    hit = await client.lookup(fp, toks)
    assert hit.matched_tokens == len(toks) and [b.key for b in hit.blocks] == list(put.keys)
    got = await client.get(fp, list(put.keys))
    assert all(isinstance(b, dict) for b in got)
    check_close(cat(got), data, spec)
    n, prefix = await client.get_prefix(fp, toks)
    assert n == len(toks)
    check_close(prefix, data, spec)
    # The hit path into the worker's own per-stream buffers, at most the tokens they hold.
    dest = {s.name: torch.zeros(spec.layout.stream_shape(s, 40), dtype=s.dtype.torch_dtype)
            for s in spec.layout.stream_specs}
    res = await client.load_prefix_into(fp, toks, dest)
    assert res.loaded_tokens == 40
    check_close(dest, {k: v[:, :40] for k, v in data.items()}, spec)
    again = await client.put(fp, toks, data)
    assert again.stored == 0  # everything is cached: nothing is stored twice


async def test_compressed_streams_and_partial_blocks_keep_whole_entries(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    spec = csa_spec()
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        for n in (2 * BLOCK_TOKENS + 7, 3):  # a partial block of one whole entry and 3 tokens; one of no entry
            toks = tokens(n, seed=n)
            data = streams_for(spec, n, seed=n)
            assert data["latent"].shape[1] == n // 4
            put = await c.put(fp, toks, data)
            got = await c.get(fp, list(put.keys))
            check_close(cat(got), data, spec)
            m, prefix = await c.get_prefix(fp, toks)
            assert m == n
            check_close(prefix, data, spec)


async def test_in_place_puts_of_streams_seal_what_a_put_stores(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    spec = csa_spec()
    toks = tokens(4 * BLOCK_TOKENS + 9)
    data = streams_for(spec, len(toks))
    async with EngramClient(srv.address, namespace="a", in_place_min_bytes=0) as local, \
            EngramClient(srv.address, namespace="b", zero_copy=False) as remote:
        fp = await local.register_model(spec)
        await remote.register_model(spec)
        put = await local.put(fp, toks, data)  # written into the shared pool in place, sealed by the daemon
        assert put.reserve_ms > 0 and put.stored == 5
        await remote.put(fp, toks, data)  # raw streams as Put messages: the daemon encodes them
        theirs = [b.key for b in (await remote.lookup(fp, toks)).blocks]
        mine = await local.describe_blocks(key_prefixes=[k.hex() for k in put.keys])
        other = await remote.describe_blocks(key_prefixes=[k.hex() for k in theirs])
        assert [b.checksum for b in mine.blocks] == [b.checksum for b in other.blocks]
        a = cat(await local.get(fp, list(put.keys), zero_copy=True))  # copied out of the pool
        b = cat(await remote.get(fp, theirs))
        assert all(torch.equal(a[k], b[k]) for k in a)
        check_close(a, data, spec)
        decoded = cat(await remote.get(fp, theirs, decode_on_server=True))
        assert all(torch.equal(decoded[k], b[k]) for k in b)
        stats = await local.stats()
        model = next(m for m in stats.models if m.name == "tiny-csa2")
        assert model.codec == "nvfp4" and model.all_layers_bytes > model.raw_bytes


async def test_encoded_stream_puts_are_verified(client: EngramClient) -> None:
    spec = mla_spec("nvfp4")
    fp = await client.register_model(spec)
    toks = tokens(2 * BLOCK_TOKENS)
    data = streams_for(spec, len(toks))
    put = await client.put(fp, toks, data, encode=True, skip_cached=False)
    check_close(cat(await client.get(fp, list(put.keys))), data, spec)
    with pytest.raises(errors.InvalidArgument, match="streams"):
        await client.put(fp, toks, torch.zeros(2, 2, len(toks), 1, 16))
    with pytest.raises(errors.InvalidArgument, match="stream latent"):
        await client.put(fp, toks, {**data, "latent": data["latent"][:, :-1]})
    other = dataclasses.replace(spec, codec="mxfp4")
    fp2 = await client.register_model(other)
    blocks = [(toks[:BLOCK_TOKENS], {k: v[:, :BLOCK_TOKENS] for k, v in data.items()})]
    client._layouts[fp2] = spec  # a worker that believes the model stores nvfp4: it sends nvfp4 streams
    with pytest.raises(errors.InvalidArgument, match="neither the block as stored nor with every stream raw"):
        await client.put_blocks(fp2, blocks, codec="nvfp4")  # type: ignore[arg-type]


# The same test on a GPU (the H200): the writer's batched stream encode, the staged loader's batched decode.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the H200)")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["raw", "nvfp4"])
async def test_streams_on_a_device_put_in_place_and_load_into_every_stream_destination(
        server_factory, device: str, codec: str) -> None:  # type: ignore[no-untyped-def]
    """The worker's stream paths on the device the streams live on: an in-place put from that device stores the
    bytes the daemon's own encoding of the same streams stores, and load_prefix_into StreamsKV and PagedStreamsKV
    (pages of 4 tokens, scattered) on that device get what the bytes path returns, bit for bit, nothing past it."""
    srv = await server_factory()
    spec = mla_spec(codec)
    lay = spec.layout
    toks = tokens(3 * BLOCK_TOKENS + 5)
    n = len(toks)
    data = streams_for(spec, n, seed=11)
    async with EngramClient(srv.address, namespace="a", in_place_min_bytes=0) as local, \
            EngramClient(srv.address, namespace="b", zero_copy=False) as remote:
        fp = await local.register_model(spec)
        await remote.register_model(spec)
        put = await local.put(fp, toks, {k: v.to(device) for k, v in data.items()})
        assert put.reserve_ms > 0 and put.stored == 4  # written into the pool in place
        await remote.put(fp, toks, data)  # raw streams as Put messages: the daemon encodes them
        theirs = [b.key for b in (await remote.lookup(fp, toks)).blocks]
        mine = await local.describe_blocks(key_prefixes=[k.hex() for k in put.keys])
        other = await remote.describe_blocks(key_prefixes=[k.hex() for k in theirs])
        assert [b.checksum for b in mine.blocks] == [b.checksum for b in other.blocks]
        want = cat(await remote.get(fp, theirs))  # the bytes path, decoded on the CPU by the reference
        check_close(want, data, spec)

        dest = {s.name: torch.full(lay.stream_shape(s, n + 6), float("nan"), dtype=s.dtype.torch_dtype,
                                   device=device) for s in lay.stream_specs}
        res = await local.load_prefix_into(fp, toks, StreamsKV(lay.stream_specs, dest))
        assert (res.matched_tokens, res.loaded_tokens) == (n, n)
        for name, w in want.items():
            assert torch.equal(dest[name][:, :n].cpu(), w), name
            assert dest[name][:, n:].isnan().all(), name  # nothing past the prefix

        pages = -(-n // 4)
        table = list(range(3 * pages, pages, -2))[:pages]
        paged = {s.name: [torch.full((3 * pages + 1, 4, *s.shape), float("nan"), dtype=s.dtype.torch_dtype,
                                     device=device) for _ in range(lay.persisted_layers)] for s in lay.stream_specs}
        await local.load_prefix_into(fp, toks, PagedStreamsKV(lay.stream_specs, paged, table))
        for name, w in want.items():
            for layer, p in enumerate(paged[name]):
                flat = p[table].flatten(0, 1)
                assert torch.equal(flat[:n].cpu(), w[layer]), (name, layer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200)")
@pytest.mark.parametrize("codec", ["raw", "nvfp4"])
async def test_stream_blocks_in_hbm_load_through_cuda_ipc(tmp_path, codec: str) -> None:  # type: ignore[no-untyped-def]
    """A stream layout's blocks in the daemon's HBM pool (a daemon process on the same GPU) are decoded where they
    lie, the pool opened by CUDA IPC in the worker: the same streams the bytes path returns."""
    from helpers import engram_daemon

    spec = mla_spec(codec)
    toks = tokens(4 * BLOCK_TOKENS + 3)
    data = streams_for(spec, len(toks), seed=12)
    with engram_daemon(tmp_path, "--set", "tiers.hbm.capacity=64MiB", "--set", "tiers.hbm.device=cuda") as (addr, _):
        async with EngramClient(addr, namespace="t", zero_copy=False) as putter:  # a Put lands in HBM
            fp = await putter.register_model(spec)
            await putter.put(fp, toks, data)
            hit = await putter.lookup(fp, toks)
            want = cat(await putter.get(fp, [b.key for b in hit.blocks], zero_copy=False))
        async with EngramClient(addr, namespace="t") as c:
            await c.register_model(spec)
            assert all(b.tier == "hbm" for b in (await c.lookup(fp, toks)).blocks)
            dest = {s.name: torch.zeros(spec.layout.stream_shape(s, len(toks)), dtype=s.dtype.torch_dtype,
                                        device="cuda") for s in spec.layout.stream_specs}
            res = await c.load_prefix_into(fp, toks, StreamsKV(spec.layout.stream_specs, dest))
            assert (res.mapped_blocks, res.bytes_blocks) == (5, 0)
            assert all(torch.equal(dest[k].cpu(), w) for k, w in want.items())


def _nan_latent_scale(blob: bytearray | memoryview, spec: ModelSpec, tokens: int) -> None:
    """Set the nvfp4 latent's first group scale to the E4M3 NaN pattern (after its 4-byte tensor scale)."""
    part = streamformat.plan(spec.streams, spec.layout.persisted_layers, tokens).part("latent")
    assert part.codec.name == "nvfp4"
    blob[part.at + 4] = 0x7F


async def test_worker_encoded_streams_with_bad_scales_are_refused(server_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A worker's own encoding must decode, or every later Get of it fails: a v2 block whose nvfp4 stream has a
    NaN scale is INVALID_ARGUMENT both as Put messages and written in place (checked at CommitPut), and nothing
    of the chain is published; the same puts written right are taken."""
    from engram.writer import PutWriter

    srv = await server_factory()
    spec = mla_spec("nvfp4")
    toks = tokens(2 * BLOCK_TOKENS, seed=7)
    data = streams_for(spec, len(toks), seed=7)
    encode, write = stored.encode_streams, PutWriter.write

    def bad_encode(*args, **kw):  # type: ignore[no-untyped-def]
        blob = encode(*args, **kw)
        fmt = streamformat.parse(blob)
        payloads = [bytearray(streamformat.payload(blob, p)) for p in fmt.parts]
        payloads[[p.name for p in fmt.parts].index("latent")][4] = 0x7F  # sealed again: only the scale is wrong
        return streamformat.assemble(fmt, payloads)

    def bad_write(self, kv, spec, slots, stream=None, **kw):  # type: ignore[no-untyped-def]
        n = write(self, kv, spec, slots, stream, **kw)
        s = slots[-1]
        _nan_latent_scale(s.segment.data[s.offset : s.offset + s.nbytes].numpy().data, spec, BLOCK_TOKENS)
        return n

    async with EngramClient(srv.address, namespace="p", zero_copy=False) as remote, \
            EngramClient(srv.address, namespace="q", in_place_min_bytes=0) as local:
        fp = await remote.register_model(spec)
        await local.register_model(spec)
        monkeypatch.setattr(stored, "encode_streams", bad_encode)
        with pytest.raises(errors.InvalidArgument, match="stream latent: the nvfp4 payload would not decode"):
            await remote.put(fp, toks, data, encode=True)
        monkeypatch.setattr(stored, "encode_streams", encode)
        assert (await remote.lookup(fp, toks)).matched_tokens == 0
        monkeypatch.setattr(PutWriter, "write", bad_write)
        with pytest.raises(errors.InvalidArgument, match="stream latent: the nvfp4 payload would not decode"):
            await local.put(fp, toks, data)
        monkeypatch.setattr(PutWriter, "write", write)
        assert (await local.lookup(fp, toks)).matched_tokens == 0
        # controls: the same puts, written right
        assert (await remote.put(fp, toks, data, encode=True)).stored == 2
        put = await local.put(fp, toks, data)
        assert put.stored == 2 and put.reserve_ms > 0  # in place
        for c in (remote, local):
            n, got = await c.get_prefix(fp, toks)
            assert n == len(toks)
            check_close(got, data, spec)


async def test_stream_blocks_survive_a_restart_on_nvme(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = mla_spec("nvfp4")
    nvme = str(tmp_path / "nvme")
    toks = tokens(3 * BLOCK_TOKENS)
    data = streams_for(spec, len(toks))
    srv = await server_factory(**{"tiers.nvme.path": nvme, "tiers.write_policy": "write-through"})
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        put = await c.put(fp, toks, data)
        before = cat(await c.get(fp, list(put.keys)))
    await srv.stop(0)
    srv2 = await server_factory(**{"tiers.nvme.path": nvme})
    async with EngramClient(srv2.address, namespace="t") as c:
        assert await c.register_model(spec) == fp
        n, after = await c.get_prefix(fp, toks)
        assert n == len(toks) and all(torch.equal(after[k], before[k]) for k in before)


async def test_a_stream_destination_made_for_other_streams_is_refused_before_the_request(server_factory) -> None:  # type: ignore[no-untyped-def]
    """StreamsKV and PagedStreamsKV check their tensors against the streams they are given, not the model's: a
    latent of float32 took the model's bfloat16 cast without a word, and on a miss nothing at all was said. Both
    are checked against the model's layout before the request; the model's own streams miss quietly."""
    srv = await server_factory()
    spec = mla_spec()
    lay = spec.layout
    wide = tuple(dataclasses.replace(s, dtype=DType.FP32) if s.name == "latent" else s for s in lay.stream_specs)
    toks = tokens(2 * BLOCK_TOKENS)
    async with EngramClient(srv.address, namespace="a") as c:
        fp = await c.register_model(spec)
        for put in (False, True):  # a miss, then a hit
            if put:
                await c.put(fp, toks, streams_for(spec, len(toks)))
            dense = {s.name: torch.zeros(lay.stream_shape(s, len(toks)), dtype=s.dtype.torch_dtype) for s in wide}
            with pytest.raises(errors.InvalidArgument, match=r"stream latent.*torch\.bfloat16"):
                await c.load_prefix_into(fp, toks, StreamsKV(wide, dense))
            paged = {s.name: [torch.zeros(8, 4, *s.shape, dtype=s.dtype.torch_dtype) for _ in range(3)] for s in
                     lay.stream_specs}
            with pytest.raises(errors.InvalidArgument, match="stores 2 layers"):
                await c.load_prefix_into(fp, toks, PagedStreamsKV(lay.stream_specs, paged, range(8)))
        fresh = tokens(2 * BLOCK_TOKENS, seed=5)
        dest = {s.name: torch.zeros(lay.stream_shape(s, len(fresh)), dtype=s.dtype.torch_dtype) for s in lay.stream_specs}
        assert (await c.load_prefix_into(fp, fresh, StreamsKV(lay.stream_specs, dest))).loaded_tokens == 0


def test_streams_destination_write_refuses_data_of_another_dtype_or_shape() -> None:
    """StreamsKV.write, the loader's own path (a PrefixLoader used without the client's check_fits first), cast
    a bfloat16 latent into a float32 destination built for other streams without a word; it now refuses it, as
    the other destinations' writes do, and data of another entry shape or layer count too."""
    spec = mla_spec()
    lay = spec.layout
    wide = tuple(dataclasses.replace(s, dtype=DType.FP32) if s.name == "latent" else s for s in lay.stream_specs)
    dest = {s.name: torch.zeros(lay.stream_shape(s, 2 * BLOCK_TOKENS), dtype=s.dtype.torch_dtype) for s in wide}
    i = [s.name for s in wide].index("latent")
    st = lay.stream_specs[i]
    layers = int(dest["latent"].shape[0])
    data = torch.ones(2, layers, BLOCK_TOKENS, *st.shape, dtype=st.dtype.torch_dtype)  # (blocks, L, bt, *shape)
    with pytest.raises(errors.InvalidArgument, match=r"the model's KV is torch\.bfloat16; the destination is "
                                                      r"torch\.float32"):
        StreamsKV(wide, dest).write(i, data, 0, 2 * BLOCK_TOKENS)
    assert not dest["latent"].any()
    good = StreamsKV(lay.stream_specs, {s.name: torch.zeros_like(dest[s.name], dtype=s.dtype.torch_dtype)
                                        for s in lay.stream_specs})
    with pytest.raises(errors.InvalidArgument, match="stream latent"):
        good.write(i, data[..., :1], 0, 2 * BLOCK_TOKENS)  # an entry of another width would broadcast
    with pytest.raises(errors.InvalidArgument, match="stream latent"):
        good.write(i, data[:, :1], 0, 2 * BLOCK_TOKENS)
    good.write(i, data, 0, 2 * BLOCK_TOKENS - 3)
    assert good.tensors[i][:, :2 * BLOCK_TOKENS - 3].eq(1).all() and not good.tensors[i][:, 2 * BLOCK_TOKENS - 3:].any()


def test_streams_destination_checks_its_tensors() -> None:
    spec = csa_spec()
    streams = spec.layout.stream_specs
    good = {s.name: torch.zeros(spec.layout.stream_shape(s, 20), dtype=s.dtype.torch_dtype) for s in streams}
    assert StreamsKV(streams, good).capacity_tokens == 20
    latent_only = (streams[0],)
    assert StreamsKV(latent_only, {"latent": good["latent"]}).capacity_tokens == 23  # 5 entries cover tokens < 24
    with pytest.raises(errors.InvalidArgument, match="one tensor per stream"):
        StreamsKV(streams, {"latent": good["latent"]})
    with pytest.raises(errors.InvalidArgument, match="stream exact"):
        StreamsKV(streams, {**good, "exact": good["exact"].bfloat16()})
