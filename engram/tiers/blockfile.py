"""The on-disk form of one block in the NVMe tier: a self-describing file, so the tier's index can be
rebuilt from the files alone after a crash.

    offset  size  field
    0       8     magic b"ENGRMBLK"
    8       2     format version (1), little-endian
    10      2     flags: bit 0 = payload is lz4-compressed
    12      4     meta_len: bytes of the meta section
    16      8     stored_len: payload bytes as stored (compressed or not)
    24      8     raw_len: payload bytes once decompressed
    32      8     payload checksum: xxh3_64 of the raw payload (the block's checksum everywhere)
    40      8     meta checksum: xxh3_64 of bytes 0..40 and the meta section
    48      ...   meta: key[16] parent[16] fingerprint[16] ns_len u16, namespace utf-8, dtype u8, full u8,
                  ndim u8, shape u32 x ndim, n_tokens u32, tokens i32 x n_tokens
    48+meta ...   payload

A file is valid only if both checksums match and its size is exactly 48 + meta_len + stored_len: a torn
write (a crash between write and rename leaves only a temp file, but a truncated or bit-flipped file can
still appear through disk faults) is detected, never served. A file of a later format version is not damage
but a newer Engram's (NewerFormat): never served, never deleted.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import lz4.block
import xxhash

from engram.block import BlockRecord, Payload
from engram.errors import DataLoss, NewerFormat
from engram.layout import DType

MAGIC = b"ENGRMBLK"
VERSION = 1
FLAG_LZ4 = 1
_FIXED = struct.Struct("<8sHHIQQQQ")  # magic, version, flags, meta_len, stored_len, raw_len, checksum, meta_ck
FIXED_LEN = _FIXED.size  # 48
_CHECKED_PREFIX = 40  # bytes of the fixed header covered by the meta checksum (all but itself)
_U8X3, _U16, _U32 = struct.Struct("<BBB"), struct.Struct("<H"), struct.Struct("<I")
_DTYPES = {int(d): d for d in DType}


@dataclass(frozen=True)
class FileLayout:
    """Where the payload sits in a block file and how it is stored."""

    payload_offset: int
    stored_len: int
    compressed: bool

    @property
    def file_len(self) -> int:
        return self.payload_offset + self.stored_len


def max_file_len(rec: BlockRecord) -> int:
    """A block's file size when stored uncompressed: what to reserve before writing it."""
    return FIXED_LEN + len(_meta_bytes(rec)) + rec.nbytes


def _meta_bytes(rec: BlockRecord) -> bytes:
    ns = rec.namespace.encode()
    parts = [rec.key, rec.parent, rec.model_fingerprint, struct.pack("<H", len(ns)), ns,
             struct.pack("<BBB", int(rec.dtype), int(rec.full), len(rec.shape)),
             struct.pack(f"<{len(rec.shape)}I", *rec.shape), struct.pack("<I", rec.num_tokens), rec.tokens]
    return b"".join(parts)


def encode(rec: BlockRecord, payload: Payload, *, compress: bool) -> tuple[bytes, Payload]:
    """Header bytes and stored payload for a block. lz4 is kept only when it saves at least 10%: packed
    FP4 codes barely compress, and a wasted decompression on every read costs more than the bytes."""
    stored = payload
    if compress:
        packed = lz4.block.compress(payload, store_size=False)
        if len(packed) <= 0.9 * len(payload):
            stored = packed
    return header_bytes(rec, len(stored), compressed=stored is not payload), stored


def header_bytes(rec: BlockRecord, stored_len: int, *, compressed: bool) -> bytes:
    """The header (fixed part and meta) of a block file holding `rec` with `stored_len` payload bytes: what
    the file starts with, and what the index journal records for it (engram/tiers/journal.py)."""
    meta = _meta_bytes(rec)
    flags = FLAG_LZ4 if compressed else 0
    prefix = _FIXED.pack(MAGIC, VERSION, flags, len(meta), stored_len, rec.nbytes, rec.checksum, 0)
    meta_ck = xxhash.xxh3_64_intdigest(prefix[:_CHECKED_PREFIX] + meta)
    return prefix[:_CHECKED_PREFIX] + struct.pack("<Q", meta_ck) + meta


