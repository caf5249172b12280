"""Engram as a Hugging Face transformers causal LM's prefix cache, through the model's own cache object.

    from engram.client import SyncEngramClient
    from engram.integrations.transformers import EngramPrefixCache, generate

    cache = EngramPrefixCache(model, SyncEngramClient("unix:/run/engram.sock"), codec="raw")
    out = generate(model, input_ids, cache, max_new_tokens=64)      # was: model.generate(input_ids, ...)

Before a request, the longest cached prefix of its tokens is loaded straight into the tensors of a
`DynamicCache` (the client's hit path: descriptors, DMA into the GPU, FP4 decoded there) and the model
prefills only the rest; after it, the KV of the whole sequence is stored (the blocks not cached yet, written
into the daemon's pool in place). Only the model's global layers are stored per block (engram/layout.py); for
a hybrid model (gpt-oss, Gemma 3: sliding-window layers beside global ones) the sliding layers' window for the
cached prefix is rebuilt here by exact bounded replay (engram/replay: the last L_swa * (W - 1) tokens re-run
through this model, reading the loaded global KV), so a prefix another session stored serves this one too.
A daemon that fails a load or a store (down, or refusing) costs no answer: the load runs as a miss and the store
is skipped, each logged and counted (`load_failures`, `store_failures`), as in the vLLM connector. A daemon
not up yet when the cache is built is no error either: the model is registered with the first call it answers;
and one that restarted without a model registry (DRAM only) has it registered again by the first call it refuses
for not knowing it, called once more (the client does so: engram/reregister.py).

The model's identity in its fingerprint: `weights_id` when given (a checkpoint revision or hash) with a hash of
the config (the same checkpoint run with another RoPE theta or scaling is another model; the vLLM connector
joins the two the same way); otherwise a hash of the config and of every parameter's shape, dtype and first
4096 values, computed once here: a weights change that keeps all of those is not seen (pass weights_id to be
sure).

MLA models (DeepSeek-V2/V3: `kv_lora_rank` in the config): transformers' DeepseekV3 cache keeps, per layer, the
compressed latent, not per-head K/V: its DynamicLayer's keys are the normalized latent c (1, 1, T,
kv_lora_rank) and its values the RoPE key k_pe (1, 1, T, qk_rope_head_dim), which attention decompresses on every
step. That is what is stored: one "latent" stream of kv_lora_rank + qk_rope_head_dim per token and layer (a
stream layout, engram/layout.py; 576 numbers a token and layer for DeepSeek-V3 itself), loaded into one buffer
whose per-layer slices are the cache's keys and values.

What it does not do: batches of more than one sequence, attention kinds other than full and sliding (chunked,
linear), models whose every layer slides (Mistral v0.1, Phi-3, Starcoder2 with a sliding_window: no global KV to
store), MLA models with sliding layers, and the indexer keys of DeepSeek-V3.2 (transformers has no such cache).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import Tensor

from engram.destinations import ContiguousKV, KVDestination, StreamsKV
from engram.errors import EngramError, InvalidArgument, Unavailable
from engram.integrations.identity import config_hash, with_config
from engram.integrations.registration import Registration
from engram.integrations.sessions import SessionLink
from engram.layout import Axis, DType, KVLayout, LayerKind, LayerSpec, ModelSpec, StreamSpec
from engram.replay.hf import cache_kwarg

log = logging.getLogger("engram.integrations")

_KINDS = {"full_attention": LayerKind.GLOBAL, "sliding_attention": LayerKind.SLIDING}


def _text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def mla_widths(model: Any) -> tuple[int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim) of an MLA model (what its cache's keys and values hold), else None."""
    cfg = _text_config(model)
    rank = getattr(cfg, "kv_lora_rank", None)
    return (int(rank), int(cfg.qk_rope_head_dim)) if rank else None


