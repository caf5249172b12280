"""docs/FORMAT.md is enough to read an NVMe tier directory: a minimal reader written from that page alone
(struct, xxhash, lz4; nothing from engram) parses the block files and the index journal a real store wrote,
and gets back exactly the tokens and bytes that were put; extended by the "Block format v2" section alone, it
parses a stream layout's blocks too. Blocks of any header size recover after a
restart (a 16K-token block's tokens alone are 64 KiB, which recovery used to cut off and delete)."""

from __future__ import annotations

import asyncio
import shutil
import struct
from pathlib import Path

import lz4.block
import numpy as np
import pytest
import torch
import xxhash

from engram.block import BlockHeader, checksum
from engram.codec.fp4_reference import CODECS
from engram.codec.stored import RAW, encode, encode_streams
from engram.codec.streamformat import raw_streams
from engram.config import load_config
from engram.keys import root_key
from engram.layout import Axis, DType, KVLayout, LayerKind, LayerSpec, ModelSpec, StreamSpec
from engram.server.app import build_store
from engram.store import BlockStore
from engram.store.pins import PinShare

from helpers import random_kv, tokens

NS = "reader"

# ---- the independent reader (docs/FORMAT.md, "NVMe tier directory") ---------------------------------


def read_block_file(path: Path) -> dict[str, object]:
    data = path.read_bytes()
    magic, version, flags, meta_len, stored_len, raw_len, payload_ck, meta_ck = struct.unpack_from(
        "<8sHHIQQQQ", data, 0)
    assert magic == b"ENGRMBLK" and version == 1 and flags & ~1 == 0
    meta = data[48 : 48 + meta_len]
    assert xxhash.xxh3_64_intdigest(data[:40] + meta) == meta_ck, "meta checksum"
    key, parent, fingerprint = meta[0:16], meta[16:32], meta[32:48]
    (ns_len,) = struct.unpack_from("<H", meta, 48)
    off = 50
    namespace = meta[off : off + ns_len].decode("utf-8")
    off += ns_len
    dtype, full, ndim = meta[off], meta[off + 1], meta[off + 2]
    off += 3
    shape = struct.unpack_from(f"<{ndim}I", meta, off)
    off += 4 * ndim
    (n_tokens,) = struct.unpack_from("<I", meta, off)
    off += 4
    toks = struct.unpack_from(f"<{n_tokens}i", meta, off)
    off += 4 * n_tokens
    assert off == meta_len, "meta_len is exactly its fields"
    assert key.hex() == path.name.removesuffix(".blk") and path.parent.name == key.hex()[:2]
    assert len(data) == 48 + meta_len + stored_len, "file size"
    stored = data[48 + meta_len :]
    payload = lz4.block.decompress(stored, uncompressed_size=raw_len) if flags & 1 else stored
    assert len(payload) == raw_len and xxhash.xxh3_64_intdigest(payload) == payload_ck, "payload checksum"
    return {"key": key, "parent": parent, "fingerprint": fingerprint, "namespace": namespace, "dtype": dtype,
            "full": bool(full), "shape": shape, "tokens": list(toks), "payload": payload, "compressed": bool(flags & 1),
            "header": data[: 48 + meta_len]}


# docs/FORMAT.md, "Block format v2": a stream layout's block, the payload of a block file whose shape has ndim 3.
CODEC_NAMES = {0: "raw", 1: "fp8_e4m3", 2: "nvfp4", 3: "mxfp4"}
ITEMSIZE = {1: 2, 2: 2, 3: 4}


