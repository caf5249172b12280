"""The NVMe tier's index journal: what lets a daemon with 100k blocks on disk restart in about a second
instead of opening and parsing every block file.

Why: recovery used to read the header of every block file (an open, a read and a parse each: 9-22 s for
10k blocks on the project machine under load). The journal keeps those headers in two files that are read
sequentially at start-up:

    ROOT/index/snapshot       every block on disk when it was written (a compaction of the journal)
    ROOT/index/journal.<gen>  changes since: a block added (its file's header) or removed (its key), a
                              block's pins (its key, pin counts, and each tenant pin's owner)

The block files stay the truth; the journal is a hint checked against them. At start-up the tier lists the
block directories (names only, no opens): a journaled block whose file is gone is dropped, a file the
journal does not know (written just before a crash, before its entry) is read and verified as before, and
each file's size and checksums are verified lazily, on its first read (never served if wrong). So the
journal may lag or lose its tail (entries are appended without fsync) without losing or inventing a block,
with one exception the tier closes itself: a key removed and written again with other bytes (a recompute
that is not bit-identical). Were the remove lost and the old add kept, recovery would trust the old header
for the new file, and its first read would drop an acknowledged block; so the tier syncs the journal
(`sync`) before it publishes a file under a key whose remove is not yet synced. A journaled block whose file
is gone at start-up (its remove lost, or an offline check removed it) gets its remove appended then, as a
delete does.

Ordering: an `add` is appended after the block file is durable and renamed into place; a `remove` after
the file is unlinked. A snapshot is written to a temp file, fsynced and renamed over the old one, and names
the first journal generation it does not cover; journals of older generations are deleted after the rename.
A snapshot that cannot be written (a directory at `snapshot` or `snapshot.tmp`) is tried again after a back-off
(the tier's, nvme.py) for the generation the failed try opened, while the journal is still in it: no journal
file is opened per try. That later snapshot holds the changes the journal recorded since it was opened;
replaying them over it changes nothing, as each entry sets or removes one key's header.

When the journal cannot be written (a full disk, an I/O error: creating a generation, an append, a sync),
the tier goes on without it: `drop` closes it and keeps the snapshot and the journals, the last record of the
blocks' pins (deleting the snapshot lost every pin at the next start, and then the blocks they had kept).
They stay true of the files but for what changed since, and a start is right about that too: no block file is
written while the journal is dropped (the tier opens a new generation before it writes one), so what changed
is files removed (a start finds them gone, as after a lost remove) and pins; the tier keeps those changes in
memory and appends them to the new generation it opens (at its next write, a change, or the stop), before
anything else, with every remove not yet synced. A snapshot taken before the loss is not published.

Format (docs/FORMAT.md, all integers little-endian): a 32-byte file header (magic `ENGRMSNP` or
`ENGRMJNL`, u16 version 2, u16 flags 0, u32 reserved 0, u64 generation, u64 xxh3_64 of the 24 bytes before
it), then entries `u32 body_len, u8 kind (1 add, 2 remove, 3 pins, 4 owned pins), body, u64 xxh3_64(kind byte +
body)`. Version 1 (earlier releases) is the same header without its checksum, 24 bytes; it is still read. An
add's body is the block file's header (its first 48 + meta_len bytes); a remove's body is the 16-byte key; a pins
entry's the key, then u32 tenant pins and u32 operator pins (both 0: unpinned); an owned pins entry's the same 24
bytes, then u16 owner count and per owner u16 name length, its UTF-8 name and u32 pins (names distinct, sorted;
their pins > 0 and together at most the tenant pins, the rest of no recorded owner).

Why pins are here (a block's pins change after its file is written, and the file is never rewritten): the
journal is the tier's record of its blocks, replayed in order, so a crash loses a suffix of the changes (a
SIGKILL none: appends are in the page cache; a power loss the unsynced tail) and a restart sees each block's
pins as they were at some moment, never a mix; an entry costs an append (no fsync, as an add), where a file of
pins rewritten at each change costs a write, a sync and a rename, and holding it back loses pins at a crash.
A pins entry is kept apart from the add and remove of the block's file: a file removed as damaged and written
again from memory keeps its block's pins; the store records (0, 0) when the block itself leaves. The pins of a
block held in memory alone are recorded too (its file comes with the write-back flush); at start-up only those
of blocks that come back apply, and the others are recorded cleared. A journal that is not trusted loses them:
the blocks come back unpinned (their files do not hold pins).

Why owners are here too (engram/store/pins.py): in a namespace tenants share, a tenant's pin is its own to lift
and counts in its share alone, so the record of a block's pins names whose they are, or a restart gives them
back to no one (any tenant of the namespace could lift them, and every one's share counted them). A block's
pins with no recorded owner (the operator's alone, tenancy off, or pins an earlier build restored) are written as
a pins entry (kind 3), as before owners; only those with an owner take an owned pins entry (kind 4), one entry
setting the block's whole record, so a crash still leaves each block's pins as they were at some moment. Kind 4
came without a version change, as kind 3 did (docs/FORMAT.md, "Version skew"): an earlier build reads it as
damage, so it reads every block file and its blocks come back unpinned, where a later head version would make it
refuse the whole directory. Journals of earlier builds hold no kind 4 and load as before: their tenant pins
come back of no recorded owner.

A crash loses a journal's tail and tears at most its last entry (one write each): fewer bytes left than an
entry head, an entry whose length runs past the end of the file, or (a file grown before its bytes were
written) one that fails its checksum or is impossible with nothing but zeros after it. Reading stops there;
the lost entries are recovered from the files. Anything else that fails, with other bytes after it, is
damage (bit rot, a bad sector), not a crash: an entry that is whole but fails its checksum, or whose head is
impossible (a kind other than add, remove, pins or owned pins, a remove not 16 bytes long, a pins entry not 24,
an owned pins entry shorter than its owner count needs, an add whose length is not its block header's 48 +
meta_len), or an owned pins entry whole but inconsistent (its names running past it or short of it, an empty,
repeated or unordered name, an owner of no pins, the owners' pins past the tenant pins). A build from before pins
were journaled reads a pins entry as such damage, and one from before owners an owned pins entry: it reads every
block file (its blocks come back, unpinned).

Damage: a snapshot that fails any check (its head: magic, version, checksum; an entry, torn or not: it is
renamed into place whole), or a journal it would be read with whose head is whole but fails its checks or
that has a damaged entry, is not trusted: a wrong generation would apply the wrong journals (a block's
remove skipped, and its old header trusted for a file written again), and the entries of a damaged journal
after its damage (a remove among them) are unknown. The start then reads every block file (what the files
prove), and says so in the log. A journal shorter than its head was torn while it was created (before any
entry): it is skipped. A snapshot is not trusted either when no journal file is named with its generation:
it is written after that journal is created (`rotate`, then `write_snapshot`, at once or at a retry), which
is deleted only after a newer snapshot replaced it, or after the snapshot itself (renumbering; `drop` deletes no journal).
So the journal is there whenever the snapshot is true, if only torn at its creation; without it, the
generation is damaged (a version 1 head has no checksum: a flipped generation would skip the journals since)
or the journal's entries are lost. A flip that names another journal present (a few numbers at most) is not
caught.

Generations count up from 1 and never come near the u64 limit by themselves; a stray journal file numbered
in the upper half of the range (2^63 and up) would leave no room after it, so opening a journal then
renumbers: the snapshot is removed (the next start reads every file until a new one is written), then every
journal, and numbering starts again from the tier's own count.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import xxhash

from engram.errors import NewerFormat
from engram.private import FILE_MODE, private_dir
from engram.tiers.groupcommit import sync_directory

SNAPSHOT_MAGIC = b"ENGRMSNP"
JOURNAL_MAGIC = b"ENGRMJNL"
VERSION = 2  # written; version 1 (no head checksum, earlier releases) is still read
_HEAD_V1 = struct.Struct("<8sHHIQ")  # magic, version, flags, reserved, generation
_FILE_HEAD = struct.Struct("<8sHHIQQ")  # the same, then xxh3_64 of the 24 bytes before it
FILE_HEAD_LEN = _FILE_HEAD.size  # 32
_ENTRY_HEAD = struct.Struct("<IB")  # body_len, kind
ADD, REMOVE, PINS, OWNED_PINS = 1, 2, 3, 4
KEY_LEN = 16  # a remove's body
_PINS = struct.Struct("<16sII")  # a pins entry's body: key, tenant pins, operator pins
_OWNER_COUNT = struct.Struct("<H")  # an owned pins entry's, after those 24 bytes; then each owner:
_NAME_LEN = struct.Struct("<H")  # its name's length, the name (UTF-8), then
_OWNER_PINS = struct.Struct("<I")  # its pins
_OWNER_MIN = _NAME_LEN.size + 1 + _OWNER_PINS.size  # an owner's bytes, at the least (a name of one byte)
NAME_LIMIT = 0xFFFF  # bytes of an owner's name the u16 length holds (a longer one is recorded as no owner)
BLOCK_HEAD_LEN = 48  # the fixed part of a block file's header (an add's body; then its meta, key first)
GENERATION_LIMIT = 2**64 - 1  # a journal's generation is below it, so the next one still fits the u64 field
RENUMBER_AT = 2**63  # a generation no daemon reaches (one a nanosecond for 292 years): only after a stray file

log = logging.getLogger(__name__)

__all__ = ["ADD", "NO_PINS", "OWNED_PINS", "PINS", "REMOVE", "IndexJournal", "Loaded", "Pins", "decode_pins",
           "encode_entry", "encode_pins", "parse_entries"]


class Pins(NamedTuple):
    """A block's pins as the journal records them (engram/index.py BlockMeta): every tenant pin, the operator's,
    and of the tenant pins each recorded owner's, by name (sorted); the rest are of no recorded owner."""

    tenant: int
    operator: int
    owners: tuple[tuple[str, int], ...] = ()


