"""The daemon's replay runtime without gRPC: which loaded model serves which registered ModelSpec."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engram.replay import (
    HybridConfig,
    HybridDecoder,
    ReplayError,
    all_sliding_pattern,
    gpt_oss_pattern,
    save_decoder,
)
from engram.replay.runtime import ReplayRuntime


def _decoder(layers: tuple[str, ...] | None = None, **kw: object) -> HybridDecoder:
    cfg = HybridConfig(layers=layers or gpt_oss_pattern(2), **kw)  # type: ignore[arg-type]
    return HybridDecoder(cfg, device="cpu")


def test_a_model_no_spec_can_describe_is_refused_at_construction() -> None:
    # All sliding: a block would carry no KV, so no worker can register it; float64: a dtype the daemon
    # does not store. Either used to fail every later OpenSession, Resume and Stats instead.
    with pytest.raises(ReplayError, match=r"replay model 0: .*no global layer"):
        ReplayRuntime([_decoder(all_sliding_pattern(2))])
    with pytest.raises(ReplayError, match=r"replay model 1: .*float64"):
        ReplayRuntime([_decoder(), _decoder(dtype=torch.float64)])


def test_from_paths_names_the_file_of_a_refused_model(tmp_path: Path) -> None:
    path = tmp_path / "sliding.safetensors"
    save_decoder(_decoder(all_sliding_pattern(2)), path)
    with pytest.raises(ReplayError, match=re.escape(str(path)) + r": .*load a model with a global layer"):
        ReplayRuntime.from_paths([path], device="cpu")
