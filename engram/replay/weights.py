"""A HybridDecoder's weights on disk: one safetensors file whose metadata carries the config, so a load can
rebuild the decoder and refuse weights saved for another config. The daemon loads its replay models with
`load_decoder` (runtime.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from engram.replay.config import HybridConfig
from engram.replay.decoder import GlobalKVTransform, HybridDecoder
from engram.replay.model import ReplayError
from engram.replay.numerics import Numerics


def save_decoder(model: HybridDecoder, path: str | Path) -> None:
    """Weights plus the config (safetensors metadata), so a load can refuse a mismatched config."""
    from safetensors.torch import save_file

    tensors = {name: p.detach().cpu().contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(path), metadata={"engram.replay.config": model.config.to_json()})


def load_decoder(path: str | Path, *, config: HybridConfig | None = None, device: torch.device | str | None = None,
                 numerics: Numerics | str = Numerics.BATCH_INVARIANT,
                 global_kv_transform: GlobalKVTransform | None = None) -> HybridDecoder:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "engram.replay.config" not in meta:
        raise ReplayError(f"{path} has no engram.replay.config metadata; save it with save_decoder")
    saved = HybridConfig.from_json(meta["engram.replay.config"])
    if config is not None and config != saved:
        raise ReplayError(f"{path} holds weights for {saved}, not the requested {config}; load without a config "
                          "or pass the saved one")
    model = HybridDecoder(saved, device=device, numerics=numerics, global_kv_transform=global_kv_transform)
    state = load_file(str(path), device=str(model.device))
    missing = set(dict(model.named_parameters())) ^ set(state)
    if missing:
        raise ReplayError(f"{path} parameters do not match the config: {sorted(missing)[:5]}")
    for name, p in model.named_parameters():
        p.data.copy_(state[name].to(p.dtype))
    return model