def layout_of(model: Any, *, block_tokens: int = 256) -> KVLayout:
    """The Engram layout of a transformers causal LM: its layer kinds (full -> global, sliding -> sliding with
    its window), KV heads, head dim and dtype; for an MLA model, one latent stream per global layer."""
    cfg = _text_config(model)
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or (["sliding_attention" if window else "full_attention"] * n)
    unknown = sorted(set(types) - set(_KINDS))
    if unknown:
        raise InvalidArgument(f"layer types {unknown} are not supported; Engram stores full and sliding attention")
    layers = tuple(LayerSpec(_KINDS[t], int(window or 0) if _KINDS[t] == LayerKind.SLIDING else 0) for t in types)
    if LayerKind.GLOBAL not in {layer.kind for layer in layers}:  # Mistral v0.1, Phi-3, Starcoder2 with a window
        why = ("its config's layer_types are all sliding_attention" if getattr(cfg, "layer_types", None) else
               f"its config's sliding_window={window}, with no layer_types, applies to all {n} layers")
        raise InvalidArgument(f"every layer of this {getattr(cfg, 'model_type', '') or type(model).__name__} model "
                              f"slides ({why}): it has no global (full-attention) KV to store per block, the only KV "
                              "Engram stores (sliding windows are rebuilt from it). Models with at least one "
                              "full_attention layer are supported, as is one whose config has no window "
                              "(sliding_window=None: every layer full attention)")
    dtype = DType.from_torch(next(model.parameters()).dtype)
    mla = mla_widths(model)
    if mla is not None:
        if any(layer.kind != LayerKind.GLOBAL for layer in layers):
            raise InvalidArgument("an MLA model with sliding layers is not supported: its sliding KV's shape is not "
                                  "in the config")
        return KVLayout(layers=layers, dtype=dtype, block_tokens=block_tokens,
                        streams=(StreamSpec("latent", (sum(mla),), dtype, "", Axis.TOKEN),))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVLayout(layers=layers, num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim, dtype=dtype,
                    block_tokens=block_tokens)


def weights_identity(model: Any) -> str:
    """A hash of the config (bookkeeping left out) and of each parameter's name, shape, dtype and first 4096
    values (see the module's docstring)."""
    h = config_hash(model.config.to_dict())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    return f"hf:{h.hexdigest()}"


