"""Agent sessions: a conversation's tokens, its replay mode, and (while hot) its sliding-window KV.

The global KV of a session lives in the block store like any other prefix (content-addressed, shared with
every session of the same prefix). What is per session is the SWA window, the sliding layers' KV for the
last W-1 positions, which a query needs to continue:
- exact / approx mode: the daemon never stores the window. Resume rebuilds it with the daemon's own model
  instance from the stored global KV (engram/replay); the rebuilt window stays hot (in memory) until the
  session is suspended, appended to, pushed out by newer hot windows (`max_hot_windows`, LRU), or one of its
  blocks leaves the memory tiers (demoted to NVMe or evicted: the session has gone cold).
- persist mode: the worker uploads the window (AppendSession) and the daemon keeps it, no replay.
- auto mode: the daemon chooses with the cost model calibrated for the model on this machine
  (engram/replay/costmodel.py, `engram bench replay --calibrate`): when the session goes cold, keep its rebuilt
  window (persisted, within replay.max_persisted_window_bytes) or drop it; on Resume, replay exact or approx,
  whichever is fastest above the operator's fidelity floor. Without a calibration it behaves as exact mode.
- a model whose window holds no row (no sliding layer, or W = 1: `holds_no_window`) needs no replay model in
  any mode, nor an uploaded window in persist mode: every Resume answers the empty window at P.
The mode is recorded in the session, so a user can choose per session and per model (BRIEF section 3).

A live session holds a reference to every stored block of its prefix (re-resolved on Open, Append, Fork
and Resume, so blocks put since are picked up), and a forked sub-agent holds the same blocks, not copies.
Eviction takes unreferenced blocks first (engram/eviction.py); CloseSession drops the references.
Sessions live in daemon memory; they do not survive a restart (their blocks do).

Session ids are per owner (`SessionKey`): in a namespace tenants share, each tenant's ids are its own, so a
tenant opening an id another already holds gets a session of its own, as for a free id: "already exists" there
told a tenant which ids the others use, and let it take the ids they would use next (an audit, session 48). An
admin (and every caller with tenancy off) is one more owner, "", and sees every owner's sessions
(`SessionManager.get`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import logging
import operator
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from engram import limits
from engram.api import SessionInfo, SessionMode
from engram.block import checksum
from engram.codec import stored
from engram.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from engram.eviction import Expected
from engram.index import BlockMeta
from engram.keys import block_key
from engram.layout import DType, KVLayout, LayerKind, ModelSpec
from engram.logbudget import LogBudget
from engram.loopturns import SLICE_BLOCKS, LoopTurns, pause
from engram.replay.costmodel import CostModel, FidelityFloor, NoAllowedOption
from engram.replay.model import ReplayModel, SwaWindow
from engram.replay.reconstruct import Reconstruction, ReplayMode
from engram.replay.runtime import ReplayRuntime
from engram.sessiontokens import SessionTokens
from engram.store import BlockStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Window:
    """An SWA window as bytes: (sliding layers, 2, prefix_len - start, kv heads, head dim) in dtype."""

    prefix_len: int
    start: int
    dtype: DType
    shape: tuple[int, ...]
    data: bytes
    checksum: int

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @classmethod
    def from_swa(cls, w: SwaWindow, dtype: DType, n_kv: int, head_dim: int) -> Window:
        rows = w.prefix_len - w.start
        if w.kv:
            t = torch.stack([torch.stack((k, v)) for k, v in w.kv]).to("cpu", dtype.torch_dtype).contiguous()
        else:
            t = torch.empty(0, 2, rows, n_kv, head_dim, dtype=dtype.torch_dtype)
        data = t.view(torch.uint8).numpy().tobytes()
        return cls(w.prefix_len, w.start, dtype, tuple(t.shape), data, checksum(data))

    @classmethod
    def empty(cls, layout: KVLayout, prefix_len: int) -> Window:
        """The window of 0 rows at prefix_len of a layout that `holds_no_window`: built from the layout alone,
        as a replay of R = 0 (`reconstruct.empty_window` through `from_swa`) gives it."""
        sliding = sum(1 for layer in layout.layers if layer.kind == LayerKind.SLIDING)
        return cls(prefix_len, prefix_len, layout.dtype, (sliding, 2, 0, layout.num_kv_heads, layout.head_dim), b"",
                   checksum(b""))

    def tensor(self) -> torch.Tensor:
        return stored.byte_tensor(self.data).view(self.dtype.torch_dtype).reshape(self.shape)

    def to_swa(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> SwaWindow:
        t = self.tensor().to(device=device, dtype=dtype or self.dtype.torch_dtype)
        return SwaWindow(self.prefix_len, self.start, tuple((layer[0], layer[1]) for layer in t))

    def validate(self, spec: ModelSpec, where: str = "window") -> None:
        lay = spec.layout
        if lay.has_streams:
            raise FailedPrecondition(f"{where}: windows of a stream layout's model are not persisted yet (their "
                                     "sliding layers' KV has no fixed K/V shape here); keep the window in the worker")
        sliding = [layer for layer in lay.layers if layer.kind == LayerKind.SLIDING]
        w = sliding[0].window if sliding else 1
        rows = min(self.prefix_len, w - 1)
        want = (len(sliding), 2, rows, lay.num_kv_heads, lay.head_dim)
        if self.start != self.prefix_len - rows or tuple(self.shape) != want:
            raise InvalidArgument(f"{where}: shape {tuple(self.shape)} from {self.start} does not fit a query at "
                                  f"{self.prefix_len}: need {want} from {self.prefix_len - rows} (W={w})")
        if self.dtype != lay.dtype:
            raise InvalidArgument(f"{where}: dtype {self.dtype.name}, the layout's is {lay.dtype.name}")
        n = len(self.data)
        if n != int(np.prod(self.shape)) * self.dtype.itemsize or checksum(self.data) != self.checksum:
            raise InvalidArgument(f"{where}: {n} bytes do not match its shape and checksum")


def holds_no_window(layout: KVLayout) -> bool:
    """No sliding layer, or W = 1: a query's window has no row (reconstruct.nothing_to_rebuild, read from the
    registered layout, which any replay model serving it implies). Its sessions need no replay model in any mode,
    nor an uploaded window in persist mode: every Resume answers `Window.empty`. Opening one in exact mode on a
    daemon without the weights was refused, and a persist-mode Resume with no upload was. A stream layout's
    windows are not answered by the daemon yet (`Window.validate`): not for them."""
    return not layout.has_streams and all(layer.window <= 1 for layer in layout.layers
                                          if layer.kind == LayerKind.SLIDING)


SessionKey = tuple[str, str, str]  # (namespace, owner, session id): ids are per owner


@dataclass
class Session:
    id: str
    namespace: str
    fingerprint: bytes
    tokens: np.ndarray  # int32
    mode: SessionMode
    approx_k: float
    parent: str = ""
    tenant: str = ""  # the token that opened (or forked) it, its owner; "": tenancy off, or an admin
    parent_key: SessionKey | None = None  # the parent's key (a fork's parent may be another owner's: an admin's fork)
    window: Window | None = None  # hot (rebuilt) or persisted
    # Kept: the tenant whose share of persisted windows it counts against, the caller that made it kept (in a
    # namespace tenants share, not always the session's opener); hot: the caller whose Resume rebuilt it
    window_tenant: str = ""
    kept: bool = False  # the window is persisted: its bytes count against the budget and it survives going cold
    cooled: int = 0  # times it went cold: a replay that ends after one leaves the session cold
    decision: str = ""  # auto mode: the cost model's last choice, with its reason
    created: float = field(default_factory=time.time)
    held: dict[bytes, BlockMeta] = field(default_factory=dict)  # the stored blocks of its prefix it references
    expected: Expected = field(default_factory=Expected)  # when its client said it is back (its blocks point here)
    active_ms: float = 0.0  # the eviction model's clock at its last call: idle past idle_close_s, it is closed
    awaiting: bytes = b""  # the key of its prefix's next block, not stored yet: referenced when it is put
    holds: int = 0  # holds of its prefix begun: a hold in slices stops once a later one began (`hold_in_slices`)

    @property
    def key(self) -> SessionKey:
        return self.namespace, self.tenant, self.id

    def seen_by(self, tenant: str) -> bool:
        """Whether a call of `tenant` may name this session: its owner's, an admin's or any with tenancy off ("").
        In a namespace tenants share, another tenant appended to a session it never opened (its owner's next
        Resume rebuilt KV for tokens the owner never sent), resumed, forked and closed it (an audit, session 48)."""
        return not tenant or self.tenant == tenant

    def replay_mode(self) -> ReplayMode:
        return ReplayMode.approx(self.approx_k) if self.mode == SessionMode.APPROX else ReplayMode.exact()

    def info(self, *, model_seen: bool = True) -> SessionInfo:
        """What the session answers; `model_seen`: whether the caller may see its model's fingerprint (b"" when
        not: a caller sees only the models it registered, engram/registry.py)."""
        w = self.window
        return SessionInfo(session_id=self.id, namespace=self.namespace,
                           model_fingerprint=self.fingerprint if model_seen else b"",
                           tokens=len(self.tokens), mode=self.mode, approx_k=self.approx_k, hot=w is not None,
                           window_prefix_len=w.prefix_len if w else 0, parent=self.parent, created_s=self.created,
                           persisted=self.kept, decision=self.decision, expect_back_ms=int(self.expected.wait),
                           owner=self.tenant)


@dataclass(frozen=True)
class Resumed:
    position: int
    blocks: tuple[BlockMeta, ...]
    window: Window
    source: str  # "replay", "hot" or "persisted"
    replayed: int
    token_layers: int
    seconds: float


@dataclass
class ResumeStage:
    """What a Resume is doing before it answers: its progress messages say it (ResumeProgress, server/service.py)."""

    name: str = "waiting"  # for a replay's turn; then "reading" the stored global KV, then "replaying"


class FairTurns:
    """A fixed number of turns (replays at once) handed to waiters round-robin between tenants, each tenant's
    waiters first come, first served: with one FIFO queue a tenant within its share queued its 16 Resumes and
    another tenant's single Resume waited behind all of them. A tenant waits for at most one turn per other
    waiting tenant ahead of it; with one tenant (tenancy off: "") the order is FIFO. A turn given back goes
    straight to the next waiter (a free turn means nobody waits), so a later caller cannot take it first; a
    waiter cancelled as it is handed a turn hands it on, and a cancelled waiter leaves its queue and the counts."""

    def __init__(self, turns: int) -> None:
        self._free = turns
        # tenant -> its waiters, oldest first; the tenants in their round's order (served: moved to the end)
        self._queues: OrderedDict[str, collections.deque[asyncio.Future[None]]] = OrderedDict()
        self.waiting = 0  # waiters of every tenant

    def busy(self) -> bool:
        """No turn is free: a caller now would wait."""
        return not self._free

    def waiting_of(self, tenant: str) -> int:
        """The tenant's waiters (its share of the queue is checked against this)."""
        q = self._queues.get(tenant)
        return len(q) if q else 0

    @property
    def tenants_waiting(self) -> list[str]:
        """The tenants with waiters, in the order the round serves them next."""
        return list(self._queues)

    async def take(self, tenant: str = "") -> None:
        """Return holding a turn, after the waiters ahead of it in the round; the caller gives it back
        (`give_back`). Nothing is awaited before the caller is queued: a bound its caller checked just before
        still holds."""
        if self._free:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(tenant, collections.deque()).append(fut)
        self.waiting += 1
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():  # handed a turn as it was cancelled: the next waiter's
                self.give_back()
            else:
                self._forget(tenant, fut)
            raise

    def give_back(self) -> None:
        """A turn ends: the next tenant in the round gets it for its oldest waiter, and moves to the round's end."""
        while self._queues:
            tenant, q = next(iter(self._queues.items()))
            fut = q.popleft()
            self.waiting -= 1
            if q:
                self._queues.move_to_end(tenant)
            else:
                del self._queues[tenant]
            if not fut.done():  # one cancelled but not yet out of its queue is passed over
                fut.set_result(None)
                return
        self._free += 1

    def _forget(self, tenant: str, fut: asyncio.Future[None]) -> None:
        q = self._queues.get(tenant)
        if q is None or fut not in q:  # passed over by give_back already
            return
        q.remove(fut)
        self.waiting -= 1
        if not q:
            del self._queues[tenant]


