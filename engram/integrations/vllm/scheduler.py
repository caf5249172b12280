"""The scheduler side of the vLLM connector: how much of a prompt Engram holds, and what the workers load and
save each step.

vLLM's scheduler asks, for a waiting request, how many tokens beyond its own prefix-cache hit an external cache
can supply (`get_num_new_matched_tokens`); it then allocates blocks and tells the connector
(`update_state_after_alloc`); once per step it asks for the metadata its workers get (`build_connector_meta`).
Here that is one Lookup per ask, counted in whole vLLM blocks and never the whole prompt (vLLM computes at least
the last token, for its logits); a load per request that takes a hit; and a save per request in the step its
prompt's last token is computed (the prompt's KV only: generated tokens are not stored).

A request may name the agent session it belongs to in its `kv_transfer_params` (`engram_session_id`, and
`engram_expect_back_ms`: when the agent's next request is expected, where its harness knows it when sending:
a user's turn next). When it finishes, the session on the daemon is made to hold the request's prompt (opened,
appended to, or reset when the prompt no longer extends it: engram/integrations/sessions.py), so its blocks are
held by a live session and carry its hint in eviction's order; a harness that learns the wait later (from the
tool the response calls) sends it itself: AppendSession(session, no tokens, expect_back_ms). A failed session
call logs a warning and changes nothing for the request.

The arguments are vLLM's objects, read by attribute (request.request_id, request.prompt_token_ids,
blocks.get_block_ids(), the SchedulerOutput's scheduled requests), so tests drive this class with the same
shapes without vLLM installed. Requests whose KV depends on more than their tokens (multimodal inputs, a LoRA
adapter, a cache salt) are neither looked up nor saved: Engram keys blocks by tokens alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from engram.api import BlockRef
from engram.errors import EngramError
from engram.integrations.registration import Registration
from engram.integrations.sessions import SessionLink

log = logging.getLogger("engram.integrations.vllm")


@dataclass(frozen=True)
class LoadSpec:
    """Load tokens [first_token, len(token_ids)) of a prompt's cached prefix into its vLLM blocks."""

    req_id: str
    token_ids: list[int]  # the prompt up to the end of the load: what the worker asks the daemon for
    first_token: int  # vLLM computed the tokens before it (its own prefix cache): left alone
    block_ids: list[int]  # the request's vLLM blocks covering token_ids


@dataclass(frozen=True)
class SaveSpec:
    """Store a prompt's KV, read out of its vLLM blocks after the step's forward."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]  # covering token_ids


@dataclass
class EngramMetadata:
    """What the scheduler tells the workers for one step (pickled to their processes)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Hit:
    local: int  # vLLM's own prefix-cache hit, in tokens, when Engram was asked
    matched: int  # tokens Engram holds
    blocks: tuple[BlockRef, ...]


@dataclass
class _Running:
    prompt: list[int]
    block_ids: list[int]
    computed: int  # tokens computed before this step
    stored: int  # tokens Engram held when the request was admitted
    saved: bool = False


SESSION_ID = "engram_session_id"  # kv_transfer_params: the agent session a request belongs to
EXPECT_BACK_MS = "engram_expect_back_ms"  # kv_transfer_params: when that session's next request is expected