NO_PINS = Pins(0, 0)  # unpinned


def encode_head(magic: bytes, generation: int) -> bytes:
    head = _HEAD_V1.pack(magic, VERSION, 0, 0, generation)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


class _Damaged(Exception):
    """A file's head, or an entry with bytes after it, is whole but wrong: what it says (its generation, its
    entries) cannot be trusted."""


class _Short(Exception):
    """A file shorter than its head: torn while it was created, before any entry was appended."""


def parse_head(data: bytes, magic: bytes, path: Path | None = None) -> tuple[int, int]:
    """(generation, head length) of a snapshot's or journal's head, version 1 or 2; raises _Short, _Damaged, and
    NewerFormat for a later version."""
    if len(data) < 10:
        raise _Short
    got, version = struct.unpack_from("<8sH", data)
    if got != magic:
        raise _Damaged(f"magic {got!r}, not {magic!r}")
    if version > VERSION:  # a newer Engram's (docs/FORMAT.md, "Version skew"): not damage, never replaced
        raise NewerFormat(str(path) if path else magic.decode(), "index file", version, VERSION)
    if version not in (1, VERSION):
        raise _Damaged(f"version {version}; this daemon reads versions 1 and {VERSION}")
    head_len = _HEAD_V1.size if version == 1 else FILE_HEAD_LEN
    if len(data) < head_len:
        raise _Short
    gen = _HEAD_V1.unpack_from(data)[4]
    if version > 1 and xxhash.xxh3_64_intdigest(data[: _HEAD_V1.size]) != struct.unpack_from("<Q", data, 24)[0]:
        raise _Damaged("its head fails its checksum")
    return gen, head_len


