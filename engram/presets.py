"""Named layouts of the models the field serves, with their real shapes, and what a token of each costs stored.

Each preset is a KVLayout (engram/layout.py) a worker can register as it is (`Preset.spec`): the MHA/GQA models
keep the K/V layout (block format v1, its fast paths), the DeepSeek family gets stream layouts (block format
v2). Shapes come from the models' published configs:

- llama-3-8b: 32 layers, 8 KV heads x 128, all global.
- qwen3-8b: 36 layers, 8 KV heads x 128, all global.
- gpt-oss-20b: 24 layers alternating sliding (W=128) and global, sliding first; 8 KV heads x 64.
- gemma-3-27b: 62 layers, five sliding (W=1024) then one global; 16 KV heads x 128.
- deepseek-v3: 61 MLA layers; per token and layer one latent of kv_lora_rank 512 + qk_rope_head_dim 64 = 576.
- deepseek-v3.2: deepseek-v3's latent, plus DeepSeek Sparse Attention's indexer key (index_head_dim 128) per
  token and layer, kept in FP8 as V3.2 does.
- csa2: the seed model the technical report behind Engram describes (BRIEF section 1): cross-layer sharing in
  Full / Reindex / Reuse layers, the Full layers' compressed global KV and indexer keys in FP4, every layer with
  a sliding window of its own. The report gives neither its depth nor its widths, so these are assumptions,
  each taken from DeepSeek-V4's published config where it has one (docs/LAYOUTS.md says which): 61 layers, the
  first sliding-only, then ten groups of six (Full, Reindex, Reuse, Reindex, Reuse, Reuse); a latent of 512
  (V4's head_dim, its 64 rope dims included) and an indexer key of 128, both one entry per 4 tokens (V4's CSA
  compression); every layer's window 128 keeping one 512-wide FP8 entry per token.

`bytes_per_token` prices a preset in any codec: persisted with SWA replayed (what Engram stores: the global
layers' streams, headers and scales included, from a full block's real size) and with every layer persisted
(the sliding layers' KV of every token too, as a cache without replay keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass

from engram.codec import stored, streamformat
from engram.layout import Axis, DType, KVLayout, LayerKind, LayerSpec, ModelSpec, StreamSpec

CODECS = ("raw", "fp8_e4m3", "nvfp4", "mxfp4")  # the ones every preset is priced in; "preset" = its own


@dataclass(frozen=True)
class Preset:
    name: str
    layout: KVLayout
    codec: str  # the model's codec the preset is meant for (streams naming none take it)
    source: str  # where the shapes come from
    assumptions: str = ""  # what is not from a published config

    def spec(self, weights_id: str = "", codec: str | None = None) -> ModelSpec:
        """A ModelSpec of this layout (weights_id: the checkpoint's identity; default: the preset's name)."""
        return ModelSpec(self.name, weights_id or f"preset:{self.name}", self.layout,
                         self.codec if codec is None else codec)


def _gqa(n: int, kind: LayerKind = LayerKind.GLOBAL) -> tuple[LayerSpec, ...]:
    return (LayerSpec(kind),) * n


_LATENT = StreamSpec("latent", (576,), DType.BF16, "", Axis.TOKEN)  # kv_lora_rank 512 + qk_rope_head_dim 64
_INDEX_FP8 = StreamSpec("index_k", (128,), DType.BF16, "fp8_e4m3", Axis.TOKEN)


def _csa2_layers() -> tuple[LayerSpec, ...]:
    group = (LayerKind.GLOBAL, LayerKind.REINDEX, LayerKind.REUSE, LayerKind.REINDEX, LayerKind.REUSE,
             LayerKind.REUSE)
    return (LayerSpec(LayerKind.SLIDING, 128), *(LayerSpec(k, 128) for _ in range(10) for k in group))


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("llama-3-8b", KVLayout(_gqa(32), 8, 128, DType.BF16), "nvfp4",
           "meta-llama/Meta-Llama-3-8B config.json"),
    Preset("qwen3-8b", KVLayout(_gqa(36), 8, 128, DType.BF16), "nvfp4", "Qwen/Qwen3-8B config.json"),
    Preset("gpt-oss-20b", KVLayout(tuple(LayerSpec(LayerKind.SLIDING, 128) if i % 2 == 0 else LayerSpec(LayerKind.GLOBAL)
                                         for i in range(24)), 8, 64, DType.BF16), "nvfp4",
           "openai/gpt-oss-20b config.json"),
    Preset("gemma-3-27b", KVLayout(tuple(LayerSpec(LayerKind.GLOBAL) if (i + 1) % 6 == 0 else
                                         LayerSpec(LayerKind.SLIDING, 1024) for i in range(62)), 16, 128, DType.BF16),
           "nvfp4", "google/gemma-3-27b-it config.json (text config)"),
    Preset("deepseek-v3", KVLayout(_gqa(61), streams=(_LATENT,)), "nvfp4",
           "deepseek-ai/DeepSeek-V3 config.json (kv_lora_rank 512, qk_rope_head_dim 64)"),
    Preset("deepseek-v3.2", KVLayout(_gqa(61), streams=(_LATENT, _INDEX_FP8)), "nvfp4",
           "deepseek-ai/DeepSeek-V3.2-Exp config.json (index_head_dim 128; indexer keys in FP8)"),
    Preset("csa2", KVLayout(_csa2_layers(), streams=(
        StreamSpec("latent", (512,), DType.BF16, "nvfp4", Axis.TOKEN, compress=4),
        StreamSpec("index_k", (128,), DType.BF16, "nvfp4", Axis.TOKEN, compress=4)),
        window_streams=(StreamSpec("window", (512,), DType.BF16, "fp8_e4m3", Axis.TOKEN),)), "nvfp4",
           "the technical report (BRIEF section 1); widths from DeepSeek-V4's config",
           "61 layers; first layer sliding-only; 10 groups Full/Reindex/Reuse/Reindex/Reuse/Reuse; compression 4; "
           "indexer key in FP4; window KV 512 wide in FP8"),
)}


@dataclass(frozen=True)
class TokenCost:
    """Bytes per token of one preset in one codec."""

    codec: str  # a codec name, or "preset" (each stream in its own codec)
    persisted: float  # SWA replayed: the global layers' stored blocks, per token
    all_layers: float  # every layer persisted: plus the sliding layers' (and branches') KV of every token


def _with_codec(streams: tuple[StreamSpec, ...], codec: str | None, model_codec: str) -> tuple[StreamSpec, ...]:
    """The streams with codecs resolved: all in `codec`, or (None) each in its own."""
    if codec is None:
        return tuple(s.resolved(model_codec) for s in streams)
    return tuple(StreamSpec(s.name, s.shape, s.dtype, codec, s.axis, s.compress) for s in streams)


def bytes_per_token(preset: Preset, codec: str | None = None) -> TokenCost:
    """What a token costs stored: from the real size of a full block (headers, scales, padding included) and,
    for the sliding layers, of their KV in the same codec. codec None: the preset's own codecs (its window KV
    in its window streams' codecs)."""
    lay = preset.layout
    bt = lay.block_tokens
    label = codec or "preset"
    if lay.has_streams:
        block = streamformat.plan(_with_codec(lay.streams, codec, preset.codec), lay.persisted_layers, bt).nbytes
    else:
        block = stored.stored_nbytes(codec or preset.codec, lay.block_shape(bt), lay.dtype)
    window = 0.0
    if lay.windowed_layers:
        streams = _with_codec(lay.window_stream_specs, codec, preset.codec)
        window = streamformat.plan(streams, lay.windowed_layers, bt).body_len / bt
    return TokenCost(label, block / bt, block / bt + window)


def table(presets: dict[str, Preset] | None = None) -> list[dict[str, object]]:
    """Every preset priced in every codec and in its own: the rows of `engram layouts`."""
    rows: list[dict[str, object]] = []
    for p in (presets or PRESETS).values():
        lay = p.layout
        costs = [bytes_per_token(p, c) for c in CODECS] + [bytes_per_token(p)]
        rows.append({
            "name": p.name, "layers": len(lay.layers), "persisted_layers": lay.persisted_layers,
            "windowed_layers": lay.windowed_layers,
            "streams": [{"name": s.name, "shape": list(s.shape), "codec": s.codec or p.codec, "axis": s.axis.name.lower(),
                         "compress": s.compress} for s in lay.stream_specs],
            "codec": p.codec, "source": p.source, "assumptions": p.assumptions,
            "bytes_per_token": {c.codec: {"persisted": round(c.persisted, 2), "all_layers": round(c.all_layers, 2)}
                                for c in costs},
        })
    return rows