def session_of(request: Any) -> tuple[str, Any] | None:
    """The (session id, expect_back_ms as sent) a request's kv_transfer_params name, or None."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or not params.get(SESSION_ID):
        return None
    return str(params[SESSION_ID]), params.get(EXPECT_BACK_MS) or 0


def keyed_by_tokens_alone(request: Any) -> bool:
    """Whether a request's KV is a function of its token ids (what Engram's block keys cover)."""
    return not (getattr(request, "mm_features", None) or getattr(request, "lora_request", None)
                or getattr(request, "cache_salt", None) or getattr(request, "prompt_token_ids", None) is None)


def _resumed(cached: Any) -> set[str]:
    """The cached requests of a step that resume after a preemption: vLLM names them in `resumed_req_ids`
    (0.11 on), or flags them in `resumed_from_preemption` (before); either way their new_block_ids are all
    their blocks, not blocks added to those they had."""
    ids = getattr(cached, "resumed_req_ids", None)
    if ids:
        return set(ids)
    flags = getattr(cached, "resumed_from_preemption", None) or ()
    return {req_id for req_id, flag in zip(cached.req_ids, flags, strict=False) if flag}


class EngramScheduler:
    """Scheduler-side state: one instance in vLLM's scheduler process."""

    def __init__(self, model: Registration, block_size: int, *, namespace: str | None = None) -> None:
        """model: the model, registered through a SyncEngramClient (registered again if the daemon forgets it);
        block_size: vLLM's (tokens per block id)."""
        self.model = model
        self.client = model.client
        self.block_size = block_size
        self.namespace = namespace
        self._hits: dict[str, _Hit] = {}  # the last lookup of each waiting request
        self._loads: dict[str, LoadSpec] = {}  # for the next step's metadata
        self._running: dict[str, _Running] = {}
        self.sessions = SessionLink(model, namespace=namespace, hint_name=EXPECT_BACK_MS)
        self.lookup_failures = 0

    @property
    def fingerprint(self) -> bytes:
        return self.model.fingerprint

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens Engram can supply beyond vLLM's own num_computed_tokens: whole vLLM blocks of the cached prefix,
        at most all of the prompt but its last token. Loads are synchronous (False): done before the forward."""
        req_id = request.request_id
        self._hits.pop(req_id, None)  # no entry: neither loaded nor saved (build_meta)
        if not keyed_by_tokens_alone(request):
            return 0, False
        prompt = list(request.prompt_token_ids)
        try:
            # A probe: vLLM asks again each step a request waits; the worker's load (GetPrefix) is the one use.
            res = self.model.call(lambda fp: self.client.lookup(fp, prompt, namespace=self.namespace, probe=True))
        except EngramError as exc:  # the daemon is down or refuses: the request runs as a miss
            self.lookup_failures += 1
            log.warning("Engram lookup for request %r failed, computing it in full: %s", req_id, exc)
            self._hits[req_id] = _Hit(num_computed_tokens, 0, ())
            return 0, False
        usable = min(res.matched_tokens, len(prompt) - 1)
        usable -= usable % self.block_size
        self._hits[req_id] = _Hit(num_computed_tokens, res.matched_tokens, res.blocks)
        return max(0, usable - num_computed_tokens), False

    def hit_tiers(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """The external tokens by the Engram tier holding them now (hbm, dram, nvme, or remote)."""
        hit = self._hits.get(request.request_id)
        out: dict[str, int] = {}
        if hit is None or num_external_tokens <= 0:
            return out
        start, end, pos = hit.local, hit.local + num_external_tokens, 0
        for b in hit.blocks:
            n = max(0, min(end, pos + b.num_tokens) - max(start, pos))
            if n:
                out[b.tier] = out.get(b.tier, 0) + n
            pos += b.num_tokens
        return out

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: with external tokens, plan their load for the next step."""
        req_id = request.request_id
        if num_external_tokens <= 0:
            return
        hit = self._hits.get(req_id)
        if hit is None:
            raise RuntimeError(f"vLLM allocated {num_external_tokens} external tokens for request {req_id}, which "
                               "Engram was not asked about (get_num_new_matched_tokens)")
        end = hit.local + num_external_tokens
        block_ids = list(blocks.get_block_ids()[0])
        n_blocks = end // self.block_size
        if len(block_ids) < n_blocks:
            raise RuntimeError(f"request {req_id} has {len(block_ids)} blocks allocated, {n_blocks} hold its hit")
        prompt = list(request.prompt_token_ids)
        self._loads[req_id] = LoadSpec(req_id, prompt[:end], hit.local, block_ids[:n_blocks])

    def build_meta(self, scheduler_output: Any) -> EngramMetadata:
        """This step's loads (planned since the last step) and saves (prompts whose last token this step
        computes and Engram does not hold whole yet)."""
        meta = EngramMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        for new in scheduler_output.scheduled_new_reqs:  # new, or resumed after preemption: sent in full
            hit = self._hits.pop(new.req_id, None)
            if hit is None:  # keyed by more than its tokens (NewRequestData does not say: the Request did)
                continue
            self._running[new.req_id] = _Running(list(new.prompt_token_ids), list(new.block_ids[0]),
                                                 new.num_computed_tokens, hit.matched)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = _resumed(cached)
        for i, req_id in enumerate(cached.req_ids):
            r = self._running.get(req_id)
            if r is None:
                continue
            if req_id in resumed:  # after a preemption: its blocks were freed, and the list is sent whole
                r.block_ids = list(cached.new_block_ids[i][0]) if cached.new_block_ids[i] is not None else []
                hit = self._hits.pop(req_id, None)
                if hit is not None:
                    r.stored = hit.matched
            elif cached.new_block_ids[i] is not None:
                r.block_ids += cached.new_block_ids[i][0]
            r.computed = cached.num_computed_tokens[i]
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            r = self._running.get(req_id)
            if r is None or r.saved or r.computed + n < len(r.prompt):
                continue
            r.saved = True
            if r.stored < len(r.prompt):
                covering = -(-len(r.prompt) // self.block_size)
                meta.saves.append(SaveSpec(req_id, r.prompt, r.block_ids[:covering]))
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Saves are done within their step, so vLLM may free the blocks now. A request of an agent session
        (kv_transfer_params) has its session hold its prompt's blocks now that they are stored."""
        self._forget(request.request_id)
        session = session_of(request)
        if session is not None and keyed_by_tokens_alone(request):
            self.sessions.join(session[0], request.prompt_token_ids, session[1])
        return False, None

    def _forget(self, req_id: str) -> None:
        self._hits.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._running.pop(req_id, None)