def encode_entry(kind: int, body: bytes) -> bytes:
    head = _ENTRY_HEAD.pack(len(body), kind)
    return head + body + struct.pack("<Q", xxhash.xxh3_64_intdigest(head[4:] + body))


def encode_pins(key: bytes, pins: Pins) -> bytes:
    """A pins entry (kind 3) when no owner is recorded, byte for byte what a build from before owners wrote; an
    owned pins entry (kind 4) otherwise. An owner whose name passes NAME_LIMIT bytes is recorded as none."""
    head = _PINS.pack(key, pins.tenant, pins.operator)
    named = [(name.encode(), n) for name, n in pins.owners]
    named = [(name, n) for name, n in named if len(name) <= NAME_LIMIT]
    if not named:
        return encode_entry(PINS, head)
    body = [head, _OWNER_COUNT.pack(len(named))]
    for name, n in named:
        body += [_NAME_LEN.pack(len(name)), name, _OWNER_PINS.pack(n)]
    return encode_entry(OWNED_PINS, b"".join(body))


def decode_pins(kind: int, body: bytes) -> tuple[bytes, Pins]:
    """A pins or owned pins entry's key and pins; raises _Damaged for an owned pins entry that is inconsistent
    (the module's doc)."""
    key, tenant, operator = _PINS.unpack_from(body)
    if kind == PINS:
        return key, Pins(tenant, operator)
    (count,) = _OWNER_COUNT.unpack_from(body, _PINS.size)
    at = _PINS.size + _OWNER_COUNT.size
    owners: list[tuple[str, int]] = []
    for _ in range(count):
        if at + _NAME_LEN.size > len(body):
            raise _Damaged("an owned pins entry's names run past it")
        (name_len,) = _NAME_LEN.unpack_from(body, at)
        at += _NAME_LEN.size
        if not name_len or at + name_len + _OWNER_PINS.size > len(body):
            raise _Damaged("an owned pins entry has an empty name, or its names run past it")
        try:
            name = body[at : at + name_len].decode()
        except UnicodeDecodeError:
            raise _Damaged("an owned pins entry's name is not UTF-8") from None
        (n,) = _OWNER_PINS.unpack_from(body, at + name_len)
        at += name_len + _OWNER_PINS.size
        if not n or (owners and owners[-1][0] >= name):
            raise _Damaged("an owned pins entry names an owner of no pins, or its names are repeated or unordered")
        owners.append((name, n))
    if at != len(body) or sum(n for _, n in owners) > tenant:
        raise _Damaged("an owned pins entry is longer than its owners, or their pins pass its tenant pins")
    return key, Pins(tenant, operator, tuple(owners))


