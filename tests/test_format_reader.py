"""docs/FORMAT.md is enough to read an NVMe tier directory: a minimal reader written from that page alone
(struct, xxhash, lz4; nothing from engram) parses the block files and the index journal a real store wrote,
and gets back exactly the tokens and bytes that were put. Blocks of any header size recover after a
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
from engram.codec.stored import RAW, encode
from engram.config import load_config
from engram.keys import root_key
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.server.app import build_store
from engram.store import BlockStore

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


def read_journal_file(path: Path, magic: bytes) -> tuple[int, list[tuple[int, bytes]]]:
    data = path.read_bytes()
    got, version, flags, reserved, generation = struct.unpack_from("<8sHHIQ", data, 0)
    assert got == magic and version == 1 and flags == 0 and reserved == 0
    entries, off = [], 24
    while off + 5 <= len(data):
        body_len, kind = struct.unpack_from("<IB", data, off)
        end = off + 5 + body_len + 8
        if end > len(data):
            break  # a torn append
        body = data[off + 5 : off + 5 + body_len]
        (ck,) = struct.unpack_from("<Q", data, end - 8)
        if xxhash.xxh3_64_intdigest(bytes([kind]) + body) != ck:
            break
        entries.append((kind, body))
        off = end
    return generation, entries


def journaled_headers(root: Path) -> dict[bytes, bytes]:
    gen, entries = read_journal_file(root / "index" / "snapshot", b"ENGRMSNP")
    blocks = {body[48:64]: body for kind, body in entries if kind == 1}
    journals = sorted((int(p.name.split(".")[1]), p) for p in (root / "index").glob("journal.*"))
    for jgen, path in journals:
        if jgen < gen:
            continue
        for kind, body in read_journal_file(path, b"ENGRMJNL")[1]:
            if kind == 1:
                blocks[body[48:64]] = body
            else:
                blocks.pop(body, None)
    return blocks


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

    # The journal (its snapshot, written at close) records exactly these blocks, with their files' headers.
    journaled = journaled_headers(tmp_path)
    assert journaled == {k: r["header"] for k, r in read.items()}


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