def _pad(n: int, g: int) -> int:
    return -(-n // g) * g


def read_v2_block(blob: bytes) -> dict[str, dict[str, object]]:
    """Each stream's record fields and payload bytes, with every size and checksum checked."""
    magic, version, count, reserved, tokens, reserved2, body_len, body_ck = struct.unpack_from("<4sBBHIIQQ", blob, 0)
    assert magic == b"EGKV" and version == 2 and 1 <= count <= 16 and reserved == reserved2 == 0
    head_end = 32 + 32 * count
    (head_ck,) = struct.unpack_from("<Q", blob, head_end)
    assert xxhash.xxh3_64_intdigest(blob[:head_end]) == head_ck, "header checksum"
    body_at = _pad(head_end + 8, 16)
    assert blob[head_end + 8 : body_at] == bytes(body_at - head_end - 8), "zero padding before the body"
    assert len(blob) == body_at + body_len and xxhash.xxh3_64_intdigest(blob[body_at:]) == body_ck, "body"
    out, at = {}, body_at
    for i in range(count):
        name, codec_id, axis, dtype, ndim, layers, entries, *dims = struct.unpack_from("<8sBBBBII3I", blob, 32 + 32 * i)
        assert 1 <= ndim <= 3 and all(dims[:ndim]) and not any(dims[ndim:])
        shape = tuple(dims[:ndim])
        width = 1
        for d in shape:
            width *= d
        codec = CODEC_NAMES[codec_id]
        if axis == 0:  # channel: the tensor transposed to (layers, width, entries)
            rows, cols = layers * width, entries
        else:  # token: as it lies
            rows, cols = layers * entries * width // shape[-1], shape[-1]
        if rows * cols == 0:
            nbytes = 0
        elif codec == "raw":
            nbytes = layers * entries * width * ITEMSIZE[dtype]
        elif codec == "fp8_e4m3":
            nbytes = 4 + rows * cols
        elif codec == "nvfp4":
            nbytes = 4 + rows * (_pad(cols, 16) // 16 + _pad(cols, 16) // 2)
        else:
            nbytes = rows * (_pad(cols, 32) // 32 + _pad(cols, 32) // 2)
        at = _pad(at, 16)
        out[name.rstrip(b"\0").decode("ascii")] = {"codec": codec, "axis": axis, "dtype": dtype, "layers": layers,
                                                   "entries": entries, "shape": shape, "matrix": (rows, cols),
                                                   "payload": blob[at : at + nbytes], "tokens": tokens}
        at += nbytes
    assert at == len(blob), "the last stream ends the block"
    return out


def read_journal_file(path: Path, magic: bytes) -> tuple[int, list[tuple[int, bytes]]]:
    data = path.read_bytes()
    got, version, flags, reserved, generation = struct.unpack_from("<8sHHIQ", data, 0)
    assert got == magic and version in (1, 2) and flags == 0 and reserved == 0
    if version == 2:  # the head's own checksum follows it
        assert struct.unpack_from("<Q", data, 24)[0] == xxhash.xxh3_64_intdigest(data[:24])
    entries, off = [], 24 if version == 1 else 32
    while off + 5 <= len(data):
        body_len, kind = struct.unpack_from("<IB", data, off)
        end = off + 5 + body_len + 8
        meta_len = struct.unpack_from("<I", data, off + 17)[0] if off + 21 <= len(data) else None
        owners = struct.unpack_from("<H", data, off + 29)[0] if off + 31 <= len(data) else 1
        if not ((kind == 2 and body_len == 16) or (kind == 3 and body_len == 24)
                or (kind == 4 and body_len >= 26 + 7 * max(1, owners))
                or (kind == 1 and body_len >= 64 and meta_len in (None, body_len - 48))):
            assert not any(data[off:]), "damage: an impossible entry with bytes after it"
            break  # zeros: a file grown at a crash
        if end > len(data):
            break  # a torn append
        body = data[off + 5 : off + 5 + body_len]
        (ck,) = struct.unpack_from("<Q", data, end - 8)
        if xxhash.xxh3_64_intdigest(bytes([kind]) + body) != ck:
            assert not any(data[end:]), "damage: an entry that fails its checksum with bytes after it"
            break  # a torn append
        entries.append((kind, body))
        off = end
    return generation, entries


Pins = tuple[int, int, dict[str, int]]  # tenant pins, operator pins, each owner's tenant pins


def owned_pins(body: bytes) -> tuple[bytes, Pins]:
    """An owned pins entry (kind 4): a pins entry's 24 bytes, then its owners."""
    key, tenant, operator, count = struct.unpack_from("<16sIIH", body)
    owners, at = {}, 26
    for _ in range(count):
        (name_len,) = struct.unpack_from("<H", body, at)
        name = body[at + 2 : at + 2 + name_len].decode()
        (owners[name],) = struct.unpack_from("<I", body, at + 2 + name_len)
        at += 2 + name_len + 4
    assert at == len(body) and 0 < sum(owners.values()) <= tenant and all(owners.values())
    return key, (tenant, operator, owners)


def journaled(root: Path) -> tuple[dict[bytes, bytes], dict[bytes, Pins]]:
    """The blocks (key -> file header) and their pins (key -> tenant pins, operator pins, owners) the journal
    records."""
    gen, entries = read_journal_file(root / "index" / "snapshot", b"ENGRMSNP")
    blocks: dict[bytes, bytes] = {}
    pins: dict[bytes, Pins] = {}
    journals = sorted((int(p.name.split(".")[1]), p) for p in (root / "index").glob("journal.*"))
    for kind, body in entries + [e for jgen, path in journals if jgen >= gen
                                 for e in read_journal_file(path, b"ENGRMJNL")[1]]:
        if kind == 1:
            blocks[body[48:64]] = body
        elif kind == 2:
            blocks.pop(body, None)
        elif kind == 3:
            key, tenant, operator = struct.unpack("<16sII", body)
            pins[key] = (tenant, operator, {})
        else:
            key, pins[key] = owned_pins(body)
    return blocks, {k: p for k, p in pins.items() if p[:2] != (0, 0) and k in blocks}


# ---- the store that writes them ---------------------------------------------------------------------------


def tensor_bytes(kv: torch.Tensor) -> bytes:
    return encode(kv, RAW)


def model(block_tokens: int) -> ModelSpec:
    layout = KVLayout(layers=(LayerSpec(LayerKind.SLIDING, 8), LayerSpec(LayerKind.GLOBAL)), num_kv_heads=1,
                      head_dim=8, dtype=DType.BF16, block_tokens=block_tokens)
    return ModelSpec(name=f"reader-{block_tokens}", weights_id="w", layout=layout, codec="raw")


async def open_store(root: Path, **extra: object) -> BlockStore:
    store = await build_store(load_config(env={}, overrides={
        "tiers.nvme.path": str(root), "tiers.dram.capacity": "8MiB", "tiers.dram.pool": "private",
        "tiers.write_policy": "write-through", **extra}))
    return store


async def put_chain(store: BlockStore, spec: ModelSpec, toks: np.ndarray, kv: torch.Tensor) -> list[bytes]:
    bt = spec.layout.block_tokens
    parent = root_key(NS, spec.fingerprint)
    keys = []
    for i, start in enumerate(range(0, len(toks), bt)):
        block = kv[:, :, start : start + bt]
        payload = tensor_bytes(block)
        header = BlockHeader(toks[start : start + bt], DType.BF16, tuple(block.shape), len(payload), checksum(payload))
        parent = (await store.put(NS, spec.fingerprint, parent, header, payload, index=i)).key
        keys.append(parent)
    return keys


async def test_a_reader_written_from_format_md_reads_what_the_store_wrote(tmp_path: Path) -> None:
    store = await open_store(tmp_path, **{"tiers.nvme.compression": True})
    small, large = model(16), model(16384)
    for spec in (small, large):
        store.registry.register(spec)
    t_small = tokens(16 * 3 + 5, seed=1)  # three full blocks and a partial tail
    kv_small = random_kv(small, len(t_small), seed=1)
    kv_small[:, :, 16:32] = 0  # one block of zeros: stored lz4-compressed
    t_large = tokens(16384, seed=2)
    kv_large = random_kv(large, len(t_large), seed=2)
    keys = await put_chain(store, small, t_small, kv_small) + await put_chain(store, large, t_large, kv_large)
    store.pin(NS, small.fingerprint, keys[1:2])
    store.pin(NS, small.fingerprint, keys[1:3])
    store.pin(NS, small.fingerprint, keys[2:3], unpin=True)
    alice, bob = (PinShare.of((NS,), 0.5, store.tiers, name) for name in ("alice", "bøb"))  # tenants' pins
    store.pin(NS, small.fingerprint, keys[3:4] * 2, share=alice)
    store.pin(NS, small.fingerprint, keys[3:4], share=bob)
    await store.close()

    files = sorted((tmp_path / "blocks").rglob("*.blk"))
    read = {r["key"]: r for r in map(read_block_file, files)}
    assert sorted(read) == sorted(keys)
    assert any(r["compressed"] for r in read.values()) and not all(r["compressed"] for r in read.values())
    for spec, toks, kv, chain in ((small, t_small, kv_small, keys[:4]), (large, t_large, kv_large, keys[4:])):
        bt = spec.layout.block_tokens
        parent = root_key(NS, spec.fingerprint)
        for i, key in enumerate(chain):
            r = read[key]
            assert r["parent"] == parent and r["fingerprint"] == spec.fingerprint and r["namespace"] == NS
            assert r["tokens"] == toks[i * bt : (i + 1) * bt].tolist() and r["dtype"] == 1
            assert r["full"] == (len(r["tokens"]) == bt)  # type: ignore[arg-type]
            assert r["payload"] == tensor_bytes(kv[:, :, i * bt : (i + 1) * bt])
            parent = key
    assert len(read[keys[4]]["header"]) > 64 * 1024  # type: ignore[arg-type]  # the 16K-token block's header

    # The journal (its snapshot, written at close) records exactly these blocks, with their files' headers, and
    # their pins: the operator's (a caller of no share), and the tenants' with their owners.
    headers, pins = journaled(tmp_path)
    assert headers == {k: r["header"] for k, r in read.items()}
    assert pins == {keys[1]: (0, 2, {}), keys[3]: (3, 0, {"alice": 2, "bøb": 1})}


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "full-scan"])
async def test_blocks_with_headers_over_64_kib_survive_a_restart(tmp_path: Path, journal: bool) -> None:
    spec = model(16384)
    store = await open_store(tmp_path)
    store.registry.register(spec)
    toks = tokens(2 * 16384 + 100, seed=3)
    kv = random_kv(spec, len(toks), seed=3)
    keys = await put_chain(store, spec, toks, kv)
    await store.close()
    if not journal:
        shutil.rmtree(tmp_path / "index")  # recovery reads every header, as it did before the journal
    store = await open_store(tmp_path)
    try:
        await asyncio.gather(*store.background)  # the background check of trusted headers found nothing
        match = store.lookup(NS, spec.fingerprint, toks)
        assert [m.key for m in match.blocks] == keys and match.matched_tokens == len(toks)
        for i, meta in enumerate(match.blocks):
            with store.reading([meta]):
                payload = await store.read(meta)
            assert payload == tensor_bytes(kv[:, :, i * 16384 : (i + 1) * 16384])
        report = await store.check(fix=False)
        assert report.ok and report.valid == 6, report.findings  # 3 files, and the 3 copies the reads promoted
    finally:
        await store.close()


def stream_model() -> ModelSpec:
    """Every form a v2 block's streams take: a token-axis nvfp4 latent, channel-axis mxfp4 K of (2, 16), an fp8
    indexer key compressed 4:1, an exact fp32 stream; two persisted layers of three (one SHARED)."""
    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL), LayerSpec(LayerKind.SHARED), LayerSpec(LayerKind.GLOBAL)),
                      block_tokens=16, streams=(
                          StreamSpec("latent", (40,), DType.BF16, "nvfp4"),
                          StreamSpec("k", (2, 16), DType.BF16, "mxfp4", Axis.CHANNEL),
                          StreamSpec("index_k", (24,), DType.BF16, "fp8_e4m3", Axis.TOKEN, compress=4),
                          StreamSpec("exact", (3,), DType.FP32, "raw")))
    return ModelSpec(name="reader-streams", weights_id="w", layout=layout, codec="nvfp4")