def parse_entries(data: bytes | memoryview, offset: int = FILE_HEAD_LEN) -> tuple[list[tuple[int, bytes]], int]:
    """Entries from `offset` on, and the offset after the last valid one: a torn tail is left out. Raises
    _Damaged for an entry that is whole but fails its checksum, or whose head is impossible, with bytes after it
    (the module's doc): what follows it, a remove among them, is unknown."""
    out: list[tuple[int, bytes]] = []
    view = memoryview(data)
    end = len(view)
    while offset + _ENTRY_HEAD.size <= end:  # fewer bytes left than an entry head: a torn tail
        body_len, kind = _ENTRY_HEAD.unpack_from(view, offset)
        stop = offset + _ENTRY_HEAD.size + body_len + 8
        impossible = _impossible(view, offset, body_len, kind)
        if impossible is not None:
            if _zeros(view[offset:]):
                break  # the file grew at a crash, its bytes never written
            raise _Damaged(f"the entry at offset {offset} is impossible ({impossible}), {end - offset} bytes "
                           "from the end")
        if stop > end:
            break  # the last entry, short: its append was torn by a crash
        body = bytes(view[offset + 5 : offset + 5 + body_len])
        (ck,) = struct.unpack_from("<Q", view, stop - 8)
        if xxhash.xxh3_64_intdigest(bytes(view[offset + 4 : offset + 5]) + body) != ck:
            if _zeros(view[stop:]):
                break  # the last entry (zeros after it at most): torn by a crash
            raise _Damaged(f"the entry at offset {offset} fails its checksum, with {end - stop} bytes after it")
        if kind == OWNED_PINS:
            decode_pins(kind, body)  # whole (its checksum held) and inconsistent: damage, wherever it is
        out.append((kind, body))
        offset = stop
    return out, offset


