"""Bounded replay on Hugging Face transformers models (gpt-oss, Gemma 3, Mistral with sliding_window).

`HFReplayModel` wraps a causal LM so it implements ReplayModel: a span runs through the model's own forward with
a cache object (`StoredKVCache`) that hands each global layer the STORED K/V of every position, the span's
included (whatever the layer just computed for those positions is ignored), and hands each sliding layer the
SWA past it was given (none, to start a replay). The cache also records what the span produced, so a prefill
through it yields every layer's KV.

Checked against transformers 5.24: forward takes `cache=` (`past_key_values=` before 5.2x, e.g. 5.17:
`cache_kwarg` picks the name the model takes) and returns `outputs.cache`; layers are
`cache.layers[i]` with `.keys` / `.values` of shape (B, n_kv, T, d_h); masks are sized from
`cache.get_mask_sizes` and `cache.get_query_offset`. transformers is imported lazily: the rest of
engram.replay works without it.

`load_checkpoint` loads a checkpoint directory (config.json and safetensors shards, as save_pretrained writes
them) for the daemon's `replay.models`; its layer pattern is checked from config.json before any weight is read:
a model whose every layer slides (Mistral v0.1) is refused there, the daemon having no global KV to replay from.

What it does not do: cone replay (the HF forward runs every layer over the same rows), batching, or models
whose layer types are not full/sliding attention (linear attention, chunked attention, KV-sharing layers).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engram.replay.model import (
    KV,
    AttentionKind,
    PrefillResult,
    ReplayError,
    ReplayPast,
    ReplaySpec,
    SpanOutput,
)

_KINDS = {"full_attention": AttentionKind.GLOBAL, "sliding_attention": AttentionKind.SLIDING}


def replay_spec_from_config(config: Any, dtype: torch.dtype) -> ReplaySpec:
    """Layer kinds and window of an HF text config (HF's sliding_window counts keys including the query's own,
    as Engram's W does)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or (["sliding_attention" if window else "full_attention"] * n)
    unknown = sorted(set(types) - set(_KINDS))
    if unknown:
        raise ReplayError(f"layer types {unknown} are not supported by bounded replay; only {sorted(_KINDS)}")
    if getattr(cfg, "kv_sharing_modes", None):
        raise ReplayError("HF KV-sharing layers are not supported; use HybridDecoder's reindex/reuse layers")
    kinds = tuple(_KINDS[t] for t in types)
    if AttentionKind.SLIDING in kinds and not window:
        raise ReplayError("the config has sliding layers but no sliding_window")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ReplaySpec(kinds, int(window or 1), cfg.num_key_value_heads, head_dim, dtype, supports_cone=False)


def _cache_classes() -> tuple[type, type, type]:
    """Built on first use so importing this module does not import transformers."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class StoredGlobalLayer(CacheLayerMixin):
        """A global layer whose keys come from storage: positions [0, G) are read, never recomputed; only
        positions past G (a decode step) use what the layer computed."""

        is_sliding = False

        def __init__(self, keys: Tensor, values: Tensor, start: int) -> None:
            super().__init__()
            self.stored_keys, self.stored_values = keys, values  # (1, n_kv, G, d_h)
            self.keys, self.values = keys, values
            self.seen = start
            self.new: list[KV] = []
            self.is_initialized = True

        def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
            self.is_initialized = True

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> KV:
            end = self.seen + key_states.shape[-2]
            g = self.stored_keys.shape[-2]
            keys, values = self.stored_keys[..., : min(end, g), :], self.stored_values[..., : min(end, g), :]
            if end > g:
                new_k, new_v = key_states[..., g - self.seen :, :], value_states[..., g - self.seen :, :]
                self.new.append((new_k, new_v))
                keys, values = torch.cat((keys, new_k), dim=-2), torch.cat((values, new_v), dim=-2)
            self.seen = end
            self.keys, self.values = keys, values
            return keys, values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.seen + query_length, 0

        def get_seq_length(self) -> int:
            return self.seen

        def get_max_length(self) -> int:
            return -1

    class ReplayWindowLayer(CacheLayerMixin):
        """A sliding layer that holds only the SWA past it was given, for positions [start - n, start)."""

        is_sliding = True

        def __init__(self, window: int, keys: Tensor, values: Tensor, start: int) -> None:
            super().__init__()
            self.sliding_window = window
            self.held_keys, self.held_values = keys, values  # (1, n_kv, n, d_h)
            self.keys, self.values = keys, values
            self.seen = start
            self.produced: list[KV] = []
            self.is_initialized = True

        def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
            self.is_initialized = True

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> KV:
            self.produced.append((key_states, value_states))
            keys = torch.cat((self.held_keys, key_states), dim=-2)
            values = torch.cat((self.held_values, value_states), dim=-2)
            self.seen += key_states.shape[-2]
            keep = max(self.sliding_window - 1, 0)
            self.held_keys = keys[..., keys.shape[-2] - keep :, :]
            self.held_values = values[..., values.shape[-2] - keep :, :]
            self.keys, self.values = self.held_keys, self.held_values
            return keys, values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            held = self.held_keys.shape[-2]
            return held + query_length, self.seen - held

        def get_seq_length(self) -> int:
            return self.seen

        def get_max_length(self) -> int:
            return self.sliding_window

    class StoredKVCache(Cache):
        def __init__(self, layers: list[Any]) -> None:
            super().__init__(layers=layers)

    return StoredGlobalLayer, ReplayWindowLayer, StoredKVCache


def _hf_layout(x: Tensor) -> Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # (T, n_kv, d_h) -> (1, n_kv, T, d_h)


def _stored_layout(x: Tensor) -> Tensor:
    return x[0].transpose(0, 1).contiguous()  # (1, n_kv, T, d_h) -> (T, n_kv, d_h)


def cache_kwarg(model: Any) -> str:
    """The name a model's forward takes its cache by: `cache` from transformers 5.2x, `past_key_values` before (a
    cache passed under the other name is swallowed by **kwargs, and the model makes its own)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# Config keys that say how this process runs the model, not what the model computes: left out of its identity so