async def test_a_reader_written_from_format_md_reads_v2_blocks(tmp_path: Path) -> None:
    """The same reader, extended by FORMAT.md's v2 section alone, parses a stream layout's blocks from the block
    files (ndim 3, a v2 payload): record fields, payload places and sizes from the formulas, both checksums;
    a raw stream's bytes are what was put, and a quantized stream's are the codec's payload of the matrix the
    page describes for its axis (channel: transposed)."""
    store = await open_store(tmp_path)
    spec = stream_model()
    store.registry.register(spec)
    lay = spec.layout
    toks = tokens(2 * 16 + 3, seed=4)  # two full blocks and a 3-token tail: the 4:1 stream has no entry there
    gen = torch.Generator().manual_seed(4)
    data = {s.name: torch.randn(lay.stream_shape(s, len(toks)), generator=gen).to(s.dtype.torch_dtype)
            for s in lay.stream_specs}
    parent = root_key(NS, spec.fingerprint)
    keys = []
    for i, start in enumerate(range(0, len(toks), 16)):
        t = toks[start : start + 16]
        block = {s.name: data[s.name][:, start // s.compress : (start + len(t)) // s.compress] for s in spec.streams}
        payload = encode_streams(block, raw_streams(spec.streams), len(t))  # raw: the daemon encodes each stream
        header = BlockHeader(t, DType.BF16, lay.block_shape(len(t)), len(payload), checksum(payload), codec="streams")
        parent = (await store.put(NS, spec.fingerprint, parent, header, payload, index=i)).key
        keys.append(parent)
    await store.close()

    read = {r["key"]: r for r in map(read_block_file, sorted((tmp_path / "blocks").rglob("*.blk")))}
    assert sorted(read) == sorted(keys)
    quantize = {name: CODECS[name][0] for name in ("nvfp4", "mxfp4", "fp8_e4m3")}
    for i, key in enumerate(keys):
        r = read[key]
        n = len(r["tokens"])  # type: ignore[arg-type]
        assert r["shape"] == (2, 4, n) and r["payload"][:5] == b"EGKV\x02"  # type: ignore[index]
        streams = read_v2_block(r["payload"])  # type: ignore[arg-type]
        assert list(streams) == ["latent", "k", "index_k", "exact"]
        for s in spec.streams:
            got = streams[s.name]
            start, entries = i * 16 // s.compress, n // s.compress
            x = data[s.name][:, start : start + entries]
            assert (got["codec"], got["layers"], got["entries"], got["shape"], got["tokens"]) == \
                (s.codec, 2, entries, s.shape, n)
            if s.codec == "raw":
                assert got["payload"] == x.contiguous().view(torch.uint8).numpy().tobytes()
                continue
            if not entries:
                assert got["payload"] == b""
                continue
            rows, cols = got["matrix"]  # type: ignore[misc]
            m = x.reshape(2, entries, -1).permute(0, 2, 1) if s.axis == Axis.CHANNEL else x
            assert got["payload"] == quantize[s.codec](m.reshape(rows, cols).contiguous(), name=s.name).to_bytes()