class EngramPrefixCache:
    """A causal LM's prefix cache in an Engram daemon: `load` before a forward, `store` after it."""

    def __init__(self, model: Any, client: Any, *, namespace: str | None = None, codec: str = "",
                 block_tokens: int = 256, weights_id: str = "", name: str = "", gqa_attention: bool = True) -> None:
        """client: a SyncEngramClient. codec: the storage codec ("" = the daemon's default, nvfp4; "raw" keeps
        the KV bit for bit). gqa_attention: switch a model running transformers' "sdpa" attention to Engram's
        GQA-aware one (engram/integrations/hf_attention.py: the forward after a hit attends over the KV heads as
        loaded, no mask, no copy of the cache per layer)."""
        self.model = model
        self.client = client
        self.namespace = namespace
        self.layout = layout_of(model, block_tokens=block_tokens)
        cfg = _text_config(model)
        weights = with_config(weights_id, model.config.to_dict()) if weights_id else weights_identity(model)
        self.spec = ModelSpec(name or getattr(cfg, "model_type", "") or type(model).__name__, weights, self.layout,
                              codec)
        self.registration = Registration(client, self.spec)  # registered again if the daemon forgets it
        self.sessions = SessionLink(self.registration, namespace=namespace)
        try:
            self.registration.register()
        except Unavailable as exc:  # a worker may start before its daemon: registered by the first call it answers
            log.warning("Engram is not reachable yet; loads miss until it is: %s", exc)
        kinds = [layer.kind for layer in self.layout.layers]
        self.global_layers = [i for i, k in enumerate(kinds) if k == LayerKind.GLOBAL]
        self.sliding_layers = [i for i, k in enumerate(kinds) if k == LayerKind.SLIDING]
        self.mla = mla_widths(model)
        self._replay: Any = None
        self.last_loaded = 0  # tokens the last `load` found cached
        self.load_failures = 0  # loads the daemon failed (each ran as a miss)
        if gqa_attention:
            from engram.integrations.hf_attention import use_gqa_attention
            use_gqa_attention(model)
        self.store_failures = 0  # stores the daemon failed (logged; the next request with that prefix misses)

    @property
    def fingerprint(self) -> bytes:
        """The daemon's name for the model (it resolves the default codec), registering it first if the daemon was
        down until now (raises as the registration does)."""
        return self.registration.fingerprint

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- before a forward -----------------------------------------------------------------------

    def load(self, input_ids: Tensor, *, room: int = 0) -> Any:
        """A DynamicCache holding the longest cached prefix of input_ids (1, T), at most T - 1 tokens (the
        model computes the last token's logits itself), sliding layers' windows rebuilt by replay. Its global layers
        (RoomyLayer, engram/integrations/hf_cache.py) have room for the rest of input_ids and `room` tokens more
        (those a generate adds): a forward appends to them in place, not by concatenating the whole cache."""
        from transformers import DynamicCache

        from engram.integrations.hf_cache import RoomyLayer

        tokens = input_ids[0].tolist() if isinstance(input_ids, Tensor) else list(input_ids)
        cache = DynamicCache(config=self.model.config)
        limit = max(len(tokens) - 1, 0)
        ks, vs, dest = self._buffers(limit, len(tokens) + max(room, 0))
        self.last_loaded = 0
        if limit > 0:
            try:
                res = self.registration.call(
                    lambda fp: self.client.load_prefix_into(fp, tokens, dest, namespace=self.namespace))
                self.last_loaded = res.loaded_tokens
            except EngramError as exc:  # the daemon is down or refuses: the model prefills it all, as on a miss
                self.load_failures += 1
                log.warning("Engram load of %d tokens failed, prefilling them all: %s", len(tokens), exc)
        m = self.last_loaded
        if m == 0:
            return cache
        windows = self._windows(tokens, ks, vs, m) if self.sliding_layers else {}
        layer: Any
        for i, layer in enumerate(cache.layers):
            if i in windows:
                k, v = windows[i]
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
                layer.cumulative_length = m  # the window holds the last W-1 of m tokens
            else:
                j = self.global_layers.index(i)
                cache.layers[i] = RoomyLayer(ks[j], vs[j], m)
        return cache

    def _buffers(self, tokens: int, capacity: int) -> tuple[list[Tensor], list[Tensor], KVDestination]:
        """The global layers' keys and values, (1, H, capacity, D) views of one buffer whose first `tokens` the
        loader writes in one strided copy per stream and run (per-layer tensors cost 2 * L copies per run). K/V
        models: a buffer (L, 2, H, capacity, D), its loaded part seen as (L, 2, T, H, D). MLA models: a latent buffer
        (L, capacity, kv_lora_rank + rope), whose per-layer slices are the cache's keys (1, 1, capacity,
        kv_lora_rank) and values (1, 1, capacity, rope)."""
        with torch.inference_mode(False):  # ordinary tensors: a load under inference_mode, a generate outside it
            return self._allocate(tokens, max(capacity, tokens))

    def _allocate(self, tokens: int, capacity: int) -> tuple[list[Tensor], list[Tensor], KVDestination]:
        lay = self.layout
        n = len(self.global_layers)
        if self.mla is not None:
            rank = self.mla[0]
            latent = torch.empty(n, capacity, sum(self.mla), dtype=lay.dtype.torch_dtype, device=self.device)
            ks = [latent[j, :, :rank][None, None] for j in range(n)]
            vs = [latent[j, :, rank:][None, None] for j in range(n)]
            return ks, vs, StreamsKV(lay.stream_specs, {"latent": latent[:, :tokens]})
        buf = torch.empty(n, 2, lay.num_kv_heads, capacity, lay.head_dim, dtype=lay.dtype.torch_dtype,
                          device=self.device)
        ks = [buf[j, 0].unsqueeze(0) for j in range(n)]
        vs = [buf[j, 1].unsqueeze(0) for j in range(n)]
        return ks, vs, ContiguousKV(buf[:, :, :, :tokens].transpose(2, 3))

    def _windows(self, tokens: list[int], ks: list[Tensor], vs: list[Tensor], m: int) -> dict[int, tuple[Tensor, Tensor]]:
        """Each sliding layer's (1, H, rows, D) window for a query at m, by exact replay over the loaded KV."""
        from engram.replay import ReplayMode, reconstruct_swa
        from engram.replay.hf import HFReplayModel

        if self._replay is None:
            self._replay = HFReplayModel(self.model)
        global_kv = tuple((k[0, :, :m].transpose(0, 1), v[0, :, :m].transpose(0, 1)) for k, v in zip(ks, vs, strict=True))
        rec = reconstruct_swa(self._replay, torch.tensor(tokens[:m]), global_kv, ReplayMode.exact(), prefix_len=m)
        return {i: (k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))
                for i, (k, v) in zip(self.sliding_layers, rec.window.kv, strict=True)}

    # ---- after a forward -----------------------------------------------------------------------

    def store(self, tokens: Tensor | list[int], cache: Any, *, session_id: str = "", expect_back_ms: float = 0
              ) -> int:
        """Store the global layers' KV of `tokens` that `cache` holds (the blocks not cached yet); returns the
        tokens stored (0 when the daemon failed the put: logged and counted in `store_failures`, never raised). A
        cache holds KV for every token but the last one generated. With `session_id` (an agent's conversation),
        the daemon's session of that id then holds what was stored, with the hint of when the agent is back
        (`expect_back_ms`; engram/integrations/sessions.py): its blocks outlive those of finished conversations
        under eviction."""
        if _rows(self, cache) != 1:
            raise InvalidArgument(f"store takes a cache of one sequence; this one holds {_rows(self, cache)} (beams "
                                  "or several returned sequences: generate stores their common prompt only)")
        return self._store(tokens, cache, session_id=session_id, expect_back_ms=expect_back_ms)

    def _store(self, tokens: Tensor | list[int], cache: Any, *, session_id: str, expect_back_ms: float) -> int:
        """`store` of row 0 of the cache: the caller knows `tokens`' KV is that row's."""
        toks = tokens[0].tolist() if isinstance(tokens, Tensor) and tokens.dim() == 2 else list(tokens)
        layers = [cache.layers[i] for i in self.global_layers]
        n = min(len(toks), min(int(layer.keys.shape[-2]) for layer in layers))
        if n == 0:
            return 0
        ids = np.asarray(toks[:n], dtype=np.int32)
        kv: Tensor | dict[str, Tensor]
        if self.mla is not None:  # the latent c and k_pe side by side: (L, n, kv_lora_rank + rope)
            kv = {"latent": torch.stack([torch.cat((layer.keys[0, 0, :n], layer.values[0, 0, :n]), dim=-1)
                                         for layer in layers])}
        else:  # (L, 2, n, H, D)
            kv = torch.stack([torch.stack((layer.keys[0, :, :n], layer.values[0, :, :n])) for layer in layers])
            kv = kv.transpose(2, 3)
        try:
            self.registration.call(lambda fp: self.client.put(fp, ids, kv, namespace=self.namespace))
        except EngramError as exc:  # the answer is computed: the daemon going away must not cost the caller it
            self.store_failures += 1
            log.warning("Engram store of %d tokens failed; the next request with that prefix misses: %s", n, exc)
            return 0
        if session_id:
            self.sessions.join(session_id, ids, expect_back_ms)
        return n


