"""The daemon's replay runtime: which replay model serves which registered model, and rebuilding a
session's SWA window from the global KV blocks in the store.

A replay model is the in-house reference decoder (a file written by `save_decoder`) or a Hugging Face
checkpoint directory (`engram.replay.hf.load_checkpoint`); both implement ReplayModel and have an identity.

A replay model serves a registered ModelSpec when its weights identity equals the spec's weights_id and
the layout it implies (layer kinds, window, KV heads, head dim, dtype) equals the spec's layout; the
block size and the storage codec are the worker's choice and do not matter here. The worker derives its
ModelSpec with the same function (`model_spec_for`), so both sides agree by construction.

The identity hashes every parameter, so the runtime computes it once per model, when it is built (at
start-up, right after the load), and matches specs against that: OpenSession, Resume and Stats (every
`engram top` tick) only compare strings and layouts.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engram.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.replay.decoder import HybridDecoder
from engram.replay.model import AttentionKind, ReplayError, ReplayModel
from engram.replay.reconstruct import Reconstruction, ReplayMode, reconstruct_swa
from engram.replay.weights import load_decoder

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}

_KIND = {AttentionKind.GLOBAL: LayerKind.GLOBAL, AttentionKind.SLIDING: LayerKind.SLIDING,
         AttentionKind.REINDEX: LayerKind.SHARED, AttentionKind.REUSE: LayerKind.SHARED}


def weights_identity(model: ReplayModel) -> str:
    """A content hash of the config and every parameter: equal models, equal identities. A model that knows
    its own (an HF checkpoint: `HFReplayModel.weights_identity`) says it."""
    own = getattr(model, "weights_identity", None)
    if own is not None:
        return str(own())
    if not isinstance(model, HybridDecoder):
        raise ReplayError(f"{type(model).__name__} has no weights identity; give it a weights_identity() method")
    h = hashlib.blake2b(model.config.to_json().encode(), digest_size=16)
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return f"hybrid:{h.hexdigest()}"


def implied_layout(model: ReplayModel, block_tokens: int = 256) -> KVLayout:
    """The KV layout a worker registers this model with. A ReplayError when no layout can describe it (no
    global layer, as in a Mistral whose every layer slides: nothing to store)."""
    spec = model.replay_spec
    if spec.global_shapes is not None:
        raise ReplayError("the daemon does not replay MLA models yet (their blocks are a stream layout, whose "
                          "sessions keep their window in the worker); replay them in-process with reconstruct_swa")
    if AttentionKind.GLOBAL not in spec.kinds:
        raise ReplayError("every layer of this model slides, so it has no global KV to store and replay from; "
                          "its sessions keep their windows in persist mode (or in the worker)")
    layers = tuple(LayerSpec(_KIND[k], spec.window if k is AttentionKind.SLIDING else 0) for k in spec.kinds)
    try:
        return KVLayout(layers=layers, num_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim,
                        dtype=DType.from_torch(spec.dtype), block_tokens=block_tokens)
    except InvalidArgument as exc:
        raise ReplayError(f"a replay model with layers {[k.value for k in spec.kinds]} in {spec.dtype} cannot "
                          f"serve any model a worker can register: {exc}") from exc


def model_spec_for(model: ReplayModel, *, name: str = "hybrid", block_tokens: int = 256, codec: str = "raw"
                   ) -> ModelSpec:
    """The ModelSpec a worker registers for this model (and the daemon matches its replay models by)."""
    return ModelSpec(name=name, weights_id=weights_identity(model), layout=implied_layout(model, block_tokens),
                     codec=codec)


@dataclass(frozen=True)
class ReplayIdentity:
    """What a registered ModelSpec must carry for a replay model to serve it."""

    weights_id: str  # weights_identity: config and every parameter
    layout: KVLayout  # implied_layout at the default block size; `serves` ignores block_tokens

    @classmethod
    def of(cls, model: ReplayModel) -> ReplayIdentity:
        """Reads every parameter of the model: once per model, at load, not per request."""
        layout = implied_layout(model)  # first: a model no spec can describe is refused before it is hashed
        return cls(weights_identity(model), layout)

    def serves(self, spec: ModelSpec) -> bool:
        return (spec.weights_id == self.weights_id
                and dataclasses.replace(spec.layout, block_tokens=self.layout.block_tokens) == self.layout)


@dataclass
class ReplayCounters:
    replays: int = 0
    replayed_tokens: int = 0
    token_layers: int = 0
    seconds: float = 0.0


class ReplayRuntime:
    """The replay models this daemon can run, loaded once at start-up and never changed after.

    Each model's identity is computed here, once, and every match is against it. That is sound because
    replay models are not mutated: the daemon loads them from files at start-up and only runs them
    (HybridDecoder turns gradients off and runs its forward in inference mode); nothing trains them or swaps
    their weights. A model changed in place after this would keep matching by its load-time identity, so
    don't: to serve other weights, start the daemon with their file (or build a new runtime).
    """

    def __init__(self, models: Sequence[ReplayModel] = (), *, sources: Sequence[str] = ()) -> None:
        """`sources` names the models in errors (their files); a model no registered model could ever match
        is refused here, at start-up, rather than failing every OpenSession, Resume and Stats later."""
        served = []
        for i, model in enumerate(models):
            try:
                served.append((ReplayIdentity.of(model), model))
            except ReplayError as exc:
                where = sources[i] if i < len(sources) else f"replay model {i}"
                raise ReplayError(f"{where}: {exc}") from exc
        self._served: tuple[tuple[ReplayIdentity, ReplayModel], ...] = tuple(served)
        self.counters = ReplayCounters()

    @property
    def models(self) -> tuple[ReplayModel, ...]:
        return tuple(model for _, model in self._served)

    @property
    def identities(self) -> tuple[ReplayIdentity, ...]:
        """Each model's identity as computed at construction, in the order of `models`."""
        return tuple(identity for identity, _ in self._served)

    @classmethod
    def from_paths(cls, paths: Sequence[str | Path], device: str = "auto", dtype: str = "auto") -> ReplayRuntime:
        """Each path is a decoder file (save_decoder) or an HF checkpoint directory, loaded on `device` in
        `dtype` (auto: a checkpoint in bfloat16 on CUDA and float32 on the CPU; a decoder file as saved)."""
        dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        if dtype != "auto" and dtype not in _DTYPES:
            raise ReplayError(f"replay.dtype must be auto or one of {sorted(_DTYPES)}, not {dtype!r}")
        want = _DTYPES.get(dtype)
        models: list[ReplayModel] = []
        for p in paths:
            if Path(p).is_dir():
                from engram.replay.hf import load_checkpoint

                models.append(load_checkpoint(p, device=dev, dtype=want))
            else:
                decoder = load_decoder(p, device=dev)
                if want is not None and want != decoder.config.dtype:
                    raise ReplayError(f"{p} holds a {decoder.config.dtype} decoder; replay.dtype {dtype} applies "
                                      "to checkpoint directories (save the decoder in that dtype instead)")
                models.append(decoder)
        return cls(models, sources=[str(p) for p in paths])

    def model_for(self, spec: ModelSpec) -> ReplayModel | None:
        return next((model for identity, model in self._served if identity.serves(spec)), None)

    def require(self, spec: ModelSpec) -> ReplayModel:
        model = self.model_for(spec)
        if model is None:
            raise FailedPrecondition(
                f"this daemon has no replay model for {spec.name} (weights_id {spec.weights_id}): it cannot "
                "rebuild its sliding-window KV; load the weights with replay.models, or open the session in "
                "persist mode"
            )
        return model

    def rebuild(self, model: ReplayModel, tokens: torch.Tensor, global_kv: torch.Tensor, mode: ReplayMode
                ) -> Reconstruction:
        """Replay against stored global KV (stored_layers, 2, P, H, D); CPU or GPU work, run in a thread.
        Out of device memory (other sessions' replays, the serving engine beside it): the memory this replay
        took is given back and ResourceExhausted says so; the caller's Resume fails like a miss (the worker
        prefills) and the daemon goes on."""
        try:
            device = model.device
            kv = global_kv.to(device=device, dtype=model.replay_spec.dtype)
            return reconstruct_swa(model, tokens.to(device), kv, mode)
        except torch.OutOfMemoryError as exc:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            raise ResourceExhausted(
                f"replaying {len(tokens)} tokens ran out of memory on {model.device} ({str(exc).splitlines()[0]}); "
                "retry later, prefill the prefix instead, or give replay.device more free memory") from None