def _impossible(view: memoryview, offset: int, body_len: int, kind: int) -> str | None:
    """What no entry we write has in its head (a torn append leaves a prefix of a true one): a remove's body is a
    key, an add's a block file's header, as long as its meta_len field (when it is there) says."""
    if kind == REMOVE:
        return None if body_len == KEY_LEN else f"a remove of {body_len} bytes, not {KEY_LEN}"
    if kind == PINS:
        return None if body_len == _PINS.size else f"a pins entry of {body_len} bytes, not {_PINS.size}"
    if kind == OWNED_PINS:
        need = _PINS.size + _OWNER_COUNT.size + _OWNER_MIN
        count_at = offset + _ENTRY_HEAD.size + _PINS.size
        if count_at + _OWNER_COUNT.size <= len(view):
            need = _PINS.size + _OWNER_COUNT.size + _OWNER_MIN * max(1, _OWNER_COUNT.unpack_from(view, count_at)[0])
        return None if body_len >= need else f"an owned pins entry of {body_len} bytes, below its owners' {need}"
    if kind != ADD:
        return f"kind {kind}"
    if body_len < BLOCK_HEAD_LEN + KEY_LEN:
        return f"an add of {body_len} bytes"
    meta_len_at = offset + _ENTRY_HEAD.size + 12
    if meta_len_at + 4 <= len(view):
        want = BLOCK_HEAD_LEN + struct.unpack_from("<I", view, meta_len_at)[0]
        if body_len != want:
            return f"an add of {body_len} bytes, its block header {want}"
    return None


def _zeros(view: memoryview) -> bool:
    return view.tobytes().count(0) == len(view)


@dataclass
class Loaded:
    """What the journal says is on disk: key -> the block file's header bytes; and key -> pins, in the order they
    were first recorded."""

    headers: dict[bytes, bytes]
    pins: dict[bytes, Pins]
    entries: int  # entries read (snapshot and journals): how far compaction is due
    torn_tail: bool  # a journal ended in a torn entry (a crash mid-append)