# that a worker (sdpa on its GPU) and the daemon (eager on its CPU) that load the same checkpoint agree.
_RUNTIME_KEYS = frozenset({"transformers_version", "_name_or_path", "_attn_implementation",
                           "_attn_implementation_autoset", "_experts_implementation", "dtype", "torch_dtype",
                           "use_cache", "output_attentions", "output_hidden_states", "return_dict"})


def _identity_config(config: Any) -> str:
    d = {k: v for k, v in config.to_dict().items() if k not in _RUNTIME_KEYS and not k.startswith("_")}
    return json.dumps(d, sort_keys=True, default=str)


class HFReplayModel:
    """ReplayModel over an HF causal LM (eager attention, one sequence). Flat replay only."""

    def __init__(self, model: Any) -> None:
        self.model = model.eval()
        self._cache_kwarg = cache_kwarg(model)
        dtype = next(model.parameters()).dtype
        self._spec = replay_spec_from_config(model.config, dtype)

    def weights_identity(self) -> str:
        """A content hash of the config (what it computes, not how it runs) and every parameter as loaded (so
        the dtype is part of it): equal checkpoints loaded alike give equal identities. Reads every parameter."""
        h = hashlib.blake2b(_identity_config(self.model.config).encode(), digest_size=16)
        for name, p in sorted(self.model.named_parameters()):
            h.update(name.encode())
            h.update(str(p.dtype).encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return f"hf:{h.hexdigest()}"

    @property
    def replay_spec(self) -> ReplaySpec:
        return self._spec

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def prefill(self, tokens: Tensor | Sequence[int]) -> PrefillResult:
        spec = self._spec
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        empty = torch.empty(0, spec.n_kv_heads, spec.head_dim, dtype=spec.dtype, device=self.device)
        past = ReplayPast(0, tuple((empty, empty) for _ in spec.stored_layers),
                          tuple((empty, empty) for _ in spec.sliding_layers))
        out = self.forward_span(tokens, past)
        return PrefillResult(out.logits, out.global_kv, out.swa_kv, spec.window)

    @torch.inference_mode()
    def forward_span(self, tokens: Tensor, past: ReplayPast, *, starts: Sequence[int] | None = None,
                     logits: bool = True) -> SpanOutput:
        spec = self._spec
        if starts is not None and any(int(s) != past.start for s in starts):
            raise ReplayError("HF models replay flat: every layer runs the whole span; pass starts=None (cone=False)")
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.ndim != 1 or tokens.numel() == 0:
            raise ReplayError(f"tokens must be a non-empty 1-D tensor of ids, got shape {tuple(tokens.shape)}")
        vocab = self.model.get_input_embeddings().num_embeddings
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:  # checked here: on a GPU the embedding asserts
            raise ReplayError(f"token ids must lie in [0, {vocab}); got {int(tokens.min())}..{int(tokens.max())}")
        tokens = tokens.to(self.device)
        if len(past.global_kv) != len(spec.stored_layers) or len(past.swa_kv) != len(spec.sliding_layers):
            raise ReplayError(f"the model has {len(spec.stored_layers)} global and {len(spec.sliding_layers)} sliding "
                              f"layers; the past holds {len(past.global_kv)} and {len(past.swa_kv)}")
        start, end = past.start, past.start + tokens.numel()
        glob_cls, window_cls, cache_cls = _cache_classes()
        stored, sliding = iter(past.global_kv), iter(past.swa_kv)
        layers: list[Any] = []
        swa: list[Any] = []
        glob: list[Any] = []
        for kind in spec.kinds:
            if kind is AttentionKind.GLOBAL:
                k, v = next(stored)
                if k.shape[0] < start:
                    raise ReplayError(f"stored global KV covers [0, {k.shape[0]}) but the span starts at {start}")
                glob.append(glob_cls(_hf_layout(k[:end]), _hf_layout(v[:end]), start))
                layers.append(glob[-1])
            else:
                k, v = next(sliding)
                swa.append(window_cls(spec.window, _hf_layout(k), _hf_layout(v), start))
                layers.append(swa[-1])
        cache = cache_cls(layers)
        positions = torch.arange(start, end, device=self.device)[None]
        out = self.model(input_ids=tokens[None], position_ids=positions, use_cache=True, **{self._cache_kwarg: cache})
        swa_kv = tuple((_stored_layout(torch.cat([k for k, _ in w.produced], -2)),
                        _stored_layout(torch.cat([v for _, v in w.produced], -2))) for w in swa)
        empty = torch.empty(0, spec.n_kv_heads, spec.head_dim, dtype=spec.dtype, device=self.device)
        global_kv = tuple((_stored_layout(torch.cat([k for k, _ in g.new], -2)),
                           _stored_layout(torch.cat([v for _, v in g.new], -2))) if g.new else (empty, empty)
                          for g in glob)
        return SpanOutput(swa_kv, (start,) * len(swa), global_kv, out.logits[0] if logits else None,
                          len(spec.kinds) * tokens.numel())


_SAME_DTYPE_EAGER = "engram_eager"


def _same_dtype_eager(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      scaling: float, dropout: float = 0.0, softcap: float | None = None, **kwargs: Any
                      ) -> tuple[Tensor, Tensor]:
    """HF's Llama-family eager attention with the softmax in the model's dtype. HF upcasts that softmax to
    float32, whose vectorised row sums depend on the row's length, so a float64 model replayed over fewer keys
    differs from its own prefill by ~5e-8 (measured on Mistral, torch 2.13 CPU): rounding of HF's, not replay's."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)  # (B, n_h, T, d_h)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:  # Gemma 2's attention logit softcapping
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _register_same_dtype_eager() -> str:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(_SAME_DTYPE_EAGER, _same_dtype_eager)
    AttentionMaskInterface.register(_SAME_DTYPE_EAGER, eager_mask)
    return _SAME_DTYPE_EAGER


# Model types whose HF eager attention upcasts its softmax to float32 (see _same_dtype_eager): in float64 they
# run Engram's same-dtype eager so a replay is bit-identical to the prefill. The others (gpt-oss's sinks, Gemma
# 3) keep the model's dtype in their own eager attention.
_UPCASTING = frozenset({"mistral", "ministral", "qwen2", "qwen3", "llama", "gemma2"})


def checkpoint_spec(path: str | Path) -> ReplaySpec:
    """The layer pattern of a checkpoint directory, from its config.json alone (no weights read): a directory
    whose layers bounded replay cannot serve is refused before its shards are loaded."""
    from transformers import AutoConfig

    root = Path(path)
    if not (root / "config.json").is_file():
        raise ReplayError(f"{root} has no config.json: not a Hugging Face checkpoint directory")
    if not any(root.glob("*.safetensors")):
        raise ReplayError(f"{root} has no *.safetensors shards (save with save_pretrained(safe_serialization=True))")
    try:
        config = AutoConfig.from_pretrained(str(root))
    except (ValueError, KeyError, OSError) as exc:
        raise ReplayError(f"{root}/config.json: {exc}") from exc
    spec = replay_spec_from_config(config, torch.float32)
    if AttentionKind.GLOBAL not in spec.kinds:  # Mistral v0.1: replayable in-process, but a daemon has no KV to read
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        why = ("its config's layer_types are all sliding_attention" if getattr(cfg, "layer_types", None) else
               f"its config's sliding_window={cfg.sliding_window}, with no layer_types, applies to all "
               f"{len(spec.kinds)} layers of this {config.model_type} model")
        raise ReplayError(f"every layer of this model slides ({why}): it has no global (full-attention) KV to store "
                          "and replay from, so the daemon cannot serve it; its sessions keep their windows in persist "
                          "mode (or in the worker). Models with at least one full_attention layer are served")
    return spec


def load_checkpoint(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                    attention: str = "auto") -> HFReplayModel:
    """A checkpoint directory as a replay model, on `device` in `dtype` (default bfloat16 on CUDA, float32 on
    the CPU). attention "auto": eager on the CPU (exact, the tests' float64), sdpa on CUDA (eager would
    materialise every head's (R, context) score matrix of a long replay)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    checkpoint_spec(path)
    hf_logging.disable_progress_bar()  # the daemon's log is not a terminal
    dev = torch.device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if attention == "auto":
        attention = "sdpa" if dev.type == "cuda" else "eager"
    config = AutoConfig.from_pretrained(str(path))
    if attention == "eager" and dtype == torch.float64 and config.model_type in _UPCASTING:
        attention = _register_same_dtype_eager()
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attention,
                                                         experts_implementation="eager")
        except ValueError as exc:
            if attention != "sdpa" or "scaled_dot_product_attention" not in str(exc):
                raise
            # gpt-oss (its attention sinks) has no sdpa path in transformers: eager, whatever it costs.
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager",
                                                         experts_implementation="eager")
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise ReplayError(f"{path}: the checkpoint does not load: {exc}") from exc
    # Loaded on the host first (device_map would need `accelerate`); transformers' typed `to` confuses mypy.
    moved: Any = torch.nn.Module.to(model, dev)
    return HFReplayModel(moved)