def header_len(fixed: bytes) -> int:
    """The whole header's length (48 + meta_len) from a file's first 48 bytes, before they are verified."""
    if len(fixed) < FIXED_LEN:
        return FIXED_LEN
    (meta_len,) = struct.unpack_from("<I", fixed, 12)
    return FIXED_LEN + meta_len


FIRST_READ = 64 * 1024  # one read covers the header of any block up to ~16K tokens; larger ones take two


def read_header(pread: Callable[[int, int], bytes], size: int, where: str) -> tuple[BlockRecord, FileLayout]:
    """Read and verify the header of a block file of `size` bytes through `pread(length, offset)`: one read
    for usual headers, a second when the meta is longer (a block of 16K tokens or more: its tokens alone
    are 64 KiB)."""
    head = pread(min(size, FIRST_READ), 0)
    need = header_len(head)
    if need > len(head) and need <= size:
        head = pread(need, 0)
    return decode_header(head, where)


def decode_header(head: bytes, where: str, *, verify: bool = True) -> tuple[BlockRecord, FileLayout]:
    """Parse and verify a file's header; returns the record and the payload's offset. `verify=False` skips
    the meta checksum, for headers whose bytes another checksum covers already (journal entries)."""
    if len(head) < FIXED_LEN:
        raise DataLoss(f"{where}: {len(head)} bytes, shorter than a block file header")
    magic, version, flags, meta_len, stored_len, raw_len, checksum, meta_ck = _FIXED.unpack_from(head)
    if magic != MAGIC:
        raise DataLoss(f"{where}: bad magic {magic!r}, not an Engram block file")
    if version > VERSION:  # a newer Engram's: never taken for damage (docs/FORMAT.md, "Version skew")
        raise NewerFormat(where, "block file", version, VERSION)
    if version != VERSION:
        raise DataLoss(f"{where}: block file version {version}, this daemon reads version {VERSION}")
    if len(head) < FIXED_LEN + meta_len:
        raise DataLoss(f"{where}: header truncated ({len(head)} of {FIXED_LEN + meta_len} bytes)")
    if verify and xxhash.xxh3_64_intdigest(head[:_CHECKED_PREFIX] + head[FIXED_LEN : FIXED_LEN + meta_len]) != meta_ck:
        raise DataLoss(f"{where}: header checksum mismatch")
    try:
        # Fields are read from `head` in place (no copy of the meta; recovery parses 100k of these).
        m = FIXED_LEN
        (ns_len,) = _U16.unpack_from(head, m + 48)
        off = m + 50
        namespace = head[off : off + ns_len].decode()
        off += ns_len
        dtype, full, ndim = _U8X3.unpack_from(head, off)
        off += 3
        shape = struct.unpack_from(f"<{ndim}I", head, off)
        off += 4 * ndim
        (n_tokens,) = _U32.unpack_from(head, off)
        off += 4
        end = off + 4 * n_tokens
        if end != m + meta_len or end > len(head):
            raise ValueError("meta length does not match its fields")
        rec = BlockRecord(head[m : m + 16], head[m + 16 : m + 32], head[m + 32 : m + 48], namespace, _DTYPES[dtype],
                          bool(full), shape, head[off:end], raw_len, checksum)
    except (struct.error, ValueError, KeyError, UnicodeDecodeError) as exc:
        raise DataLoss(f"{where}: malformed header: {exc}") from None
    return rec, FileLayout(FIXED_LEN + meta_len, stored_len, bool(flags & FLAG_LZ4))


def decode_payload(rec: BlockRecord, layout: FileLayout, stored: bytes, where: str) -> bytes:
    if len(stored) != layout.stored_len:
        raise DataLoss(f"{where}: payload truncated ({len(stored)} of {layout.stored_len} bytes)")
    if layout.compressed:
        try:
            payload = lz4.block.decompress(stored, uncompressed_size=rec.nbytes)
        except lz4.block.LZ4BlockError as exc:
            raise DataLoss(f"{where}: lz4 payload does not decompress: {exc}") from None
    else:
        payload = stored
    if len(payload) != rec.nbytes or xxhash.xxh3_64_intdigest(payload) != rec.checksum:
        raise DataLoss(f"{where}: payload checksum mismatch")
    return payload