def generate(model: Any, input_ids: Tensor, cache: EngramPrefixCache, *, session_id: str = "",
             expect_back_ms: float = 0, **kwargs: Any) -> Tensor:
    """`model.generate(input_ids, **kwargs)` with Engram as its prefix cache: the cached prefix is loaded, only
    the rest prefilled, and the whole sequence's KV stored afterwards (held by the daemon's session
    `session_id`, with its hint, when given: `EngramPrefixCache.store`). One sequence (batch size 1)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise InvalidArgument(f"generate takes one sequence, input_ids of shape (1, T); got {tuple(input_ids.shape)}")
    past = cache.load(input_ids, room=_new_tokens(model, kwargs))
    out = model.generate(input_ids, **{cache_kwarg(model): past}, **kwargs)
    # Beam search (or several returned sequences) leaves one cache row per beam, reordered at every step: which
    # row holds out[0]'s KV is not known, but every row holds the prompt's.
    stored = out if _rows(cache, past) == 1 else input_ids
    cache._store(stored, past, session_id=session_id, expect_back_ms=expect_back_ms)
    return out


# The most room a generate's cache is given up front for the tokens it adds (RoomyLayer grows past it): a
# generation_config's max_new_tokens may be 32K, allocated for every request (128 KiB a token for Llama-3-8B)
ROOM_TOKENS = 1024


def _new_tokens(model: Any, kwargs: dict[str, Any]) -> int:
    """The room a generate with these arguments is given for the tokens it adds: max_new_tokens (from the call, its
    generation_config or the model's), at most ROOM_TOKENS."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    n = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    return min(int(n), ROOM_TOKENS) if n else 0


def _rows(prefix: EngramPrefixCache, cache: Any) -> int:
    """How many sequences a transformers cache holds (its batch dimension)."""
    return int(cache.layers[prefix.global_layers[0]].keys.shape[0])