class SessionManager:
    def __init__(self, store: BlockStore, runtime: ReplayRuntime, *, max_hot_windows: int = 64,
                 max_sessions_per_namespace: int = 4096, max_session_tokens: int = 1 << 21,
                 max_persisted_window_bytes: int = 2**30, cost_models: dict[str, CostModel] | None = None,
                 floor: FidelityFloor | None = None, persist_tier: str = "dram", prefetch_lead_ms: float = 1000.0,
                 idle_close_s: float = 0.0, max_concurrent_replays: int = 2, max_queued_replays: int = 64,
                 max_queued_replays_per_tenant: int = 0, max_persisted_window_bytes_per_tenant: int = 0,
                 max_live_session_tokens: int = 0, max_live_session_tokens_per_tenant: int = 0) -> None:
        """cost_models: per weights_id, the calibrated cost model auto-mode sessions of that model decide by;
        floor: the fidelity an approximate replay must have measured; persist_tier: where a kept window lives
        (what its load is priced at); prefetch_lead_ms: how long before a session is due back (its client's
        expect_back_ms) its blocks below the top tier are copied up (`prefetch_due`; 0: never); idle_close_s:
        a session no call touched for this long is closed (`close_idle`; 0: never); max_concurrent_replays,
        max_queued_replays: replays run at once (on threads of their own), and Resumes waiting for a turn before
        one more is refused (`_replay`); max_live_session_tokens: the tokens every live session holds together
        (`SessionTokens`; 0: no bound); the _per_tenant bounds: a tenant's share of those Resumes, of the persisted
        windows and of the sessions' tokens (0: none; a call's `tenant` is "" where no share applies: tenancy off,
        an admin)."""
        self.store = store
        self.runtime = runtime
        self.max_queued_replays = max_queued_replays
        self._replay_turns = FairTurns(max_concurrent_replays)  # waiting Resumes served round-robin by tenant
        self._replay_threads = ThreadPoolExecutor(max_concurrent_replays, thread_name_prefix="engram-replay")
        self.max_queued_replays_per_tenant = max_queued_replays_per_tenant
        self.cost_models = dict(cost_models or {})
        self.floor = floor or FidelityFloor()
        self.persist_tier = persist_tier
        self.max_hot_windows = max_hot_windows
        # Bounds on what sessions hold in daemon memory: their number per namespace (a tenant's own
        # max_sessions overrides it), their length, their tokens all together (and each tenant's share), and
        # persisted windows, which with the sessions' tokens also count against their namespace's quota
        # (store.hold) so that a tenant cannot keep outside its quota what it could not keep inside.
        self.max_sessions_per_namespace = max_sessions_per_namespace
        self.max_session_tokens = max_session_tokens
        self.live_tokens = SessionTokens(store, max_live_session_tokens, max_live_session_tokens_per_tenant)
        self.max_persisted_window_bytes = max_persisted_window_bytes
        self._persisted_bytes = 0
        self.max_persisted_window_bytes_per_tenant = max_persisted_window_bytes_per_tenant
        self._persisted_of: collections.Counter[str] = collections.Counter()  # tenant -> its sessions' window bytes
        self._sessions: dict[SessionKey, Session] = {}
        self._per_namespace: collections.Counter[str] = collections.Counter()  # live sessions: Stats asks per namespace
        self._per_owner: collections.Counter[tuple[str, str]] = collections.Counter()  # (namespace, owner) -> live
        self._owners: dict[tuple[str, str], list[str]] = {}  # (namespace, id) -> its owners: an admin's `get`
        self._hot: OrderedDict[SessionKey, None] = OrderedDict()  # rebuilt windows, LRU first
        self.windows_dropped_cold = 0  # rebuilt windows dropped because their session's blocks left memory
        self.prefetch_lead_ms = prefetch_lead_ms
        self._due: list[tuple[float, int, Session, float]] = []  # (when to prefetch, seq, session, its due then)
        self._seq = itertools.count()
        self.idle_close_s = idle_close_s
        self.closed_idle = 0  # sessions `close_idle` closed
        self._idle_said = LogBudget()  # each closed one is a line within it; the rest, a line a pass (`close_idle`)
        # key -> idle seconds, of the last sessions closed idle: a later call of the owner on one says why it is gone
        self._closed_idle: OrderedDict[SessionKey, float] = OrderedDict()
        # key of a block not stored yet -> the sessions whose prefix continues with it (`_await_next`)
        self._awaiting: dict[bytes, dict[SessionKey, Session]] = {}
        # A tenant's long walks of a prefix, one at a time: shared with Lookup and GetPrefix (engram/loopturns.py)
        self.turns = LoopTurns()
        store.on_cold(self._block_went_cold)
        store.index.listeners.append(self._indexed)

    # ---- lifecycle -------------------------------------------------------------------------------

    def open(self, namespace: str, fingerprint: bytes, mode: SessionMode, approx_k: float = 0.0, session_id: str = "",
             tokens: np.ndarray | None = None, *, tenant: str = "", hold: bool = True) -> Session:
        """hold=False: the caller holds its prefix's blocks next (`hold_in_slices`)."""
        spec = self.store.spec(fingerprint)
        limits.check_session_id(session_id)
        limits.check_approx_k(approx_k)
        if mode == SessionMode.APPROX and approx_k <= 0:
            raise InvalidArgument("approx mode needs approx_k > 0 (R = approx_k * W tokens are replayed)")
        if mode != SessionMode.PERSIST and not holds_no_window(spec.layout):
            self.runtime.require(spec)  # refuse now, not at the first Resume
        sid = session_id or uuid.uuid4().hex[:16]
        if (namespace, tenant, sid) in self._sessions:  # the caller's own id space (`SessionKey`)
            raise InvalidArgument(f"session {sid} already exists in this namespace; pick another id or omit it")
        # Each owner's sessions count against its own limit: in a namespace tenants share, one tenant's sessions
        # filled the namespace's and every other's OpenSession there was refused, told how many sessions it held
        limit = self.store.namespaces.max_sessions(namespace, tenant) or self.max_sessions_per_namespace
        if self.count_in(namespace, tenant) >= limit:
            if tenant:
                raise ResourceExhausted(
                    f"you have {limit} live sessions in namespace {namespace!r}, as many as your token may hold "
                    f"there (auth.tenants.{tenant}.max_sessions, else server.max_sessions_per_namespace); close "
                    "sessions of yours it no longer needs (engram ls -n lists them), or ask the operator to raise it")
            raise ResourceExhausted(f"namespace {namespace!r} has {limit} live sessions, its limit; close sessions "
                                    "it no longer needs (or raise server.max_sessions_per_namespace, or the "
                                    "tenants' max_sessions)")
        toks = np.asarray(tokens if tokens is not None else [], dtype=np.int32)
        self.check_length(len(toks))
        # The tokens count against the daemon's bound, the tenant's share of it and the quota, as a persisted
        # window does: 4 bytes each, up to server.max_tokens_per_request per session, 4,096 sessions a namespace:
        # 32 GiB a tenant kept outside any bound. A fork's, a view of its parent's, are counted once.
        toks = self.live_tokens.take(toks, namespace, tenant, "this session's tokens")
        s = Session(sid, namespace, fingerprint, toks, mode, approx_k, tenant=tenant)
        self._sessions[s.key] = s
        self._per_namespace[namespace] += 1
        self._per_owner[namespace, tenant] += 1
        self._owners.setdefault((namespace, sid), []).append(tenant)
        self._closed_idle.pop(s.key, None)
        self._touch(s)
        if hold:
            self.hold(s)
        return s

    def hold(self, s: Session) -> None:
        """Re-resolve the blocks of the session's prefix and move its references to them; the next block of
        the prefix that is not stored yet is awaited, so a put that lands after the append is held too."""
        s.holds += 1
        match = self.store.match(s.namespace, s.fingerprint, s.tokens)
        self.hold_blocks(s, match.blocks)
        self._await_next(s, match.blocks[-1] if match.blocks else None, match.matched_tokens)

    def turn(self, s: Session, n_tokens: int, tenant: str) -> contextlib.AbstractAsyncContextManager[None]:
        """`tenant`'s turn for a walk of more than a slice of the session's blocks (engram/loopturns.py); none for
        a shorter one."""
        if n_tokens <= SLICE_BLOCKS * self.store.spec(s.fingerprint).layout.block_tokens:
            return contextlib.nullcontext()
        return self.turns.turn(tenant)

    async def hold_in_slices(self, s: Session, tenant: str, found: tuple[Sequence[BlockMeta], int] | None = None
                             ) -> None:
        """`hold`, its prefix walked (BlockStore.lookup_walk) and its new references taken `SLICE_BLOCKS` at a time
        with a turn of the event loop between slices, in `tenant`'s turn: a session of a million tokens is tens of
        thousands of blocks, and in one go its Open, Append, Fork or Resume held every tenant's calls for up to
        ~200 ms (session 49). A hold begun later (another call on the session), or the session's close, stops it
        between slices: each slice leaves the references and `held` agreeing, and the later call holds the rest.
        A hold cut (its call's deadline, its client gone) holds the rest in one go: cut while it waited for the turn,
        an OpenSession left its session open holding none of its blocks (a review, session 49). `found`: the
        session's whole prefix as the caller's own walk of its tokens just found it (blocks, matched tokens), in
        the caller's turn with no await since (a Resume at the session's end): held from it, in that turn, not
        walked again."""
        s.holds += 1
        mine = s.holds
        try:
            if found is None:
                await self._hold_slices(s, tenant, mine)
            else:
                await self._reference_slices(s, mine, *found)
        except BaseException:
            if self._holding(s, mine):
                self.hold(s)
            raise

    async def _hold_slices(self, s: Session, tenant: str, mine: int) -> None:
        tokens = s.tokens
        async with self.turn(s, len(tokens), tenant):
            walk = self.store.walk(s.namespace, s.fingerprint, tokens)
            try:
                await self.store.lookup_walk(walk)
                blocks, matched = walk.found(), walk.matched_tokens()
            finally:
                walk.close()
            await self._reference_slices(s, mine, blocks, matched)

    async def _reference_slices(self, s: Session, mine: int, blocks: Sequence[BlockMeta], matched: int) -> None:
        """The references of a hold in slices (`hold_in_slices`), to the prefix's `blocks` (`matched` tokens) as a
        walk found them just now."""
        if not self._holding(s, mine):
            return
        held = s.held
        same = list(map(operator.is_, blocks, held.values()))
        k = same.index(False) if False in same else len(same)
        if k < len(held):  # the prefix changed inside (a block evicted and put again): rare, in one go
            self.hold_blocks(s, blocks)
        else:  # the common case: it grew (Append), or is new (Open, Fork); a Resume's is the same
            self._stop_awaiting(s)  # no block is added behind this hold's back: `_indexed` extends the held tail
            for start in range(k, len(blocks), SLICE_BLOCKS):
                if start > k:
                    await pause()
                    if not self._holding(s, mine):
                        return
                part = blocks[start : start + SLICE_BLOCKS]
                self.store.reference(part, +1, s.expected, s.tenant)
                s.held.update((m.key, m) for m in part)
        self._await_next(s, blocks[-1] if blocks else None, matched)

    def _holding(self, s: Session, hold: int) -> bool:
        """Whether a hold in slices (`hold`, its number) may go on: the session is live and no later hold began."""
        return s.holds == hold and self._sessions.get(s.key) is s

    def _await_next(self, s: Session, last: BlockMeta | None, matched: int) -> None:
        """Register the key of the block after `last` (the end of the session's stored prefix, `matched`
        tokens), if its tokens go on: a client (the vLLM connector with async saves) may append before its put
        lands."""
        self._stop_awaiting(s)
        if matched >= len(s.tokens):
            return  # all of it is stored (its tail perhaps as the start of a longer block)
        bt = self.store.spec(s.fingerprint).layout.block_tokens
        if matched % bt:  # the match ends inside a block (a stored partial one, or a longer one that diverges):
            assert last is not None  # the awaited block is the whole one in its place, under the last whole one
            matched -= matched % bt
            last = self.store.index.get_in(s.namespace, last.parent)
        parent = last.key if last is not None else self.store.root(s.namespace, s.fingerprint)
        s.awaiting = block_key(parent, s.tokens[matched : matched + bt])
        self._awaiting.setdefault(s.awaiting, {})[s.key] = s

    def _stop_awaiting(self, s: Session) -> None:
        waiting = self._awaiting.get(s.awaiting) if s.awaiting else None
        if waiting is not None:
            waiting.pop(s.key, None)
            if not waiting:
                del self._awaiting[s.awaiting]
        s.awaiting = b""

    def _indexed(self, change: str, meta: BlockMeta) -> None:
        """The store indexed a block: sessions awaiting it (its key names its whole prefix, in its namespace)
        take a reference and await the next one."""
        waiting = self._awaiting.get(meta.key) if change == "add" else None
        if not waiting:
            return
        for s in list(waiting.values()):
            if s.namespace != meta.namespace or self._sessions.get(s.key) is not s:
                continue
            # The awaited key extends the whole blocks it holds (each hold registers it anew): one more
            # reference, in place of the block it held there if any (a partial one, or one that diverges).
            tail = next(reversed(s.held.values()), None)
            if tail is not None and tail.key != meta.parent:
                blocks = list(s.held.values())
                keep = next((i + 1 for i, m in enumerate(blocks) if m.key == meta.parent), 0)
                self.hold_blocks(s, [*blocks[:keep], meta])
            else:
                self.store.reference([meta], +1, s.expected, s.tenant)
                s.held[meta.key] = meta
            if meta.full:
                self._await_next(s, meta, len(s.held) * meta.num_tokens)
            else:
                self._stop_awaiting(s)  # a partial block ends the prefix

    def hold_blocks(self, s: Session, blocks: Sequence[BlockMeta]) -> None:
        """Move the session's references to `blocks`, its prefix's stored blocks as `hold` resolves them (the
        trace replayer resolves them by key: BlockStore.lookup_keys). Only what follows the first block where
        the two differ is compared by key: a long context whose tail was evicted and stored again costs its
        tail, not its whole length (a chain's keys are unique, so the common part's keys occur nowhere after)."""
        held = s.held
        same = list(map(operator.is_, blocks, held.values()))
        k = same.index(False) if False in same else len(same)
        if k == len(held):
            # The common case, a session's next turn: its prefix grew. Only the new blocks take a reference.
            tail = blocks[k:]
            self.store.reference(tail, +1, s.expected, s.tenant)
            for m in tail:
                held[m.key] = m
            return
        old = list(itertools.islice(held.values(), k, None))
        new = {m.key: m for m in blocks[k:]}
        dropped = [m for m in old if new.get(m.key) is not m]
        taken = [m for m in new.values() if held.get(m.key) is not m]
        self._let_go(s, dropped)
        self.store.reference(taken, +1, s.expected, s.tenant)
        for m in old:
            del held[m.key]
        held.update(new)

    def _hand_back(self, s: Session, dropped: Sequence[BlockMeta]) -> None:
        """Blocks the session let go of that its parent still holds point at the parent's hint again (a
        sub-agent that forked its parent's history ends: the history is the parent's, due back when it said)."""
        parent = self._sessions.get(s.parent_key) if s.parent_key else None
        if parent is None:
            return
        held, hint = parent.held, parent.expected
        for m in dropped:
            if m.holder is None and m.refs and held.get(m.key) is m:
                m.holder = hint

    def expect_back(self, s: Session, wait_ms: float) -> None:
        """The session's client expects its next request in `wait_ms` (an agent's tool call, by the tool's
        usual duration; a long wait for a user); 0: it does not say (a hint given before no longer holds).
        Eviction's hint order (engram/eviction.py) gives up the blocks of sessions due back last first."""
        self._hint(s, limits.check_expect_back_ms(wait_ms))
        self._touch(s)

    def _hint(self, s: Session, wait_ms: float) -> None:
        """`expect_back` of a checked wait."""
        e = s.expected
        if not wait_ms:
            e.due = e.wait = 0.0
            return
        model = self.store.placement.model
        e.due, e.wait = model.clock_ms() + wait_ms, float(wait_ms)
        model.hint_seen()
        if self.prefetch_lead_ms:
            heapq.heappush(self._due, (e.due - self.prefetch_lead_ms, next(self._seq), s, e.due))
            if len(self._due) > 2 * len(self._sessions) + 1024:  # hints said again or sessions closed: stale
                self._due = [d for d in self._due if self._current(d[2], d[3])]  # one per live session at most
                heapq.heapify(self._due)

    def _current(self, s: Session, due: float) -> bool:
        """Whether a prefetch planned for `due` still stands: the session is open and has not re-hinted."""
        return self._sessions.get(s.key) is s and s.expected.due == due

    async def prefetch_due(self) -> int:
        """Sessions due back within prefetch_lead_ms (by their clients' word) get their blocks below the top
        tier copied up now, head first, so the turn is served from memory (as KVFlow prefetches for the agents
        about to run); a session closed or re-hinted since is skipped. Returns the blocks copied up."""
        due = self._due
        now = self.store.placement.model.clock_ms()
        copied = 0
        while due and due[0][0] <= now:
            _, _, s, when = heapq.heappop(due)
            if self._current(s, when):
                copied += await self.store.prefetch(list(s.held.values()))
        return copied

    async def run_prefetch(self, period_s: float = 0.05) -> None:
        """The daemon's prefetcher: `prefetch_due` every period, until cancelled."""
        while True:
            try:
                await self.prefetch_due()
            except Exception:
                log.exception("prefetch failed")
            await asyncio.sleep(period_s)

    def get(self, namespace: str, session_id: str, tenant: str = "", owner: str = "") -> Session:
        """The session, for a call of `tenant` ("": an admin's, any with tenancy off, the daemon's own): a tenant's
        own of that id; another namespace's session, and another tenant's in a namespace they share, are reported
        exactly like an absent one (ids are per owner, `SessionKey`). An admin names any owner's: `owner` when
        given ("" alone cannot say "the admins'": an admin's own id of that name is found first anyway), else its
        own (owner "") if it holds the id, else the one tenant's that does; two tenants' of that id are ambiguous,
        FAILED_PRECONDITION naming them, so an admin never acts on a session it did not mean."""
        if tenant:
            key: SessionKey = (namespace, tenant, session_id)
        elif owner:
            key = (namespace, owner, session_id)
        else:
            owners = self._owners.get((namespace, session_id), ())
            if "" in owners or not owners:
                key = (namespace, "", session_id)
            elif len(owners) == 1:
                key = (namespace, owners[0], session_id)
            else:
                raise FailedPrecondition(
                    f"tenants {', '.join(sorted(owners))} each hold a session {session_id!r} in namespace "
                    f"{namespace!r} (ids are per tenant): name the one you mean by its owner (SessionRef.owner)")
        s = self._sessions.get(key)
        if s is None:
            closed = self._closed_idle.get(key)
            if closed is not None:
                raise NotFound(f"session {session_id!r} was closed after {closed:.0f} s without a call "
                               "(server.session_idle_s); open a new one (its blocks are still stored)")
            raise NotFound(f"no session {session_id!r} in this namespace")
        return s

    def sessions_of(self, tenant: str) -> list[Session]:
        """The sessions a call of `tenant` may see: its own ("": every one)."""
        return [s for s in self._sessions.values() if s.seen_by(tenant)]

    def _touch(self, s: Session) -> None:
        """A call on the session: it is not idle. Sessions stay in order of their last call, so `close_idle`
        looks at the idle ones only."""
        s.active_ms = self.store.placement.model.clock_ms()
        key = s.key
        self._sessions[key] = self._sessions.pop(key)

    def close_idle(self) -> list[Session]:
        """Close every session no call has touched for idle_close_s (an agent that crashed or was abandoned
        never closes its own): its blocks' references go, as at CloseSession. A session whose client said it
        is back later (expect_back_ms) is kept until idle_close_s after that time. Each is an INFO line within a
        budget (engram/logbudget.py), the rest of a pass one line that counts them: 4,000 sessions abandoned at once
        were 4,000 lines (an audit, session 45)."""
        if not self.idle_close_s:
            return []
        limit = self.idle_close_s * 1000.0
        now = self.store.placement.model.clock_ms()
        closed = []
        for key, s in list(self._sessions.items()):  # least recently active first
            if now - s.active_ms <= limit:
                break
            if s.expected.due and now - s.expected.due <= limit:
                continue  # said it is back later: not abandoned yet
            try:
                self.end(s)
            except Exception:  # one session's failure must not stop the closer for every other namespace
                log.exception("closing idle session %r of namespace %r failed", s.id, s.namespace)
                continue
            self._closed_idle[key] = (now - s.active_ms) / 1000.0
            while len(self._closed_idle) > 4096:
                self._closed_idle.popitem(last=False)
            closed.append(s)
            if self._idle_said.take() is not None:  # the rest of the pass: counted, in one line below
                log.info("closed session %r of namespace %r: no call for %.0f s (server.session_idle_s)", s.id,
                         s.namespace, (now - s.active_ms) / 1000.0)
        if self._idle_said.held:  # one line for the rest, each pass, however many were abandoned at once
            log.info("closed %d more sessions with no call for %g s (server.session_idle_s), not named one by one "
                     "(%d a minute are)", self._idle_said.held, self.idle_close_s, self._idle_said.lines)
            self._idle_said.held = 0
        self.closed_idle += len(closed)
        return closed

    async def run_idle_close(self, period_s: float | None = None) -> None:
        """The daemon's closer: `close_idle` every period (a tenth of idle_close_s, within 50 ms..60 s), until
        cancelled."""
        period = period_s if period_s is not None else min(60.0, max(0.05, self.idle_close_s / 10))
        while True:
            try:
                self.close_idle()
            except Exception:
                log.exception("closing idle sessions failed")
            await asyncio.sleep(period)

    def append(self, namespace: str, session_id: str, tokens: np.ndarray, window: Window | None = None,
               expect_back_ms: float = 0.0, *, tenant: str = "", owner: str = "", hold: bool = True) -> Session:
        """A turn: the session's tokens grow (and, in persist mode, its window is replaced, counted against
        `tenant`'s share). expect_back_ms: when the client expects the session's next turn (`expect_back`);
        each turn says it again, or the hint lapses. hold=False: the caller holds its prefix's blocks next
        (`hold_in_slices`)."""
        s = self.get(namespace, session_id, tenant, owner)
        limits.check_expect_back_ms(expect_back_ms)  # before anything of the session changes
        self._touch(s)
        if window is not None and s.mode != SessionMode.PERSIST:
            raise InvalidArgument(f"session {session_id} is in {s.mode.value} mode: the daemon rebuilds its "
                                  "window; send windows only for persist-mode sessions")
        new_len = len(s.tokens) + len(tokens)
        self.check_length(new_len)
        if window is not None:
            if window.prefix_len != new_len:
                raise InvalidArgument(f"the window serves position {window.prefix_len}, the session will have "
                                      f"{new_len} tokens")
            window.validate(self.store.spec(s.fingerprint))
        added, was = np.asarray(tokens, dtype=np.int32), self.live_tokens.tenant_of(s.tokens)
        # Counted (or refused) before the session changes, to `tenant`, whose call makes the new array; an append of
        # no tokens (a keep-alive) keeps the array it has
        grown = s.tokens if not added.size else self.live_tokens.take(
            np.concatenate([s.tokens, added]), s.namespace, tenant, "these tokens", replacing=s.tokens)
        if window is not None:
            try:
                self._keep_window(s, window, tenant)  # likewise
            except BaseException:
                if grown is not s.tokens:  # the tokens before are counted again as they were (this frees more
                    # than it takes, so cannot fail)
                    s.tokens = self.live_tokens.take(s.tokens, s.namespace, was, "these tokens", replacing=grown)
                raise
        s.tokens = grown
        if hold:
            self.hold(s)
        if window is None and s.mode != SessionMode.PERSIST:
            self._drop_hot(s)  # a window for the old length is stale
            if s.kept:
                self._release_window(s)
        self._hint(s, expect_back_ms)  # checked above
        return s

    def set_tokens(self, s: Session, tokens: np.ndarray) -> None:
        """Replace the session's whole context (the trace replayer's way to a next turn), counted as an append
        is, to the session's opener; the caller re-resolves its blocks (`hold`)."""
        s.tokens = self.live_tokens.take(tokens, s.namespace, s.tenant, "these tokens", replacing=s.tokens)

    def fork(self, namespace: str, parent_id: str, session_id: str = "", position: int = 0, *, tenant: str = "",
             owner: str = "", hold: bool = True) -> Session:
        """A sub-agent starting from its parent's prefix: tokens are copied, blocks are shared by content. The
        child is `tenant`'s (the forking token's), as if it had opened it. hold=False: the caller holds its
        prefix's blocks next (`hold_in_slices`)."""
        parent = self.get(namespace, parent_id, tenant, owner)
        self._touch(parent)
        p = position or len(parent.tokens)
        if p > len(parent.tokens):
            raise InvalidArgument(f"fork position {p} is past the parent's {len(parent.tokens)} tokens")
        child = self.open(namespace, parent.fingerprint, parent.mode, parent.approx_k, session_id, parent.tokens[:p],
                          tenant=tenant, hold=hold)
        child.parent, child.parent_key = parent.id, parent.key
        if parent.window is not None and parent.window.prefix_len == p:
            if child.mode == SessionMode.PERSIST:
                try:
                    self._keep_window(child, parent.window, tenant)  # the child holds it too: counted once more
                except ResourceExhausted:
                    self.end(child)
                    raise
            else:
                child.window, child.window_tenant = parent.window, tenant
                self._mark_hot(child)
        return child

    def suspend(self, namespace: str, session_id: str, *, tenant: str = "", owner: str = "") -> Session:
        """The session goes cold: a rebuilt window is dropped (auto mode: or kept within `tenant`'s share, as
        its cost model decides); a persisted one stays."""
        s = self.get(namespace, session_id, tenant, owner)
        self._touch(s)
        if s.mode != SessionMode.PERSIST:
            self._cool(s, tenant)
        return s

    def close(self, namespace: str, session_id: str, *, tenant: str = "", owner: str = "") -> Session:
        """CloseSession: the session `get` finds for the caller ends (`end`)."""
        return self.end(self.get(namespace, session_id, tenant, owner))

    def is_open(self, s: Session) -> bool:
        """Whether `s` is still a live session (not closed, by its client or idle)."""
        return self._sessions.get(s.key) is s

    def end(self, s: Session) -> Session:
        """The session ends: its window goes, its blocks lose its references, its tokens are given back."""
        self._let_go(s, self._ending(s))
        return s

    def _let_go(self, s: Session, blocks: Sequence[BlockMeta]) -> None:
        """The session's references on `blocks` go (each block once, even past one whose count fails:
        BlockStore.reference), and those its parent holds point at the parent's hint again."""
        try:
            self.store.reference(blocks, -1, s.expected, s.tenant)
        finally:
            self._hand_back(s, blocks)

    async def close_in_slices(self, namespace: str, session_id: str, *, tenant: str = "", owner: str = "") -> Session:
        """`close`, whose references are dropped `SLICE_BLOCKS` at a time with a turn of the event loop between
        slices, in `tenant`'s turn (`hold_in_slices`): the session is gone at once, its blocks unreferenced soon
        after (at once if the close is cut)."""
        s = self.get(namespace, session_id, tenant, owner)
        dropped = self._ending(s)
        done = 0
        try:
            async with self.turn(s, len(dropped) * self.store.spec(s.fingerprint).layout.block_tokens, tenant):
                for start in range(0, len(dropped), SLICE_BLOCKS):
                    if start:
                        await pause()
                    part = dropped[start : start + SLICE_BLOCKS]
                    # Done once begun: `_let_go` changes every block of it once, even one it raises for, so the
                    # cleanup below goes on from the next slice (it let go of this one again: a block dropped twice
                    # lost another session's reference, or raised and kept the rest referenced for good)
                    done = start + len(part)
                    self._let_go(s, part)
        finally:  # a close cut (its deadline, its client gone) drops the rest in one go: the session is gone
            if done < len(dropped):  # (they stayed referenced for good: a review, session 49)
                self._let_go(s, dropped[done:])
        return s

    def _ending(self, s: Session) -> list[BlockMeta]:
        """`end` but for the references: the blocks the session held, which the caller lets go of."""
        self._drop_hot(s)
        if s.kept:
            self._release_window(s)
        self._stop_awaiting(s)
        dropped = list(s.held.values())
        s.held = {}
        self.live_tokens.give_back(s.tokens)
        del self._sessions[s.key]
        namespace = s.namespace
        self._per_namespace[namespace] -= 1
        if not self._per_namespace[namespace]:
            del self._per_namespace[namespace]
        self._per_owner[namespace, s.tenant] -= 1
        if not self._per_owner[namespace, s.tenant]:
            del self._per_owner[namespace, s.tenant]
        owners = self._owners[namespace, s.id]
        owners.remove(s.tenant)
        if not owners:
            del self._owners[namespace, s.id]
        return dropped

    def check_length(self, n: int) -> None:
        """A session's length bound, server.max_tokens_per_request (the same number as a request's): a request past
        it is answered as a session past it, INVALID_ARGUMENT naming the bound (an OpenSession past it was
        RESOURCE_EXHAUSTED 'split the request', and the split's Append this, an audit of session 47)."""
        if n > self.max_session_tokens:
            raise InvalidArgument(f"a session may hold at most {self.max_session_tokens} tokens "
                                  f"(server.max_tokens_per_request), this one would hold {n}; keep sessions within it "
                                  "(open a new one for what follows) or raise the setting")

    def _keep_window(self, s: Session, window: Window, tenant: str) -> None:
        """Make `window` the persisted window of `s`, counting its bytes against the daemon's budget for
        persisted windows, `tenant`'s share of it (the caller that keeps it: in a namespace tenants share, one
        tenant's windows on another's sessions counted against the opener's share) and its namespace's quota
        (the previous window's bytes are given back, to the share they counted against)."""
        old = s.window.nbytes if s.window is not None and s.kept else 0  # a hot window is not counted
        delta = window.nbytes - old
        share = self.max_persisted_window_bytes_per_tenant
        mine = old if s.window_tenant == tenant else 0  # what the share gets back: the window replaced, if its own
        if tenant and share and self._persisted_of[tenant] + window.nbytes - mine > share:
            # One tenant filled the daemon's budget and every other's windows were refused (or dropped: auto).
            # Not how much it holds (nor what others' windows on the same sessions hold): what to change only.
            raise ResourceExhausted(
                f"this window of {window.nbytes} bytes does not fit your token's share of persisted windows "
                "(replay.max_persisted_window_bytes_per_tenant); close persist-mode sessions whose windows you "
                "sent, or open sessions in exact mode (the daemon rebuilds their windows)")
        if self._persisted_bytes + delta > self.max_persisted_window_bytes:
            # Every tenant's windows count here: the message does not say how much they hold (a tenant just
            # under the budget read the others' total from it, an audit).
            raise ResourceExhausted(
                f"this window of {delta} bytes does not fit the daemon's budget for persisted windows "
                "(replay.max_persisted_window_bytes); close persist-mode sessions, or open sessions in exact mode "
                "(the daemon rebuilds their windows)")
        if delta > 0:
            self.store.hold(s.namespace, delta, "this persisted window")
        elif delta < 0:
            self.store.release_held(s.namespace, -delta)
        self._persisted_bytes += delta
        if old and s.window_tenant:
            self._count_window(s.window_tenant, -old)
        if tenant:
            self._count_window(tenant, window.nbytes)
        s.window, s.window_tenant = window, tenant
        s.kept = True

    def _release_window(self, s: Session) -> None:
        assert s.window is not None and s.kept
        self.store.release_held(s.namespace, s.window.nbytes)
        self._persisted_bytes -= s.window.nbytes
        if s.window_tenant:
            self._count_window(s.window_tenant, -s.window.nbytes)  # the share it counted against
        s.window, s.window_tenant = None, ""
        s.kept = False

    def _count_window(self, tenant: str, delta: int) -> None:
        n = self._persisted_of[tenant] + delta
        if n:
            self._persisted_of[tenant] = n
        else:
            del self._persisted_of[tenant]  # none left: the table holds only tenants with windows

    # ---- resume ---------------------------------------------------------------------------------

    async def resume(self, namespace: str, session_id: str, position: int = 0, *, tenant: str = "", owner: str = "",
                     stage: ResumeStage | None = None) -> Resumed:
        """The window for a query at `position`, and the blocks of [0, position), leased (`store.acquire`) from the
        lookup that finds them: the caller releases them (`store.release(r.blocks)`) once the answer naming them is
        built, or the global KV it sends from them (`global_kv_blocks`) is sent. Leased only while a replay ran (and
        not at all for a hot window), a put's eviction between this return and the caller's lease left a block with
        no copy in the answer: INTERNAL (an audit, session 47). A replay waits for its turn within `tenant`'s share
        of the queue (`_take_turn`). `stage` is kept telling what it is doing."""
        stage = stage or ResumeStage()
        s = self.get(namespace, session_id, tenant, owner)
        self._touch(s)
        p = position or len(s.tokens)
        if p <= 0:
            raise InvalidArgument(f"session {session_id} has no tokens to resume from; append some first")
        if p > len(s.tokens):
            raise InvalidArgument(f"position {p} is past the session's end ({len(s.tokens)} tokens)")
        whole = s.tokens
        tokens = whole[:p]
        async with self.turn(s, p, tenant):  # walked a slice at a time (`hold_in_slices`)
            walk = self.store.walk(namespace, s.fingerprint, tokens)
            try:
                await self.store.lookup_walk(walk)
                blocks, matched = tuple(walk.found()), walk.matched_tokens()  # none removed since: each has its copies
            finally:
                walk.close()
            # At the session's end (its tokens still those walked: an Append makes a new array), the walk is the
            # hold's too: the session's references are taken from it in this turn, where the hold walked the same
            # prefix again (both in slices) once the lookup was counted
            at_end = s.tokens is whole and p == len(whole)
            # Used before leased (a lease restarts a block's age: a use after it counted no comeback), in one go
            # with no await since the walk: every block still has its copies when it is leased
            self.store.placement.use_all(blocks)
            if matched == p:
                self.store.acquire(blocks)
            try:
                await self.store.count_lookup(p, blocks, matched, use=False)
                if at_end:  # no await since the walk (count_lookup's of a probe has none)
                    await self.hold_in_slices(s, tenant, (blocks, matched))
            except BaseException:
                if matched == p:
                    self.store.release(blocks)
                raise
        if matched < p:
            if not at_end:
                await self.hold_in_slices(s, tenant)
            raise FailedPrecondition(
                f"the global KV of positions [{matched}, {p}) is not stored (never put, or evicted); "
                "put it again, then Resume"
            )
        try:
            if not at_end:
                await self.hold_in_slices(s, tenant)
            return await self._resume_leased(s, p, blocks, tenant, stage)
        except BaseException:
            self.store.release(blocks)
            raise

    async def _resume_leased(self, s: Session, p: int, blocks: tuple[BlockMeta, ...], tenant: str,
                             stage: ResumeStage) -> Resumed:
        """`resume` past its lookup, with the prefix's `blocks` leased."""
        if self._sessions.get(s.key) is not s:  # closed (by its client, or idle) while the Resume waited for its turn
            # (answered OK, it marked the closed session hot, holding a hot slot: an audit, session 49)
            raise NotFound(f"session {s.id} was closed during its Resume")
        spec = self.store.spec(s.fingerprint)
        if s.window is not None and s.window.prefix_len == p:
            # The window answered is the one found now: while the global KV is sent, a Suspend, an Append,
            # another Resume or another session pushing this one out of the hot set may replace or drop s.window.
            window, source = s.window, "persisted" if s.kept else "hot"
            if not s.kept:
                self._mark_hot(s)
            return Resumed(p, blocks, window, source, 0, 0, 0.0)
        lay = spec.layout
        if holds_no_window(lay):
            # W = 1 or no sliding layer: the window has no row, so no replay model is needed, no turn is waited
            # for (behind replays that take seconds), no block is read and nothing runs; the caller's global KV
            # streams as it would. A persist-mode session's is not held: it keeps only what its worker uploads.
            window = Window.empty(lay, p)
            if s.mode != SessionMode.PERSIST:
                self._hold_window(s, window, tenant)
            return Resumed(p, blocks, window, "replay", 0, 0, 0.0)
        if s.mode == SessionMode.PERSIST:
            have = "none" if s.window is None else f"one for position {s.window.prefix_len}"
            raise FailedPrecondition(f"session {s.id} is in persist mode and holds no window for position {p} "
                                     f"({have}); append with the window, or open it in exact mode")
        model = self.runtime.require(spec)
        if s.kept:  # an auto-mode window kept for another position: replaced by this replay's
            self._release_window(s)
        mode = self._auto_replay_mode(s, spec, p) if s.mode == SessionMode.AUTO else s.replay_mode()
        # The blocks stay leased (`resume`) through the replay, which may take seconds: an eviction during it left
        # blocks with no copy in the answer (INTERNAL, found by benchmarks/soak.py).
        cooled = s.cooled
        await self._take_turn(tenant)  # before the read: a Resume refused for the queue reads and decodes nothing
        stage.name = "reading"
        try:
            global_kv = await self._global_kv(blocks, p)
        except BaseException:
            self._replay_turns.give_back()
            raise
        t0 = time.perf_counter()
        tokens = torch.as_tensor(s.tokens[:p], dtype=torch.long)
        stage.name = "replaying"
        rec = await self._replay(model, tokens, global_kv, mode)  # gives the turn back
        if self._sessions.get(s.key) is not s:  # closed (by its client, or idle) meanwhile
            raise NotFound(f"session {s.id} was closed during its Resume")
        seconds = time.perf_counter() - t0
        c = self.runtime.counters
        c.replays += 1
        c.replayed_tokens += rec.replayed
        c.token_layers += rec.token_layers
        c.seconds += seconds
        window = Window.from_swa(rec.window, lay.dtype, lay.num_kv_heads, lay.head_dim)
        if s.cooled == cooled:  # else it went cold while this replay ran (a Suspend): it stays so, the answer aside
            self._hold_window(s, window, tenant)
        return Resumed(p, blocks, window, "replay", rec.replayed, rec.token_layers, seconds)

    def _hold_window(self, s: Session, window: Window, tenant: str) -> None:
        """A Resume's window becomes the session's, hot (a window kept for another position: its bytes are given
        back first). With max_hot_windows = 0 it is dropped again at once: the answer still carries it."""
        if s.kept:
            self._release_window(s)
        s.window, s.window_tenant = window, tenant
        self._mark_hot(s)

    def shutdown(self) -> None:
        """The daemon stops: the replay threads end (a replay still running finishes first, in its thread)."""
        self._replay_threads.shutdown(wait=False, cancel_futures=True)

    async def _take_turn(self, tenant: str = "") -> None:
        """Wait for one of replay.max_concurrent turns: replays are seconds of CPU or GPU each, and one tenant's
        many Resumes (or cancelled ones, whose threads cannot be stopped) took the threads every decode and encode
        of the daemon runs on. ResourceExhausted past replay.max_queued waiting. Taken before the Resume reads its
        prefix: every refused Resume had read and decoded its whole global KV first, and any number of them
        decoded at once (an audit). A Resume cancelled while it waits never runs. A tenant's Resumes wait within
        a share of the queue (replay.max_queued_per_tenant): one tenant's burst filled it, and every other
        tenant's Resume was refused. Waiting Resumes get their turns round-robin between tenants (`FairTurns`):
        first come, first served, a tenant's single Resume waited behind another's whole share."""
        share = self.max_queued_replays_per_tenant
        turns = self._replay_turns
        if turns.busy():
            if tenant and share and (mine := turns.waiting_of(tenant)) >= share:
                raise ResourceExhausted(f"this token has {mine} Resumes waiting for a replay's turn, its share "
                                        "(replay.max_queued_per_tenant); retry later, or prefill the prefix instead")
            if turns.waiting >= self.max_queued_replays:
                raise ResourceExhausted(f"{turns.waiting} replays are waiting for a turn (replay.max_queued); "
                                        "retry later, or prefill the prefix instead")
        await turns.take(tenant)

    async def _replay(self, model: ReplayModel, tokens: torch.Tensor, global_kv: torch.Tensor, mode: ReplayMode
                      ) -> Reconstruction:
        """runtime.rebuild on a replay thread, in a turn the caller took (`_take_turn`), which this gives back. One
        cancelled while it runs keeps its turn until its thread is done, so no more than the bound ever run."""
        running = asyncio.get_running_loop().run_in_executor(self._replay_threads, self.runtime.rebuild, model,
                                                             tokens, global_kv, mode)
        try:
            rec = await asyncio.shield(running)
        except asyncio.CancelledError:
            running.add_done_callback(lambda _: self._replay_turns.give_back())
            raise
        except BaseException:
            self._replay_turns.give_back()
            raise
        self._replay_turns.give_back()
        return rec

    async def _global_kv(self, blocks: tuple[BlockMeta, ...], p: int) -> torch.Tensor:
        """The stored global KV of [0, p) as one tensor (stored_layers, 2, p, H, D), read and verified: what a
        replay reads, in its turn (which bounds how many are decoded at once). Each block is copied into place as
        it is decoded: the prefix and one block at once, not the blocks and their concatenation."""
        first = blocks[0]
        out = torch.empty((*first.shape[:2], p, *first.shape[3:]), dtype=first.dtype.torch_dtype)
        done = 0
        with self.store.reading(blocks):
            async for kv in self.global_kv_blocks(blocks, p):
                out[:, :, done : done + kv.shape[2]] = kv
                done += kv.shape[2]
        return out

    async def global_kv_blocks(self, blocks: Sequence[BlockMeta], p: int) -> AsyncIterator[torch.Tensor]:
        """The stored global KV of [0, p) block by block, (stored_layers, 2, tokens, H, D) each, every block read,
        verified and decoded only when the one before has been taken. A Resume sends each before decoding the
        next, so a client that stops reading holds the daemon to one block's decoded bytes: decoded whole, the
        prefix was held until the stream ended, outside any bound (an audit: 12 stalled Resumes of a 64 MiB
        prefix grew the daemon by 1.7 GB). The caller leases the blocks (`store.reading`)."""
        done = 0
        for meta in blocks:
            if done >= p:
                return
            payload = await self.store.read(meta)
            kv = await asyncio.to_thread(self.store.decode, payload, meta)
            del payload
            yield kv[:, :, : p - done]
            done += meta.num_tokens

    # ---- auto mode: the cost model decides ------------------------------------------------------------

    def _auto_replay_mode(self, s: Session, spec: ModelSpec, p: int) -> ReplayMode:
        """The fastest replay whose measured fidelity passes the floor (exact without a calibration)."""
        cm = self.cost_models.get(spec.weights_id)
        if cm is None:
            s.decision = "exact replay: no calibration for these weights on this machine (engram bench replay)"
            return ReplayMode.exact()
        try:
            choice = cm.choose(p, budget_bytes=0, floor=self.floor)  # a Resume has no window to keep
        except NoAllowedOption as exc:
            s.decision = f"exact replay: the calibration allows no option ({exc})"
            return ReplayMode.exact()
        s.decision = choice.reason
        return ReplayMode.approx(choice.approx_k) if choice.mode == SessionMode.APPROX else ReplayMode.exact()

    def _cool(self, s: Session, tenant: str | None = None) -> None:
        """The session goes cold (suspended, its blocks left memory, or pushed out of the hot set). A rebuilt
        window is dropped, unless the session is in auto mode and its cost model finds keeping it (loading
        it later) faster than any replay the fidelity floor allows, within the persisted-window budget and the
        share of `tenant` (the Suspend's caller), else of the tenant whose Resume rebuilt it."""
        s.cooled += 1
        if s.mode == SessionMode.AUTO and s.window is not None and not s.kept:
            cm = self.cost_models.get(self.store.spec(s.fingerprint).weights_id)
            if cm is not None:
                keeper = s.window_tenant if tenant is None else tenant
                budget = self.max_persisted_window_bytes - self._persisted_bytes
                if keeper and self.max_persisted_window_bytes_per_tenant:  # and what the keeper's share has left
                    budget = min(budget, self.max_persisted_window_bytes_per_tenant - self._persisted_of[keeper])
                try:
                    choice = cm.choose(s.window.prefix_len, budget_bytes=budget, floor=self.floor,
                                       tier=self.persist_tier, window_bytes=s.window.nbytes)
                except NoAllowedOption as exc:
                    choice = None
                    s.decision = f"dropped the window: the calibration allows no option ({exc})"
                if choice is not None:
                    s.decision = choice.reason
                if choice is not None and choice.mode == SessionMode.PERSIST:
                    self._hot.pop(s.key, None)
                    try:
                        self._keep_window(s, s.window, keeper)
                        return
                    except ResourceExhausted as exc:  # the namespace's quota, the tenant's share: replay it after all
                        s.decision = f"dropped the window: keeping it was chosen, but {exc}"
        self._drop_hot(s)

    # ---- hot windows ------------------------------------------------------------------------------

    def _mark_hot(self, s: Session) -> None:
        key = s.key
        self._hot[key] = None
        self._hot.move_to_end(key)
        while len(self._hot) > self.max_hot_windows:
            old = self._hot_victim()
            del self._hot[old]
            victim = self._sessions.get(old)
            if victim is not None:
                self._cool(victim)  # pushed out of the hot set: rebuilt on its next Resume (or kept: auto)

    def _hot_victim(self) -> SessionKey:
        """The window a full hot set lets go: the least recently used of the owner holding the most windows (ties:
        the least recent of theirs). One set of every tenant's, pushed out least recently used first, let one
        tenant's Resumes push out every other's windows (their next Resume replayed: seconds), and told a tenant
        from its own session going cold (ListSessions' hot, Resume's source) how many sessions the others resumed
        (a review, session 51). Now a tenant holding no more windows than max_hot_windows / (tenants + 1) never
        loses one to another's Resumes; beyond that share, its windows go before those of owners holding fewer.
        The admins (and every caller with tenancy off) are one owner, "". At most max_hot_windows + 1 keys looked
        at, on a Resume that fills the set (its replay took far longer)."""
        held = collections.Counter(owner for _, owner, _ in self._hot)
        most = max(held.values())
        return next(k for k in self._hot if held[k[1]] == most)

    def _block_went_cold(self, meta: BlockMeta) -> None:
        """A block left the memory tiers: every hot session whose prefix holds it is cold now, and its rebuilt
        window goes (a window beside blocks that load from NVMe saves little, and holds memory the hot sessions
        need). Persisted windows stay: nothing could rebuild them. At most max_hot_windows dictionary probes."""
        if not self._hot:
            return  # no session holds a rebuilt window (a replay's, or a daemon's without SWA models)
        for key in list(self._hot):
            s = self._sessions.get(key)
            if s is None:  # closed without leaving the hot set: nothing to cool
                self._hot.pop(key, None)
            elif meta.key in s.held:
                self._cool(s)
                self.windows_dropped_cold += not s.kept

    def _drop_hot(self, s: Session) -> None:
        self._hot.pop(s.key, None)
        if not s.kept:
            s.window, s.window_tenant = None, ""

    # ---- stats -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def models_in_use(self) -> set[tuple[str, bytes]]:
        """(namespace, model) of every live session: a session reads its model's layout at each call, so the model
        may not be forgotten (engram/server/modelroom.py)."""
        return {(s.namespace, s.fingerprint) for s in self._sessions.values()}

    def count_in(self, namespace: str, owner: str | None = None) -> int:
        """Live sessions of the namespace, every owner's (None) or one owner's: a tenant's Stats counts its own,
        in a namespace tenants share it counted every tenant's."""
        if owner is None:
            return self._per_namespace[namespace]  # a scan of every session per namespace made Stats quadratic
        return self._per_owner[namespace, owner]

    def count(self, namespaces: list[str] | None = None, owner: str | None = None) -> int:
        """Live sessions, of some namespaces only (a tenant's Stats: `owner`'s own there) or of all."""
        if namespaces is None:
            return len(self._sessions)
        return sum(self.count_in(ns, owner) for ns in namespaces)

    def hot_count(self, namespaces: list[str] | None = None, owner: str | None = None) -> int:
        if namespaces is None:
            return len(self._hot)
        return sum(1 for ns, who, _ in self._hot if ns in namespaces and (owner is None or who == owner))

    def window_bytes(self, *, persisted: bool, namespaces: list[str] | None = None, owner: str | None = None) -> int:
        return sum(s.window.nbytes for s in self._sessions.values()
                   if s.window is not None and s.kept == persisted
                   and (namespaces is None or s.namespace in namespaces) and (owner is None or s.tenant == owner))