def _build(model_cls: Any, config: Any, seed: int, dtype: torch.dtype, *, attention: str = "eager") -> HFReplayModel:
    # eager attention: explicit masks, the same math for every layer kind; eager experts: torch's grouped_mm
    # has no float64 kernel on the CPU.
    config._attn_implementation = attention
    config._experts_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return HFReplayModel(model.to(dtype))


def tiny_gpt_oss(*, n_layers: int = 4, window: int = 8, seed: int = 0, dtype: torch.dtype = torch.float64,
                 vocab_size: int = 256, hidden: int = 64) -> HFReplayModel:
    """gpt-oss shape in miniature: alternating sliding/full layers, attention sinks, a 4-expert MoE."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(num_hidden_layers=n_layers, num_local_experts=4, num_experts_per_tok=2,
                          vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden, head_dim=16,
                          num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                          max_position_embeddings=4096)
    return _build(GptOssForCausalLM, config, seed, dtype)


def tiny_gemma3(*, n_layers: int = 6, window: int = 8, seed: int = 0, dtype: torch.dtype = torch.float64,
                vocab_size: int = 256, hidden: int = 64) -> HFReplayModel:
    """Gemma 3 text model in miniature: five sliding layers then one global (HF's default layer_types)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              query_pre_attn_scalar=16, sliding_window=window, max_position_embeddings=4096)
    return _build(Gemma3ForCausalLM, config, seed, dtype)


def tiny_mistral(*, n_layers: int = 3, window: int = 8, seed: int = 0, dtype: torch.dtype = torch.float64,
                 vocab_size: int = 256, hidden: int = 64) -> HFReplayModel:
    """Mistral with sliding_window set: every layer slides, nothing is stored, the whole window is replayed."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           sliding_window=window, max_position_embeddings=4096)
    # Mistral's own eager attention runs its softmax in float32 (see _same_dtype_eager); gpt-oss's (sinks)
    # and Gemma 3's keep the model's dtype and stay as they are.
    return _build(MistralForCausalLM, config, seed, dtype, attention=_register_same_dtype_eager())
