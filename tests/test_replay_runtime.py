"""The daemon's replay runtime without gRPC: which loaded model serves which registered ModelSpec."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import engram.replay.runtime as runtime_mod
from engram.errors import FailedPrecondition
from engram.layout import LayerKind, LayerSpec
from engram.replay import (
    HybridConfig,
    HybridDecoder,
    ReplayError,
    all_sliding_pattern,
    gpt_oss_pattern,
    save_decoder,
)
from engram.replay.runtime import ReplayRuntime, model_spec_for, weights_identity


def _decoder(layers: tuple[str, ...] | None = None, **kw: object) -> HybridDecoder:
    cfg = HybridConfig(layers=layers or gpt_oss_pattern(2), **kw)  # type: ignore[arg-type]
    return HybridDecoder(cfg, device="cpu")


def test_a_model_no_spec_can_describe_is_refused_at_construction() -> None:
    # All sliding: a block would carry no KV, so no worker can register it. It used to fail every later
    # OpenSession, Resume and Stats instead. (float64 used to be refused too; it is stored raw since issue 20.)
    with pytest.raises(ReplayError, match=r"replay model 1: every layer of this model slides"):
        ReplayRuntime([_decoder(), _decoder(all_sliding_pattern(2))])
    assert ReplayRuntime([_decoder(dtype=torch.float64)]).identities[0].layout.dtype.name == "FP64"


def test_from_paths_names_the_file_of_a_refused_model(tmp_path: Path) -> None:
    path = tmp_path / "sliding.safetensors"
    save_decoder(_decoder(all_sliding_pattern(2)), path)
    with pytest.raises(ReplayError, match=re.escape(str(path)) + r": every layer of this model slides"):
        ReplayRuntime.from_paths([path], device="cpu")



def test_identity_is_computed_once_per_model_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _decoder(seed=1), _decoder(seed=2)
    spec_a, spec_b = model_spec_for(a, block_tokens=16), model_spec_for(b, block_tokens=64, codec="fp8")
    unknown = model_spec_for(_decoder(seed=3), block_tokens=16)
    hashed: list[HybridDecoder] = []

    def counting(model: HybridDecoder) -> str:
        hashed.append(model)
        return weights_identity(model)

    monkeypatch.setattr(runtime_mod, "weights_identity", counting)
    rt = ReplayRuntime([a, b])
    assert hashed == [a, b]
    assert [i.weights_id for i in rt.identities] == [spec_a.weights_id, spec_b.weights_id]
    for _ in range(3):  # what OpenSession, Resume and Stats each do
        assert rt.model_for(spec_a) is a
        assert rt.require(spec_b) is b
        assert rt.model_for(unknown) is None
    assert hashed == [a, b]


def test_matching_reads_no_parameter_after_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    # Independent of how the identity is computed: any read of the weights after start-up fails the test.
    model = _decoder(seed=1)
    spec = model_spec_for(model, block_tokens=32)
    rt = ReplayRuntime([model])

    def no_weights_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("a replay model's parameters were read after the runtime was built")

    for method in ("parameters", "named_parameters", "state_dict"):
        monkeypatch.setattr(model, method, no_weights_read)
    assert rt.require(spec) is model
    with pytest.raises(FailedPrecondition, match="no replay model"):
        rt.require(dataclasses.replace(spec, weights_id="hybrid:other"))


def test_a_spec_matches_by_weights_and_layout_up_to_block_size_and_codec() -> None:
    model = _decoder(seed=1)
    rt = ReplayRuntime([model])
    spec = model_spec_for(model, name="any-name", block_tokens=16, codec="raw")
    assert rt.model_for(spec) is model
    assert rt.model_for(dataclasses.replace(spec, codec="fp4", name="other")) is model
    assert rt.model_for(dataclasses.replace(spec, layout=dataclasses.replace(spec.layout, block_tokens=1024))) is model
    # Same weights id, another layout (a worker that registered the wrong head count): no match.
    assert rt.model_for(dataclasses.replace(spec, layout=dataclasses.replace(spec.layout, num_kv_heads=1))) is None
    layers = (LayerSpec(LayerKind.SLIDING, 4), LayerSpec(LayerKind.GLOBAL))  # window 4, not 8
    assert rt.model_for(dataclasses.replace(spec, layout=dataclasses.replace(spec.layout, layers=layers))) is None
    # Same config, other weights: no match.
    assert rt.model_for(model_spec_for(_decoder(seed=2), block_tokens=16)) is None
