"""SWA bounded replay: rebuild sliding-window KV from tokens and stored global KV (see docs/REPLAY.md)."""

from engram.replay.config import (
    HybridConfig,
    all_sliding_pattern,
    csa_pattern,
    gemma3_pattern,
    gpt_oss_pattern,
)
from engram.replay.decoder import HybridDecoder
from engram.replay.model import (
    KV,
    AttentionKind,
    PrefillResult,
    ReplayError,
    ReplayModel,
    ReplayPast,
    ReplaySpec,
    SpanOutput,
    SwaWindow,
)
from engram.replay.numerics import Numerics
from engram.replay.reconstruct import (
    DecodeStep,
    Reconstruction,
    ReplayKind,
    ReplayMode,
    as_layer_kv,
    decode_next,
    exact_bound,
    layer_starts,
    reconstruct_swa,
    replay_length,
    window_error,
)
from engram.replay.weights import load_decoder, save_decoder

__all__ = [
    "KV",
    "AttentionKind",
    "DecodeStep",
    "HybridConfig",
    "HybridDecoder",
    "Numerics",
    "PrefillResult",
    "Reconstruction",
    "ReplayError",
    "ReplayKind",
    "ReplayMode",
    "ReplayModel",
    "ReplayPast",
    "ReplaySpec",
    "SpanOutput",
    "SwaWindow",
    "all_sliding_pattern",
    "as_layer_kv",
    "csa_pattern",
    "decode_next",
    "exact_bound",
    "gemma3_pattern",
    "gpt_oss_pattern",
    "layer_starts",
    "load_decoder",
    "reconstruct_swa",
    "replay_length",
    "save_decoder",
    "window_error",
]