class IndexJournal:
    """Appends (from the event loop, or a thread: a lock orders them) and compaction of the journal."""

    def __init__(self, root: Path, *, fsync: bool = True, create: bool = True) -> None:
        """`create`: make index/ now (without it, a read-only check's: nothing is made)."""
        self.dir = root / "index"
        if create:
            with contextlib.suppress(OSError):  # a full disk: made by `open`, which fails (and is retried) meanwhile
                private_dir(self.dir)  # headers carry token ids: a tenant's data
        self.snapshot_path = self.dir / "snapshot"
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._fsync = fsync
        self.generation = 0
        self.lost_gen = 0  # the newest generation dropped (`drop`): a snapshot covering no later one is stale
        self.error: OSError | None = None  # why the journal was dropped, until it is opened again
        self._dir_synced = 0  # the generation whose journal file's own entry in the directory was synced
        self.appended = 0  # entries appended since the last snapshot
        # The I/O boundary, as the tier's (nvme.py FaultHook): fault(operation, path) may raise. Operations:
        # "journal" (creating a generation, an append, a sync), "snapshot" (writing one)
        self.fault: Callable[[str, Path], None] | None = None

    # ---- reading -------------------------------------------------------------------------------

    @staticmethod
    def _read(data: bytes, magic: bytes, path: Path) -> tuple[int, list[tuple[int, bytes]], bool]:
        """(generation, entries, whether a torn entry ended them); raises _Short, _Damaged, NewerFormat."""
        gen, head_len = parse_head(data, magic, path)
        entries, end = parse_entries(data, head_len)
        return gen, entries, end != len(data)

    def journals(self) -> list[tuple[int, Path]]:
        return sorted((gen, p) for gen, p in self._named_journals() if gen < GENERATION_LIMIT)

    def out_of_range(self) -> list[Path]:
        """Files named as journals whose generation no journal of ours can have (none could follow it): ignored."""
        return sorted(p for gen, p in self._named_journals() if gen >= GENERATION_LIMIT)

    def _named_journals(self) -> list[tuple[int, Path]]:
        out = []
        for p in self.dir.glob("journal.*"):
            suffix = p.name.removeprefix("journal.")
            if suffix.isdigit():
                out.append((int(suffix), p))
        return out

    def load(self) -> Loaded | None:
        """The headers the snapshot and journals record, or None when there is no usable snapshot (a
        directory from before the journal, one dropped) or it cannot be trusted (damage: logged): then the
        caller scans every file."""
        try:
            data = self.snapshot_path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._untrusted(self.snapshot_path, f"unreadable: {exc.strerror or exc}")
            return None
        try:
            gen, entries, torn = self._read(data, SNAPSHOT_MAGIC, self.snapshot_path)
        except (_Short, _Damaged) as exc:  # renamed into place whole: a short one is damage too
            self._untrusted(self.snapshot_path, str(exc) or "shorter than its head")
            return None
        if torn:
            self._untrusted(self.snapshot_path, "an entry is short or fails its checksum")
            return None
        journals = self.journals()
        if gen not in {g for g, _ in journals}:  # (the module's doc: what a snapshot's generation must name)
            self._untrusted(self.snapshot_path, f"its generation, {gen}, names no journal file: damaged (a version "
                            "1 head has no checksum) or its journal lost")
            return None
        headers: dict[bytes, bytes] = {}
        pins: dict[bytes, Pins] = {}
        count = 0
        for kind, body in entries:
            if kind == ADD:
                headers[body[48:64]] = body  # the key is the meta's first 16 bytes
            elif kind in (PINS, OWNED_PINS):
                _set_pins(pins, kind, body)
        count += len(entries)
        torn_tail = False
        for jgen, path in journals:
            if jgen < gen:
                continue
            try:
                _, jentries, torn = self._read(path.read_bytes(), JOURNAL_MAGIC, path)
            except (FileNotFoundError, _Short):  # gone, or torn at its creation: no entry in it
                torn_tail = True
                continue
            except (OSError, _Damaged) as exc:  # its removes unknown: an older header may be stale
                why = exc.strerror if isinstance(exc, OSError) else str(exc)
                self._untrusted(path, f"{why}; the snapshot is not used without it")
                return None
            torn_tail |= torn
            count += len(jentries)
            for kind, body in jentries:
                if kind == ADD:
                    headers[body[48:64]] = body
                elif kind == REMOVE:
                    headers.pop(body, None)  # not its pins: a file written again keeps its block's
                else:
                    _set_pins(pins, kind, body)
        return Loaded(headers, pins, count, torn_tail)

    def newer(self) -> list[NewerFormat]:
        """The snapshot and journals a newer Engram wrote (a later version in their head): a start refuses the
        directory rather than replace them (its snapshot would delete their journals), a check reports them.
        Reads each file's first 10 bytes."""
        found = []
        for path, magic in [(self.snapshot_path, SNAPSHOT_MAGIC), *((p, JOURNAL_MAGIC) for _, p in self.journals())]:
            try:
                with open(path, "rb") as fh:
                    head = fh.read(10)
            except OSError:
                continue  # absent, or unreadable: load() says so
            if len(head) == 10:
                got, version = struct.unpack_from("<8sH", head)
                if got == magic and version > VERSION:
                    found.append(NewerFormat(str(path), "index file", version, VERSION))
        return found

    def _fault(self, op: str, path: Path) -> None:
        if self.fault is not None:
            self.fault(op, path)

    def _untrusted(self, path: Path, why: str) -> None:
        log.warning("index journal: %s is not trusted (%s): this start reads every block file", path, why)

    def retire_version_1_snapshot(self) -> bool:
        """Remove a snapshot with an earlier release's head (version 1), once read, before this daemon appends to
        a version-2 journal: that release reads such a snapshot but skips the journals since as unreadable, so
        after a roll-back it would miss their removes and trust a block's old header for a file written again
        (the acknowledged block dropped at its first read). Without a snapshot it reads every block file. True
        when one was removed (a new snapshot is then due)."""
        try:
            with open(self.snapshot_path, "rb") as fh:
                head = fh.read(10)
        except OSError:
            return False
        if len(head) < 10 or struct.unpack_from("<8sH", head) != (SNAPSHOT_MAGIC, 1):
            return False
        try:
            self.snapshot_path.unlink()
            if self._fsync:
                sync_directory(self.dir)
        except OSError as exc:  # this daemon has read it already; only a roll-back is at risk
            log.error("could not remove the version-1 snapshot %s: %s (a roll-back to an earlier release would "
                      "trust it over the journals since)", self.snapshot_path, exc)
            return False
        log.info("index journal in %s: the version-1 snapshot of an earlier release was read and removed; a "
                 "version-2 one is written next", self.dir)
        return True

    # ---- writing -------------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def open(self) -> None:
        """Start appending to a journal newer than every existing one (a torn tail is never appended to),
        making the index directory first if needed. Raises OSError (nothing is left behind) when it cannot
        be created: a full disk, an I/O error."""
        with self._lock:
            if not self.dir.is_dir():  # a first start on a full disk could not make it
                private_dir(self.dir)
                if self._fsync:
                    sync_directory(self.dir.parent)
            gen = max([*(g for g, _ in self.journals()), self.generation, self.lost_gen]) + 1
            if gen >= RENUMBER_AT:
                self._renumber(gen)
                gen = max(self.generation, self.lost_gen) + 1
            self._switch(gen)
            self.error = None

    def _renumber(self, gen: int) -> None:
        """Make room after a stray journal numbered near the u64 limit (the module's doc): the snapshot goes
        first, so a crash part-way leaves no snapshot trusted over journals that are gone."""
        start = max(self.generation, self.lost_gen) + 1
        log.warning("index journal in %s: the next generation, %d, is past 2^63 (a stray journal file?): the "
                    "journals are renumbered from %d and removed with the snapshot (a start reads every block "
                    "file until a new snapshot is written)", self.dir, gen, start)
        self.snapshot_path.unlink(missing_ok=True)
        if self._fsync:
            sync_directory(self.dir)
        for _, path in self.journals():
            path.unlink(missing_ok=True)

    def _switch(self, gen: int) -> None:
        if gen >= GENERATION_LIMIT:  # never: `open` renumbers past 2^63, and no daemon rotates 2^63 times
            raise OSError(errno.EOVERFLOW, f"journal generation {gen} does not fit its u64 field; remove the stray "
                          f"journal files in {self.dir}")
        path = self.dir / f"journal.{gen}"
        self._fault("journal", path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
        try:
            if os.fstat(fd).st_size == 0:
                _write_all(fd, encode_head(JOURNAL_MAGIC, gen))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()  # a journal without its head would be read as damage at every start
            raise
        old, self._fd, self.generation = self._fd, fd, gen
        if old is not None:
            os.close(old)

    def drop(self, exc: OSError) -> None:
        """Stop journaling after `exc` (the journal could not be created or written): see the module's doc."""
        with self._lock:
            self._drop(exc)

    def _drop(self, exc: OSError) -> None:
        """Close the journal; the snapshot and journals stay (the module's doc: what keeps them true enough)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        self.error = exc
        self.lost_gen = max(self.lost_gen, self.generation)
        log.warning("index journal in %s: %s; the tier goes on without it until it can be opened again (its "
                    "changes meanwhile are held in memory and journaled then)", self.dir, exc.strerror or exc)

    def add(self, header: bytes) -> None:
        self._append(encode_entry(ADD, header))

    def remove(self, key: bytes) -> None:
        self._append(encode_entry(REMOVE, key))

    def pins(self, key: bytes, pins: Pins) -> None:
        self._append(encode_pins(key, pins))

    def _append(self, entry: bytes) -> None:
        with self._lock:
            if self._fd is None:
                return
            try:
                self._fault("journal", self.dir / f"journal.{self.generation}")
                _write_all(self._fd, entry)  # a crash leaves it whole or torn (skipped)
            except OSError as exc:
                self._drop(exc)  # entries after a torn one are never read: the journal is no use now
                return
            self.appended += 1

    def sync(self) -> None:
        """Make what was appended so far survive a power loss (the journal file, and its entry in the directory
        when the file is new): for an entry whose loss would make recovery believe a stale one (a block's
        remove, before a file of the same key but other bytes is published)."""
        with self._lock:
            if self._fd is None:
                return
            try:
                self._fault("journal", self.dir / f"journal.{self.generation}")
                os.fsync(self._fd)
                if self._dir_synced != self.generation:
                    sync_directory(self.dir)
                    self._dir_synced = self.generation
            except OSError as exc:
                self._drop(exc)  # the tier keeps its unsynced removes, appended again to the next generation

    def rotate(self) -> int | None:
        """Start a new journal generation; returns it (None when the journal is dropped: no snapshot may be
        taken). What a snapshot taken now must cover is everything appended before this call."""
        with self._lock:
            if self._fd is None:
                return None
            self._switch(self.generation + 1)
            self.appended = 0
            return self.generation

    def write_snapshot(self, headers: Iterable[bytes], covers_before: int, *, fsync: bool = True,
                       pins: Iterable[tuple[bytes, Pins]] = ()) -> bool:
        """Write a snapshot of `headers` and `pins` (the state when journal `covers_before` was opened), then
        delete the journals it makes redundant; False (nothing published) when the journal was dropped since.
        Runs in a thread: it may take a second for 100k blocks."""
        tmp = self.dir / "snapshot.tmp"
        try:
            self._fault("snapshot", tmp)
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "wb") as fh:
                fh.write(encode_head(SNAPSHOT_MAGIC, covers_before))
                buf: list[bytes] = []
                for header in headers:
                    buf.append(encode_entry(ADD, header))
                    if len(buf) >= 1024:
                        fh.write(b"".join(buf))
                        buf.clear()
                fh.write(b"".join(buf))
                fh.write(b"".join(encode_pins(key, p) for key, p in pins))  # after the adds: as a replay applies them
                fh.flush()
                if fsync:
                    os.fsync(fh.fileno())
            with self._lock:  # against `drop`: a snapshot of a generation lost meanwhile is not true of the files
                if covers_before <= self.lost_gen:
                    tmp.unlink()
                    return False
                os.replace(tmp, self.snapshot_path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()  # a full disk's half-written snapshot
            raise
        if fsync:
            sync_directory(self.dir)
        for gen, path in self.journals():
            if gen < covers_before:
                with contextlib.suppress(OSError):
                    path.unlink()
        return True

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _set_pins(pins: dict[bytes, Pins], kind: int, body: bytes) -> None:
    key, record = decode_pins(kind, body)
    if record.tenant or record.operator:
        pins[key] = record
    else:
        pins.pop(key, None)


def _write_all(fd: int, data: bytes) -> None:
    """Write all of `data`, or raise the OSError that stopped it. A write cut short (the disk filled, or the
    file reached the process's size limit, RLIMIT_FSIZE) says nothing of why: the rest is written again, and
    that write fails with the cause's own errno (ENOSPC, EFBIG, EDQUOT), which the log then names; every
    short write was reported as "the disk is full", a file size limit too."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n == 0:
            raise OSError(errno.EIO, "a write wrote nothing")
        view = view[n:]
