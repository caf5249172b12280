"""NVMe tier: one self-describing file per block (engram/tiers/blockfile.py) under a directory, written by
group commit (engram/tiers/groupcommit.py) and indexed by a journal (engram/tiers/journal.py).

Why a file per block rather than append-only segments: blocks are large (hundreds of KiB to MiB), so the
per-file cost is small against the payload; deleting a block frees its space at once, with no compaction
pass and no write amplification; and crash safety is the plain temp-file / fsync / rename / fsync-dir
sequence, with no segment index to keep consistent. Group commit shares the directory syncs of the blocks
written together. Segments would win for many small blocks.

Layout:  ROOT/engram-nvme-tier           the marker: only a directory holding it is taken (nvmedir.py says why)
         ROOT/blocks/ab/abcdef....blk   (two hex characters of fan-out keep directories small)
         ROOT/tmp/                       writes in progress; anything here at start-up is a torn write
         ROOT/index/                     the journal: snapshot + journal.<gen> (docs/FORMAT.md)
         ROOT/engram.lock                held by the one daemon (or offline check) using the directory

A write is acknowledged (its `write` returns) only once its file is durable under its final name. Every
read verifies the header (any length) and the payload checksum, so a torn or corrupt file is never served.
The journal also records the pins the store has on blocks, and whose they are (`note_pins`; journal.py says why
there): after `recover()`, `recorded_pins` holds what it recorded, for the store to pin the blocks that came back.
At start-up `recover()` trusts the journal for files that are listed on disk and reads only the headers of
files the journal does not know; `verify_trusted()` then checks the trusted files' headers and sizes in the
background. `check(fix)` verifies everything, and is safe while puts, gets and evictions run: writes in
flight are left alone, and a file is removed only if it is still the one found broken.

Version skew (docs/FORMAT.md): a file of a later format version is a newer Engram's. A scan makes the removals
it decided only once it has seen every file, so a start refuses such a directory (NewerFormat) having changed
nothing, and an offline check fixes nothing in it; one found after the start is set aside (`set_aside`). A
sound file whose checksum is not its journal record's raises StaleRecord on a read: the store may `adopt` it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from engram.block import BlockRecord, Payload
from engram.borrowed import to_its_end
from engram.errors import DataLoss, NewerFormat, NotFound, StorageFull, StorageIOError
from engram.lockfile import DaemonLock
from engram.private import FILE_MODE, private_dir
from engram.tiers.base import StaleRecord, TierUsage, same_block
from engram.tiers.blockfile import (
    FileLayout,
    decode_header,
    decode_payload,
    encode,
    header_bytes,
    max_file_len,
    read_header,
)
from engram.tiers.budget import ByteBudget
from engram.tiers.groupcommit import GroupCommitter, WriteJob, sync_directory
from engram.tiers.journal import NO_PINS, IndexJournal, Pins
from engram.tiers.nvmedir import adopt, claim

log = logging.getLogger(__name__)
MAX_JOURNALS = 16  # journal files since the snapshot before a start writes a new one (crash restarts add one each)
SNAPSHOT_RETRY_S = (1.0, 60.0)  # a failed snapshot is tried again after the first, doubling up to the second
JOURNAL_RETRY_S = (1.0, 60.0)  # a dropped journal is opened again after the first, doubling up to the second
SUFFIX = ".blk"
T = TypeVar("T")


@dataclass
class Finding:
    path: str
    problem: str
    fixed: bool = False


@dataclass
class CheckReport:
    scanned: int = 0
    valid: int = 0
    records: list[tuple[BlockRecord, int]] = field(default_factory=list)  # valid blocks and file sizes
    findings: list[Finding] = field(default_factory=list)
    trusted: int = 0  # recovery: blocks taken from the journal (their files listed, headers checked later)
    newer: list[NewerFormat] = field(default_factory=list)  # files a newer Engram wrote: never removed
    newer_blocks: dict[bytes, NewerFormat] = field(default_factory=dict)  # those named as block files, by key
    # Removals decided by a scan, made once it has seen every file: none in a directory a newer Engram wrote
    pending: list[tuple[Finding, Callable[[], object]]] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return not self.findings


@dataclass(slots=True)
class _File:
    """What the tier knows of one block file: enough to re-create its header for a journal snapshot."""

    rec: BlockRecord
    size: int
    stored_len: int
    compressed: bool


@dataclass(slots=True)
class _Checked:
    problem: str | None  # None: valid
    file: _File | None = None
    ino: int = 0  # the inode found broken: removed only if the path still names it
    newer: NewerFormat | None = None  # a newer Engram's file: not broken, never removed


# The I/O boundary, replaceable by tests to inject faults (ENOSPC, EIO, a slow disk): fn(operation, path)
# may raise or sleep. Operations: "write" (a block's temp file), "read", "delete"; the index journal's
# "journal" (creating a generation, an append, a sync) and "snapshot".
FaultHook = Callable[[str, Path], None]


class NvmeTier:
    name = "nvme"
    durable = True  # survives the process: write-through puts are acknowledged once a copy is here

    def __init__(self, root: str | Path, capacity_bytes: int, *, compression: bool = False, io_threads: int = 4,
                 fsync: bool = True, journal: bool = True, verify_on_start: bool = False,
                 group_commit_blocks: int = 64, create: bool = True, read_only: bool = False) -> None:
        """`create`: a missing or empty directory is made the tier's (a daemon); else only one Engram wrote is
        taken (nvmedir.py: any other is refused, untouched). `read_only` (a check without --fix): nothing in the
        directory is made, marked, tightened or written; only `check(fix=False)` may be called."""
        self.budget = ByteBudget(capacity_bytes, "NVMe")  # held, not inherited: ByteBudget runs compiled
        self.root = Path(root)
        self.blocks_dir = self.root / "blocks"
        self.tmp_dir = self.root / "tmp"
        self.read_only = read_only
        # Refused before anything in it changes (another program's); a new one is made and marked
        state = claim(self.root, create=create and not read_only, mark=not read_only, fsync=fsync)
        # One daemon (or offline check) per directory: two would delete each other's files as strays. Taken before
        # anything in a directory a daemon may hold is marked or tightened (a check --fix beside it did both)
        self._lock = DaemonLock(self.root / "engram.lock", f"the NVMe directory {self.root}",
                                "set another tiers.nvme.path").acquire(create=not read_only)
        if not read_only:
            try:
                if state == "earlier":
                    adopt(self.root, fsync=fsync)
                for d in (self.root, self.blocks_dir, self.tmp_dir):  # a tenant's KV: 0700 directories, 0600 files
                    private_dir(d)
            except BaseException:
                self._lock.release()
                raise
        self._files: dict[bytes, _File] = {}
        self._writing: set[str] = set()  # temp file names of writes in flight: an online check leaves them be
        self._deleting: dict[bytes, asyncio.Event] = {}  # keys whose file is being unlinked: a new write waits
        self._key_writes: dict[bytes, asyncio.Event] = {}  # keys being written: one write of a key at a time
        self._removals: set[asyncio.Task[None]] = set()  # those unlinks: `delete` sees them through, cancelled or not
        self._removed: set[bytes] = set()  # keys whose journal remove is not synced yet (journal.py says why)
        self.compression = compression
        self.fsync = fsync
        self.verify_on_start = verify_on_start
        try:  # failing now, the lock goes too: else its descriptor kept the directory from this whole process
            self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="engram-nvme")
            self._committer = GroupCommitter(self._pool, sync=fsync, max_blocks=group_commit_blocks,
                                             on_error=self._io_error)
            self._journal = IndexJournal(self.root, fsync=fsync, create=not read_only) if journal else None
            if self._journal is not None:
                self._journal.fault = self._fault
            if fsync and not read_only:  # the directories' own entries, made above, survive a power loss (their
                # files' do per write)
                for d in (self.root.parent, self.root):
                    try:
                        sync_directory(d)
                    except OSError as exc:
                        log.warning("could not sync directory %s: %s (a power loss may lose it)", d, exc)
        except BaseException:
            if hasattr(self, "_pool"):
                self._pool.shutdown(wait=False)
            self._lock.release()
            raise
        self._journal_wanted = False  # recovered with a journal: it is kept, and opened again after a failure
        self._snapshot_due = False  # the journal was opened again: the next start trusts it once a snapshot is written
        self._snapshot_failures = 0  # failed snapshot tries in a row: the next waits out a back-off
        self._snapshot_retry_at = 0.0  # time.monotonic() before which no snapshot is tried after a failure
        self._failed_gen = 0  # the generation a failed snapshot opened: its next try covers it, opening none
        self.journal_error: Exception | None = None  # why the journal could not be opened at start (StorageFull...)
        # Keys whose record (file, pins) changed while the journal was dropped: the generation opened next records
        # their state first (journal.py); tried again on a timer, at a write, and at the stop
        self._unjournaled: set[bytes] = set()
        self._reopen_failures = 0
        self._reopen_timer: asyncio.TimerHandle | None = None
        self._compacting: asyncio.Task[None] | None = None
        self.unverified: set[bytes] = set()  # trusted from the journal at start-up, headers not read yet
        # Files a newer Engram wrote, found after the start (journal-trusted, read or checked later): not served,
        # never written over nor deleted; their bytes stay counted (they take the disk's room)
        self.newer_files: dict[bytes, int] = {}
        self._found_files: dict[bytes, _File] = {}  # a file found holding a stale record's block: `adopt` takes it
        # key -> its pins (journal.Pins: with owners) as the journal records them: a start's record, then the store's notes
        self._pins: dict[bytes, Pins] = {}
        self.fault_hook: FaultHook | None = None

    # ---- accounting ------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self.budget.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.budget.used_bytes

    def reserve(self, nbytes: int) -> bool:
        return self.budget.reserve(nbytes)

    def unreserve(self, nbytes: int) -> None:
        self.budget.unreserve(nbytes)

    @property
    def _journal_open(self) -> bool:
        return self._journal is not None and self._journal.is_open

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def __len__(self) -> int:
        return len(self._files)

    def usage(self) -> TierUsage:
        return TierUsage(self.name, self.capacity_bytes, self.used_bytes, len(self._files))

    def path_of(self, key: bytes) -> Path:
        h = key.hex()
        return self.blocks_dir / h[:2] / f"{h}{SUFFIX}"

    @property
    def commit_stats(self) -> tuple[int, int]:
        """(batches, blocks) committed so far: blocks / batches is the group commit's mean batch."""
        return self._committer.stats.batches, self._committer.stats.blocks

    # ---- I/O ---------------------------------------------------------------------------------------

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _fault(self, op: str, path: Path) -> None:
        if self.fault_hook is not None:
            self.fault_hook(op, path)

    def _io_error(self, exc: OSError, path: Path) -> Exception:
        if exc.errno == errno.ENOSPC:
            return StorageFull(f"no space left on the filesystem of {self.root}")
        return StorageIOError(f"writing {path.name}: {exc.strerror or exc}")

    def space_for(self, rec: BlockRecord) -> int:
        return max_file_len(rec)

    async def write(self, rec: BlockRecord, payload: Payload, reserved: int) -> None:
        """Write a block durably (group commit); `reserved` is what the caller reserved (`space_for`). Returns
        once the file is durable under its final name; raises StorageFull / StorageIOError otherwise."""
        final = self.path_of(rec.key)
        if rec.key in self.newer_files:  # a newer Engram's file is there: a rename would replace it
            self.unreserve(reserved)
            raise StorageIOError(f"{final} was written by a newer Engram and is left as it is: block "
                                 f"{rec.key.hex()} is not stored on NVMe by this one")
        if self._journal_wanted and not self._journal_open:
            try:  # first: a disk that has no room for it fails this write (the tier stays degraded)
                self._open_journal()
            except BaseException:
                self.unreserve(reserved)
                raise
        try:  # a cancel here gave the room back to no one: the tier lost it until a restart
            while True:
                if (deleting := self._deleting.get(rec.key)) is not None:
                    await deleting.wait()  # the key's old file is being unlinked: that unlink must not take the new one
                elif (writing := self._key_writes.get(rec.key)) is not None:
                    # Another write of the key ends first (a move that outlived its block, dropped meanwhile and put
                    # again under its key): its file, renamed over this one's, was unlinked as no block's copy.
                    await writing.wait()
                else:
                    break
            mine = self._key_writes[rec.key] = asyncio.Event()
        except BaseException:
            self.unreserve(reserved)
            raise
        try:
            await self._write(rec, payload, reserved, final)
        finally:
            del self._key_writes[rec.key]
            mine.set()

    async def _write(self, rec: BlockRecord, payload: Payload, reserved: int, final: Path) -> None:
        """`write`, this key's turn come."""
        try:  # a cancel or a failed sync here gave the room back to no one: the tier lost it until a restart
            if rec.key in self._removed:  # its old header's remove must be on disk before a new file is
                await self._sync_journal()
                if rec.key in self._removed:  # the sync failed, dropping the journal: the file waits for a new one
                    raise self._journal_failure()
        except BaseException:
            self.unreserve(reserved)
            raise
        tmp = self.tmp_dir / f"{rec.key.hex()}.{uuid.uuid4().hex[:8]}.tmp"
        out: dict[str, object] = {}

        def write_temp() -> Path:
            try:
                self._fault("write", final)
                header, stored = encode(rec, payload, compress=self.compression)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
                try:
                    with os.fdopen(fd, "wb", closefd=True) as fh:
                        fh.write(header)
                        fh.write(stored)
                        fh.flush()
                        if self.fsync:
                            os.fsync(fh.fileno())
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
            except OSError as exc:
                raise self._io_error(exc, final) from exc
            out.update(header=header, stored_len=len(stored), compressed=stored is not payload)
            return tmp

        job = WriteJob(final, len(payload), write_temp)
        self._writing.add(tmp.name)
        job.future.add_done_callback(lambda _: self._writing.discard(tmp.name))
        try:
            await self._committer.commit(job)
        except asyncio.CancelledError:
            self.unreserve(reserved)
            # The batch goes on without this caller; its file must not stay unaccounted. Until this returns,
            # the key's turn is held (`write`), so no other write of the key can race the cleanup: waited for to
            # its end even if cancelled again (a shield's wait ended at a second cancel, and the next write of the
            # key, riding in the same batch, had its file unlinked by this cleanup).
            await to_its_end(asyncio.ensure_future(self._discard_when_done(job)))
            raise
        except BaseException:
            self.unreserve(reserved)
            raise
        self.unreserve(reserved)
        header = out["header"]
        assert isinstance(header, bytes)
        stored_len, compressed = out["stored_len"], out["compressed"]
        assert isinstance(stored_len, int) and isinstance(compressed, bool)
        self._add(_File(rec, len(header) + stored_len, stored_len, compressed))
        self._journaled(rec.key, lambda j: j.add(header))
        self._compact_if_due()

    def note_pins(self, key: bytes, tenant_pins: int, operator_pins: int,
                  owners: Mapping[str, int] | None = None) -> None:
        """The store's pins on a block (engram/index.py's pins listener; (0, 0): unpinned, or gone), and of the
        tenant pins each owner's (BlockMeta.pin_owners), whether or not this tier holds its file yet: journaled
        when they differ from the record, and in every snapshot."""
        pins = Pins(tenant_pins, operator_pins, tuple(sorted((o, n) for o, n in (owners or {}).items() if n)))
        if self._pins.get(key, NO_PINS) == pins:
            return
        if pins == NO_PINS:
            del self._pins[key]
        else:
            self._pins[key] = pins
        self._journaled(key, lambda j: j.pins(key, pins))

    @property
    def recorded_pins(self) -> dict[bytes, Pins]:
        """The pins the journal recorded, in the order first recorded: after `recover()`, of the last run (empty
        when the journal was not trusted); the store pins the blocks that came back and notes the rest cleared."""
        return dict(self._pins)

    async def _sync_journal(self) -> None:
        covered = set(self._removed)  # appended before the sync starts; a write of one of them meanwhile syncs too
        if self._journal_open:
            await self._run(self._journal.sync)  # type: ignore[union-attr]
        if self._journal_open:  # a failed sync dropped it: they are appended again to the next generation
            self._removed -= covered

    def _add(self, f: _File) -> None:
        old = self._files.get(f.rec.key)
        if old is not None:
            self.budget.stored -= old.size
        self._files[f.rec.key] = f
        self.budget.stored += f.size

    async def _discard_when_done(self, job: WriteJob) -> None:
        with contextlib.suppress(Exception):
            await job.future
            await self._run(lambda: job.final.unlink(missing_ok=True))

    def _read_file(self, key: bytes) -> tuple[bytes, BlockRecord, FileLayout]:
        path = self.path_of(key)
        where = f"NVMe block file {path.name}"
        try:
            self._fault("read", path)
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise DataLoss(f"{where} is missing") from None
        except OSError as exc:
            raise StorageIOError(f"reading {path.name}: {exc.strerror or exc}") from exc
        try:
            size = os.fstat(fd).st_size
            rec, lay = read_header(lambda n, off: os.pread(fd, n, off), size, where)
            if rec.key != key:
                raise DataLoss(f"{where} holds block {rec.key.hex()}, not {key.hex()}")
            if size != lay.file_len:
                raise DataLoss(f"{where}: {size} bytes, its header announces {lay.file_len}")
            # One pread straight into the bytes object that is served: no slicing copies.
            stored = os.pread(fd, lay.stored_len, lay.payload_offset)
        except OSError as exc:
            raise StorageIOError(f"reading {path.name}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)
        return decode_payload(rec, lay, stored, where), rec, lay

    async def read(self, key: bytes) -> bytes:
        """The block's payload, verified against its file's own header. A file holding other bytes than the
        tier's record says (a stale journal record: `StaleRecord`) is left to the caller to adopt or drop."""
        f = self._files.get(key)
        if f is None:
            raise NotFound(f"block {key.hex()} is not in the NVMe tier")
        try:
            payload, found, lay = await self._run(lambda: self._read_file(key))
        except NewerFormat as exc:
            self.set_aside(key, exc)
            raise DataLoss(f"{exc}: left on disk, not served") from None
        if found.checksum != f.rec.checksum and self._files.get(key) is f:
            raise self._stale(f, _File(found, lay.file_len, lay.stored_len, lay.compressed), payload)
        self.unverified.discard(key)  # its header and payload just verified
        return payload

    def _stale(self, f: _File, file: _File, payload: bytes = b"") -> DataLoss:
        """What a sound file whose checksum is not the record's is: a stale record of the same block
        (StaleRecord), or a file that does not hold the block the tier recorded (damage)."""
        where = f"NVMe block file {self.path_of(f.rec.key).name}"
        found = file.rec
        if not same_block(found, f.rec):
            return DataLoss(f"{where} holds another block than the tier's record of {f.rec.key.hex()} (parent, "
                            "model, namespace, tokens, shape or size differ)")
        self._found_files[f.rec.key] = file
        return StaleRecord(f"{where} holds block {found.key.hex()} under checksum {found.checksum:016x}, its index "
                           f"journal's record {f.rec.checksum:016x} (a stale record: an earlier build wrote the "
                           "block again)", payload, found)

    def adopt(self, key: bytes, found: BlockRecord, recorded: int) -> bool:
        """Take the file's own record (after StaleRecord) for the tier's record of checksum `recorded`, and
        journal it, so a restart trusts the file's header; False when the file or the record changed since the
        file was read (the caller drops the copy instead)."""
        f = self._found_files.pop(key, None)
        held = self._files.get(key)
        if f is None or f.rec != found or held is None or held.rec.checksum != recorded:
            return False
        self._add(f)
        self.unverified.discard(key)
        self._journaled(key, lambda j: j.add(header_bytes(f.rec, f.stored_len, compressed=f.compressed)))
        self._compact_if_due()
        return True

    def set_aside(self, key: bytes, why: NewerFormat) -> None:
        """A file trusted from the journal that a newer Engram wrote: out of the index (never served), left on
        disk and still counted (its bytes are there); the next start refuses the directory."""
        f = self._files.pop(key, None)
        if f is None:
            return
        size = f.size
        with contextlib.suppress(OSError):
            size = os.stat(self.path_of(key)).st_size  # the newer file's own size, which its record may not say
        self.budget.stored += size - f.size
        self.newer_files[key] = size
        self.unverified.discard(key)
        # Else a start after a crash trusted the old record again and served on (an audit); with its remove, the
        # next start reads the file, and refuses
        self._journaled(key, lambda j: j.remove(key))
        if len(self.newer_files) == 1 or len(self.newer_files) % 1000 == 0:
            log.error("%s: left on disk, not served (%d such files so far); the next start refuses %s: stop this "
                      "daemon and start that version, or move the directory away", why, len(self.newer_files),
                      self.root)

    async def delete(self, key: bytes) -> int:
        """Remove a block's file and journal its remove. Once begun (out of the accounting), it completes even if
        the caller is cancelled: an evict cut off mid-call cancelled the unlink while it waited for an I/O thread
        (the file stayed, known to no index) or skipped its journal remove."""
        self._found_files.pop(key, None)
        f = self._files.pop(key, None)
        if f is None:
            return 0
        self.budget.stored -= f.size
        self.unverified.discard(key)
        done = self._deleting[key] = asyncio.Event()
        removal = asyncio.ensure_future(self._remove_file(key, done))
        self._removals.add(removal)
        removal.add_done_callback(self._removal_done)
        await asyncio.shield(removal)
        return f.size

    async def _remove_file(self, key: bytes, done: asyncio.Event) -> None:
        path = self.path_of(key)

        def unlink() -> None:
            self._fault("delete", path)
            path.unlink(missing_ok=True)

        try:
            await self._run(unlink)
            self._journaled(key, lambda j: j.remove(key))  # after the unlink: see journal.py
            if self.fsync and self._journal_wanted:
                self._removed.add(key)
                if len(self._removed) > 65536 and self._journal_open:  # bounded: a sync covers every remove before it
                    await self._sync_journal()
            self._compact_if_due()
        finally:
            del self._deleting[key]
            done.set()

    def _removal_done(self, removal: asyncio.Task[None]) -> None:
        self._removals.discard(removal)
        if not removal.cancelled():
            removal.exception()  # retrieved: its caller, if still there, has it (StorageIOError...) through the shield

    async def close(self, *, snapshot: bool = True) -> None:
        """Wait for writes in flight, write a final journal snapshot (the next start reads only it; without
        `snapshot`, it replays the journal as after a crash), release the directory. A journal dropped is opened
        again first, when the disk lets it: what changed since is recorded then (pins a stop lost otherwise)."""
        if self._removals:  # deletes whose callers went: their journal removes go before the snapshot
            await asyncio.gather(*self._removals, return_exceptions=True)
        if self._compacting is not None:
            with contextlib.suppress(Exception):
                await self._compacting
        if snapshot and self._journal_wanted and not self._journal_open:
            try:
                self._open_journal()
            except (StorageFull, StorageIOError) as exc:
                if self._unjournaled:
                    log.warning("index journal: still cannot be written at the stop (%s): what changed for %d "
                                "blocks since it was dropped is not recorded; the next start finds the removed "
                                "files gone, and restores the pins the journal recorded before (changes since "
                                "are lost)", exc, len(self._unjournaled))
        if self._reopen_timer is not None:
            self._reopen_timer.cancel()
            self._reopen_timer = None
        if self._journal_open and snapshot:
            with contextlib.suppress(OSError):
                await self._compact()
        if self._journal is not None:
            self._journal.close()
        self._journal_wanted = False
        self._pool.shutdown(wait=True)
        self._lock.release()

    # ---- the journal ---------------------------------------------------------------------------

    def _open_journal(self) -> None:
        """Open a new journal generation when the tier has none (it could not be created or written: the disk
        was full, an I/O error) and record in it first what changed meanwhile: raises StorageFull /
        StorageIOError while it still cannot be (tried again later: `_reopen_soon`)."""
        j = self._journal
        assert j is not None
        try:
            j.open()
        except OSError as exc:
            j.drop(exc)
            self.journal_error = self._journal_failure()
            self._reopen_failures += 1
            self._reopen_soon()
            raise self.journal_error from exc
        self._record_unjournaled()
        if not j.is_open:  # an append failed: dropped again
            self.journal_error = self._journal_failure()
            self._reopen_failures += 1
            self._reopen_soon()
            raise self.journal_error
        self.journal_error = None
        self._reopen_failures = 0
        self._snapshot_due = True  # compacted at the next change (the write that opened it)

    def _journal_failure(self) -> StorageFull | StorageIOError:
        """Why the tier has no journal now, as the error a write that needs one fails with."""
        j = self._journal
        exc = j.error if j is not None else None
        why = "its index journal cannot be written"
        if exc is not None and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StorageFull(f"no space left on the filesystem of {self.root} ({why})")
        return StorageIOError(f"{why}: {getattr(exc, 'strerror', None) or exc}")

    def _journaled(self, key: bytes, append: Callable[[IndexJournal], None]) -> None:
        """Append one key's change to the journal; while it is dropped (or when this append drops it), remember
        the key: the next generation records its state first (`_record_unjournaled`)."""
        j = self._journal
        if j is None:
            return
        if j.is_open:
            append(j)
            if j.is_open:
                return
        if self._journal_wanted:
            self._unjournaled.add(key)
            self._reopen_soon()

    def _record_unjournaled(self) -> None:
        """Append, to a generation just opened, the state of every key that changed while the journal was dropped
        (its file's header, or a remove; its pins), and again every remove not synced before the drop (a file
        of the key waits for that sync: journal.py). The snapshot and journals kept through the drop plus these
        say what the tier holds again."""
        j = self._journal
        assert j is not None
        gone = {k for k in self._removed | self._unjournaled if k not in self._files}
        for key in gone:
            j.remove(key)
        for key in self._unjournaled:
            f = self._files.get(key)
            if f is not None:
                j.add(header_bytes(f.rec, f.stored_len, compressed=f.compressed))
            j.pins(key, self._pins.get(key, NO_PINS))
        if j.is_open:
            if self.fsync:
                self._removed |= gone
            self._unjournaled.clear()

    def _reopen_soon(self) -> None:
        """Try the dropped journal again after a back-off (JOURNAL_RETRY_S), from the event loop, until it opens:
        pins changed meanwhile would otherwise wait for a write or the stop."""
        if self._reopen_timer is not None or not self._journal_wanted:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        first, most = JOURNAL_RETRY_S
        wait = min(most, first * 2 ** min(max(self._reopen_failures - 1, 0), 16))
        self._reopen_timer = loop.call_later(wait, self._reopen)

    def _reopen(self) -> None:
        self._reopen_timer = None
        if not self._journal_wanted or self._journal_open:
            return
        try:
            self._open_journal()
        except (StorageFull, StorageIOError):
            return  # (`_open_journal` set the next try)
        self._compact_if_due()

    @property
    def trouble(self) -> str | None:
        """What is wrong with the tier by its own account, beside its placement health (Stats shows it): its
        index journal dropped. None when nothing is."""
        j = self._journal
        if j is None or not self._journal_wanted or j.is_open:
            return None
        why = getattr(j.error, "strerror", None) or j.error or "unknown"
        # No count of what changed: every tenant's Stats shows a tier's state, and the count is every tenant's
        return (f"its index journal cannot be written ({why}): what changes meanwhile is held in memory and "
                "journaled once it can be, tried again at a write, every "
                f"{JOURNAL_RETRY_S[0]:g}-{JOURNAL_RETRY_S[1]:g} s and at the stop; a crash meanwhile loses the "
                "pin changes among them")

    def _compact_if_due(self) -> None:
        j = self._journal
        if j is None or self._compacting is not None or not j.is_open:
            return
        if j.appended < max(8192, len(self._files)) and not self._snapshot_due:
            return
        if self._snapshot_failures and time.monotonic() < self._snapshot_retry_at:
            return  # the last try failed: another at every change would fail alike (and log it) per write
        self._compacting = asyncio.get_running_loop().create_task(self._compact())
        self._compacting.add_done_callback(lambda _: setattr(self, "_compacting", None))

    async def _compact(self) -> None:
        """Snapshot every file the tier holds and drop the journals before it. The state is taken in the
        event loop (where every change is applied), the bytes are written on a thread.

        After a failed try, the next covers the generation that try opened, if the journal is still in it,
        rather than open another: a snapshot that cannot be written (a directory at its path) opened a journal
        file per try, without bound. Its state already holds the changes that journal recorded before it;
        replaying them over it changes nothing (each entry sets or removes one key's header)."""
        j = self._journal
        assert j is not None
        if self._failed_gen and self._failed_gen == j.generation and j.is_open:
            gen: int | None = j.generation
        else:
            try:
                gen = j.rotate()
            except OSError as exc:
                self._snapshot_failed(f"could not start a new generation for a snapshot: {exc}")
                return
        if gen is None:
            return  # dropped: a snapshot would be trusted over changes no journal records
        files = list(self._files.values())
        pins = list(self._pins.items())
        fsync = self.fsync

        def write() -> bool:
            headers = (header_bytes(f.rec, f.stored_len, compressed=f.compressed) for f in files)
            return j.write_snapshot(headers, gen, fsync=fsync, pins=pins)

        try:
            published = await self._run(write)
        except OSError as exc:  # the old snapshot and the journals since stay: still true of the files
            self._failed_gen = gen
            self._snapshot_failed(f"could not write a snapshot: {exc}")
            return
        self._failed_gen = self._snapshot_failures = 0
        if published and j.lost_gen < gen:  # (not lost since: then a new snapshot is due)
            self._snapshot_due = False

    def _snapshot_failed(self, why: str) -> None:
        """Log a failed snapshot and hold the next try back (SNAPSHOT_RETRY_S): one line per back-off."""
        first, most = SNAPSHOT_RETRY_S
        wait = min(most, first * 2 ** min(self._snapshot_failures, 16))
        self._snapshot_failures += 1
        self._snapshot_retry_at = time.monotonic() + wait
        log.warning("index journal: %s; tried again in %.0f s at the next change, or at the stop (the journals "
                    "since the last snapshot are kept meanwhile)", why, wait)

    # ---- recovery and check --------------------------------------------------------------------

    def _listing(self, report: CheckReport, fix: bool) -> dict[bytes, _LazyPath]:
        """Block files by key, names only (no opens, no stat); stray entries are reported (and removed with
        fix). 100k names take about 0.1 s."""
        found: dict[bytes, _LazyPath] = {}
        if self.read_only and not self.blocks_dir.is_dir():
            return found  # (as tmp/ in `_sweep_tmp`)
        for sub in sorted(self.blocks_dir.iterdir()):
            if not sub.is_dir():
                report.scanned += 1
                self._stray(report, sub, "stray entry (not a block file)", fix)
                continue
            sub_name = sub.name
            base = str(sub)
            with os.scandir(sub) as it:  # a directory is never a block, whatever its name (its type costs no stat)
                entries = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it)
            for name, is_dir in entries:
                key = None if is_dir else _key_of(name, sub_name)
                if key is None:
                    path = sub / name
                    report.scanned += 1
                    problem = ("stray entry (not a block file)" if not name.endswith(SUFFIX) or path.is_dir()
                               else "stray file (name is not a block key in its fan-out directory)")
                    self._stray(report, path, problem, fix)
                    continue
                found[key] = _LazyPath(base, name)
        return found

    def _stray(self, report: CheckReport, path: Path, problem: str, fix: bool) -> None:
        report.findings.append(Finding(str(path), problem))
        if fix and not path.is_dir():  # never delete a directory we did not make; report it only
            report.pending.append((report.findings[-1], functools.partial(path.unlink, missing_ok=True)))

    def _found_newer(self, report: CheckReport, path: Path | _LazyPath, got: _Checked) -> None:
        assert got.newer is not None and got.problem is not None
        report.findings.append(Finding(str(path), got.problem))
        report.newer.append(got.newer)

    def _apply(self, report: CheckReport, *, online: bool = False, start: bool = False) -> None:
        """Make the removals a scan decided, unless a newer Engram wrote a file here: the directory is then not
        this build's to change (a start refuses it; an offline `check --fix` fixes nothing). Online, the daemon
        owns the directory already: everything but the newer files is fixed."""
        pending, report.pending = report.pending, []
        if report.newer and not online:
            first = report.newer[0]
            advice = (f"{len(report.newer)} such files in {self.root}" if len(report.newer) > 1 else "")
            advice += ("; " if advice else "") + "start that version, or move the directory away"
            if start:
                raise NewerFormat(first.path, first.what, first.version, first.reads,
                                  advice + f" (tiers.nvme.path {self.root}; nothing in it was changed)")
            if pending:
                report.findings.append(Finding(str(self.root), f"holds files a newer Engram wrote: nothing was "
                                               f"fixed ({advice})"))
            return
        for finding, remove in pending:
            if remove() is not False:
                finding.fixed = True

    def _check_file(self, path: Path | _LazyPath, key: bytes, verify_payload: bool) -> _Checked:
        """One block file checked: its header (whatever its length), name, size and, with verify_payload,
        its payload checksum."""
        name = path.name
        try:
            with open(path, "rb") as fh:
                st = os.fstat(fh.fileno())
                rec, lay = read_header(lambda n, off: os.pread(fh.fileno(), n, off), st.st_size, name)
                if rec.key != key:
                    return _Checked(f"holds block {rec.key.hex()} under another block's name", ino=st.st_ino)
                if st.st_size != lay.file_len:
                    return _Checked(f"truncated or extended: {st.st_size} bytes, header announces {lay.file_len}",
                                    ino=st.st_ino)
                if verify_payload:
                    decode_payload(rec, lay, os.pread(fh.fileno(), lay.stored_len, lay.payload_offset), name)
        except FileNotFoundError:
            return _Checked("missing")
        except NewerFormat as exc:
            return _Checked(f"{str(exc).removeprefix(f'{name}: ')}; left as it is", ino=st.st_ino, newer=exc)
        except DataLoss as exc:
            return _Checked(str(exc).removeprefix(f"{name}: "))
        except OSError as exc:
            return _Checked(f"unreadable: {exc.strerror or exc}")
        return _Checked(None, _File(rec, st.st_size, lay.stored_len, lay.compressed), st.st_ino)

    def _remove_if_same(self, path: Path | _LazyPath, ino: int) -> bool:
        """Unlink a broken file only if it is still the file found broken (not one renamed over it since)."""
        try:
            if ino and os.stat(path).st_ino != ino:
                return False
            os.unlink(path)
        except (FileNotFoundError, IsADirectoryError, PermissionError):  # gone, or not a file we may remove
            return False
        return True

    def _scan(self, fix: bool, verify_payloads: bool, progress: Callable[[int, int], None] | None = None,
              *, online: bool = False, start: bool = False) -> CheckReport:
        report = CheckReport()
        self._found: list[_File] = []
        if self._journal is not None:
            report.newer += self._journal.newer()
            report.findings += [Finding(e.path, f"{str(e).removeprefix(f'{e.path}: ')}; left as it is")
                                for e in report.newer]
        self._stray_journals(report, fix=fix and not start)
        self._sweep_tmp(report, fix, online=online)
        listing = self._listing(report, fix)
        total = report.scanned + len(listing)
        if progress is not None:
            for done in range(1, report.scanned + 1):  # the stray entries, already looked at
                progress(done, total)
        broken: list[tuple[Finding, bytes]] = []  # block files to remove, by key
        for key, path in listing.items():
            report.scanned += 1
            if progress is not None:
                progress(report.scanned, total)
            got = self._check_file(path, key, verify_payloads)
            if got.problem is None:
                assert got.file is not None
                report.valid += 1
                report.records.append((got.file.rec, got.file.size))
                self._found.append(got.file)
                continue
            if online and got.problem == "missing":
                continue  # deleted (evicted) while the check ran: not a problem
            if got.newer is not None:
                self._found_newer(report, path, got)
                report.newer_blocks[key] = got.newer
                continue
            report.findings.append(Finding(str(path), got.problem))
            if fix:
                report.pending.append((report.findings[-1], functools.partial(self._remove_if_same, path, got.ino)))
                broken.append((report.findings[-1], key))
        self._apply(report, online=online, start=start)
        if fix and not online and not start:
            self._drop_extending(report, [key for finding, key in broken if finding.fixed])
        return report

    def _drop_extending(self, report: CheckReport, dropped: list[bytes]) -> None:
        """An offline `check --fix` (no daemon, no index): the files of the blocks that extend one it removed go
        too, each a finding, as a daemon's check drops them; no lookup could reach them (the next start removed
        them as orphans). A block whose parent is missing for another reason is left to the start, which knows
        each namespace's root key (salted: a chain's first block names no parent file)."""
        children: dict[bytes, list[_File]] = {}
        for f in self._found:
            children.setdefault(f.rec.parent, []).append(f)
        gone: set[bytes] = set()
        stack = list(dropped)
        while stack:
            for f in children.get(stack.pop(), ()):
                path = self.path_of(f.rec.key)
                report.findings.append(Finding(str(path), "unreachable: a block it extends was dropped",
                                               fixed=self._remove_if_same(path, 0)))
                gone.add(f.rec.key)
                stack.append(f.rec.key)
        if gone:
            report.valid -= len(gone)
            report.records = [(rec, size) for rec, size in report.records if rec.key not in gone]
            self._found = [f for f in self._found if f.rec.key not in gone]

    def _stray_journals(self, report: CheckReport, fix: bool) -> None:
        """Report files named as journals of a generation out of range (a copied-in or bit-rotted name): no
        journal of ours has one (none could be numbered after it), so none is ever read. A start leaves them;
        `check --fix` removes them (its findings were never cleared), a directory so named reported only."""
        if self._journal is not None:
            for path in self._journal.out_of_range():
                self._stray(report, path, "journal generation out of range (not below 2^64-1): ignored", fix)

    def _sweep_tmp(self, report: CheckReport, fix: bool, *, online: bool) -> None:
        """Report (and with `fix` delete) temp files no write will finish. Online, a write registers its temp
        name before the file exists and forgets it only once the file is renamed or deleted, so a listed file
        whose name is not registered *now* (the live set, read after the listing, not a copy taken before it:
        a write starting in between would be taken for a torn one and deleted under it) and that still exists
        is a torn write."""
        if self.read_only and not self.tmp_dir.is_dir():
            return  # a read-only check makes nothing: a marked directory a start did not fill yet has none
        for tmp in sorted(self.tmp_dir.iterdir()):
            if online and (tmp.name in self._writing or not tmp.exists()):
                continue  # a write in flight, or one published since the listing
            report.findings.append(Finding(str(tmp), "leftover temp file (a write torn by a crash)"))
            if fix:
                report.pending.append((report.findings[-1], functools.partial(tmp.unlink, missing_ok=True)))

    def _recover_sync(self) -> tuple[CheckReport, list[_File], list[bytes], int, list[bytes], dict[bytes, Pins]]:
        if self._journal is not None and (newer := self._journal.newer()):  # before anything is changed
            report = CheckReport(newer=newer)
            self._apply(report, start=True)
        loaded = None
        if self._journal is not None:  # with verify_on_start, for its pins alone
            loaded = self._journal.load()
        if self._journal is not None:
            self._journal.retire_version_1_snapshot()  # before a version-2 entry: an earlier release would trust it
        if loaded is None or self.verify_on_start:  # no usable journal (from before it, or damage): read every file
            report = self._scan(fix=True, verify_payloads=self.verify_on_start, start=True)
            return report, self._found, [], 0, [], {} if loaded is None else loaded.pins
        report = CheckReport()
        files: list[_File] = []
        trusted: list[bytes] = []
        gone: list[bytes] = []  # journaled, their files gone
        self._stray_journals(report, fix=False)
        self._sweep_tmp(report, fix=True, online=False)
        listing = self._listing(report, fix=True)
        # In journal order (the order blocks were written: parents before children), so the store can index
        # them in one pass; files the journal does not know come after.
        for key, header in loaded.headers.items():
            path = listing.pop(key, None)
            if path is None:  # unlinked after its last add (the remove entry lost with a crash, or an offline fix)
                gone.append(key)
                continue
            report.scanned += 1
            try:
                rec, lay = decode_header(header, path.name, verify=False)  # its journal entry's checksum held
            except (DataLoss, NewerFormat):  # (a newer Engram's: its file says so, below)
                rec = None
            if rec is not None and rec.key == key:
                report.valid += 1
                report.trusted += 1
                report.records.append((rec, lay.file_len))
                files.append(_File(rec, lay.file_len, lay.stored_len, lay.compressed))
                trusted.append(key)
            else:
                listing[key] = path  # journaled wrongly: read the file itself, below
        for key, path in listing.items():
            # Written after its journal entry was lost (a crash), or journaled wrongly: read the file itself.
            report.scanned += 1
            got = self._check_file(path, key, verify_payload=False)
            if got.problem is None:
                assert got.file is not None
                report.valid += 1
                report.records.append((got.file.rec, got.file.size))
                files.append(got.file)
                continue
            if got.newer is not None:
                self._found_newer(report, path, got)
                continue
            report.findings.append(Finding(str(path), got.problem))
            report.pending.append((report.findings[-1], functools.partial(self._remove_if_same, path, got.ino)))
        self._apply(report, start=True)
        return report, files, trusted, loaded.entries, gone, loaded.pins

    async def recover(self) -> CheckReport:
        """Rebuild the tier's accounting at start-up, removing torn, corrupt and stray files. With a journal,
        files it records are trusted (their headers are checked by `verify_trusted`, and every read verifies
        its file); without one (or with tiers.nvme.verify_on_start) every file is read."""
        report, files, trusted, entries, gone, self._pins = await self._run(self._recover_sync)
        self._files.clear()
        self.budget.stored = 0
        for f in files:
            self._add(f)
        self.unverified = set(trusted)
        if self._journal is not None:
            self._journal_wanted = True
            try:
                self._open_journal()
            except StorageFull:  # serve the files without a journal; the store degrades the tier (journal_error)
                for key in gone:  # recorded once the journal opens (`_record_unjournaled`)
                    self._journaled(key, functools.partial(_append_remove, key=key))
                if self.fsync:
                    self._removed.update(gone)
                return report
            except StorageIOError as exc:
                # Not a full disk, which frees up: index/ is a file, read-only, not ours. Started degraded, every
                # write-through put was refused for good (an audit): the start fails instead (`engram serve`: 9).
                cause = exc.__cause__
                raise OSError(f"tiers.nvme.path {self.root}: its index journal cannot be created in "
                              f"{self.root / 'index'} ({getattr(cause, 'strerror', None) or cause or exc}); make it a "
                              "directory this daemon can write") from None
            for key in gone:  # as a delete does: else a later start trusts their old headers for files written again
                self._journal.remove(key)
            if self.fsync:
                self._removed.update(gone)  # synced before a file of the key is published (journal.py)
                if len(self._removed) > 65536:
                    await self._sync_journal()
            # None to trust, a long journal, or none on disk (the journals were renumbered): the next start would
            # read every file. Many journals: every start after a crash opens one more, and only a snapshot ends them
            self._snapshot_due = (report.trusted == 0 or entries > 2 * len(self._files) + 1024
                                  or not self._journal.snapshot_path.exists()
                                  or len(self._journal.journals()) > MAX_JOURNALS)
            self._compact_if_due()
        return report

    async def verify_trusted(self, batch: int = 256) -> list[tuple[bytes, str | DataLoss]]:
        """Check the headers and sizes of the files trusted from the journal at start-up, a batch at a time on
        the I/O threads, and that each holds the block its journal record names. Returns (key, what) for the
        store: a problem (str) for a file removed and forgotten (broken) or set aside (a newer Engram's), a
        DataLoss for a sound file whose checksum is not the record's, still held: a StaleRecord the store may
        adopt, or another block under the key, which it drops as damaged."""
        bad: list[tuple[bytes, str | DataLoss]] = []
        while self.unverified:
            keys = [self.unverified.pop() for _ in range(min(batch, len(self.unverified)))]
            keys = [k for k in keys if k in self._files]

            def check(keys: list[bytes] = keys) -> list[tuple[bytes, _Checked]]:
                out = []
                for key in keys:
                    got = self._check_file(self.path_of(key), key, verify_payload=False)
                    f = self._files.get(key)
                    if got.problem is not None or (f is not None and got.file is not None
                                                   and got.file.rec.checksum != f.rec.checksum):
                        out.append((key, got))
                return out

            for key, got in await self._run(check):
                f = self._files.get(key)
                if f is None:
                    continue  # deleted meanwhile
                if got.problem is None:  # sound, but not the bytes its journal record names
                    assert got.file is not None
                    if got.file.rec.checksum != f.rec.checksum:
                        bad.append((key, self._stale(f, got.file)))
                    continue
                problem, ino = got.problem, got.ino
                assert problem is not None
                if got.newer is not None:  # never removed: set aside, as a read does
                    self.set_aside(key, got.newer)
                    bad.append((key, f"{problem} on disk, not served"))
                    continue
                path = self.path_of(key)
                await self._run(lambda path=path, ino=ino: self._remove_if_same(path, ino))  # type: ignore[misc]
                self.forget(key)
                bad.append((key, problem))
        return bad

    async def check(self, *, fix: bool, progress: Callable[[int, int], None] | None = None) -> CheckReport:
        """Verify every file, payloads included; with fix, remove what is broken (the caller drops those
        blocks from its index). Safe while the tier is in use: writes in flight and files deleted during the
        scan are not findings. `progress(done, total)` is called per file, from the I/O thread."""
        if fix and self.read_only:
            raise AssertionError("check --fix on a tier opened read-only")
        online = self._journal_wanted or bool(self._files)
        return await self._run(lambda: self._scan(fix=fix, verify_payloads=True, progress=progress, online=online))

    async def verify(self, key: bytes) -> str | None:
        """One block's file checked now, payload included: None when valid, else what is wrong."""
        got = await self._run(lambda: self._check_file(self.path_of(key), key, verify_payload=True))
        return got.problem

    def forget(self, key: bytes) -> None:
        """Drop a block from the accounting after its file was removed by a check."""
        self._found_files.pop(key, None)
        f = self._files.pop(key, None)
        if f is not None:
            self.budget.stored -= f.size
        self.unverified.discard(key)
        self._journaled(key, lambda j: j.remove(key))
        if self.fsync and self._journal_wanted:  # as delete: a block put again under this key must not be published
            self._removed.add(key)  # before this remove is on disk (recovery would trust the old header)

    def keys(self) -> Iterable[bytes]:
        return self._files.keys()


class _LazyPath:
    """A block file's directory and name, made a Path only when a file must be opened (most are not)."""

    __slots__ = ("base", "name")

    def __init__(self, base: str, name: str) -> None:
        self.base = base
        self.name = name

    def __fspath__(self) -> str:
        return f"{self.base}/{self.name}"

    def __str__(self) -> str:
        return self.__fspath__()

    @property
    def path(self) -> Path:
        return Path(self.__fspath__())


def _append_remove(journal: IndexJournal, key: bytes) -> None:
    journal.remove(key)


def _key_of(name: str, sub: str) -> bytes | None:
    """The key a block file's name carries, when it is a block file in its right fan-out directory."""
    if not name.endswith(SUFFIX):
        return None
    stem = name[: -len(SUFFIX)]
    if len(stem) != 32 or stem[:2] != sub:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


__all__ = ["CheckReport", "FaultHook", "Finding", "NvmeTier"]
