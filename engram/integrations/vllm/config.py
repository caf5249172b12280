"""What the vLLM connector is told (kv_connector_extra_config) and what it derives: the model's Engram ModelSpec
from the layers of vLLM's KV cache.

Plain data and checks, no vLLM import: engram/integrations/vllm/connector.py reads vLLM's VllmConfig and
KVCacheConfig into `LayerCache` rows, and everything from there on is tested without vLLM installed.

Every layer vLLM keeps a KV cache for is stored per block, as a global layer: with the hybrid KV cache manager
off (vLLM turns it off for a connector that does not support it), a sliding-window layer's cache holds every
token like a full one, so its blocks can be loaded as they were computed. An MLA model's layers (one latent entry
per token and layer, kv_lora_rank + rope dims: 576 for DeepSeek-V2/V3) are stored as one "latent" stream of that
width (a stream layout, engram/layout.py: block format v2), in the model's codec.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engram.errors import ConfigError, InvalidArgument
from engram.integrations.identity import with_config
from engram.layout import Axis, DType, KVLayout, LayerKind, LayerSpec, ModelSpec, StreamSpec
from engram.wire.deadline import DEFAULT_TIMEOUT_S, checked

LATENT = "latent"  # the stream an MLA model's cache entries are stored as


def _read_root_cert(path: str) -> bytes:
    """The PEM root certificate at `path`; a path that cannot be read, or a file that is no certificate, refused
    naming the key and the path (it raised a bare FileNotFoundError when the connector made its client)."""
    where = f"kv_connector_extra_config['root_cert'] = {path!r}"
    try:
        pem = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise InvalidArgument(f"{where} is not a PEM certificate: give the certificate that signed the daemon's")
    return pem


def _parse(value: Any, kind: str) -> Any:
    """A kv_connector_extra_config value (JSON, or a string from a command line) as its field's type."""
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return str(value).lower() in ("true", "1", "yes", "on")
        raise ValueError(value)
    if kind == "bytes":  # 2GiB, 512MB or an integer, as the daemon's config takes sizes
        from engram.config import parse_bytes

        return int(parse_bytes(value))
    if kind == "float":
        if isinstance(value, bool):
            raise ValueError(value)
        return float(value)
    if kind == "int":
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(value)
        return int(value)
    return str(value)


@dataclass(frozen=True)
class ConnectorConfig:
    """kv_connector_extra_config, checked: an unknown key is refused (a misspelt one would silently fall back to
    its default). A key given as null (JSON's) is unset: its default, or what is derived from vLLM's config (it
    became the string "None": a weights id "None" in place of vLLM's checkpoint identity, a namespace "None")."""

    address: str  # the daemon: unix:/path/engram.sock (same host: the zero-copy paths) or host:port
    namespace: str = "default"
    token: str = ""  # the tenant's bearer token, when the daemon has tenancy on
    root_cert: str = ""  # path to a PEM root certificate, for a daemon serving TLS
    codec: str = ""  # "" = the daemon's default (nvfp4); "raw" keeps the KV bit for bit
    block_tokens: int = 256  # Engram's block: a multiple of vLLM's block_size
    name: str = ""  # the model's name in Engram; "" = its Hugging Face model_type
    weights_id: str = ""  # the checkpoint's identity; "" = vLLM's model path or id, revision and quantization
    # (either way joined to the hash of the HF config the engine runs: model_spec)
    async_saves: bool = True  # puts run in a background thread on a second client; false: within the step
    max_pending_bytes: int = 2 << 30  # async saves' buffers (each its prompt's KV, on the GPU) queued or running
    # the longest a client call waits on the daemon (engram/wire/deadline.py): past it a lookup or load is a miss,
    # a save a counted failure, where a hung daemon held vLLM's scheduler loop or step for as long as it hung
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise InvalidArgument(f"kv_connector_extra_config has unknown keys {unknown}; Engram's connector takes "
                                  f"{sorted(known)}")
        extra = {key: value for key, value in extra.items() if value is not None}
        if not extra.get("address"):
            raise InvalidArgument("kv_connector_extra_config needs 'address', the Engram daemon "
                                  "(unix:/path/engram.sock or host:port)")
        values: dict[str, Any] = {}
        for key, value in extra.items():
            kind: Any = "bytes" if key.endswith("_bytes") else known[key].type
            try:
                values[key] = _parse(value, kind)
            except (TypeError, ValueError, ConfigError):
                raise InvalidArgument(f"kv_connector_extra_config[{key!r}] must be {kind}, got {value!r}") from None
        if values.get("max_pending_bytes", 1) < 1:
            raise InvalidArgument("kv_connector_extra_config['max_pending_bytes'] must be positive")
        if "timeout_s" in values:
            try:
                values["timeout_s"] = checked(values["timeout_s"])
            except InvalidArgument as exc:
                raise InvalidArgument(f"kv_connector_extra_config['timeout_s']: {exc}") from None
        if values.get("root_cert"):
            _read_root_cert(values["root_cert"])  # refused now, not when the first client is made
        return cls(**values)

    def client(self) -> Any:
        """A SyncEngramClient for this daemon: vLLM's connector hooks are synchronous."""
        from engram.client import SyncEngramClient

        cert = _read_root_cert(self.root_cert) if self.root_cert else None
        return SyncEngramClient(self.address, namespace=self.namespace, token=self.token, root_cert=cert,
                                timeout_s=self.timeout_s)

    def save_client(self, spec: ModelSpec) -> Any:
        """The second client async saves put on, with the model registered; None when async_saves is off."""
        if not self.async_saves:
            return None
        client = self.client()
        client.register_model(spec)
        return client

    def engine_model_spec(self, layers: VllmLayers, model_config: Any) -> ModelSpec:
        """The model as the connector registers it for an engine: `model_spec` of vLLM's ModelConfig
        (`model_defaults`)."""
        name, weights_id, hf_config = model_defaults(model_config)
        return self.model_spec(layers, name=name, weights_id=weights_id, hf_config=hf_config)

    def model_spec(self, layers: VllmLayers, *, name: str, weights_id: str,
                   hf_config: Mapping[str, Any] | None = None) -> ModelSpec:
        """The model as Engram registers it. `name` and `weights_id` are the defaults from vLLM's model config
        (`model_defaults`); the connector config's own win. hf_config: the HF config as the engine runs it, whose
        hash joins the weights id, a given one too (identity.with_config): a weights id names the checkpoint, and
        the same checkpoint run with another RoPE theta or scaling (--hf-overrides) computes other K."""
        try:
            dtype = DType.from_torch(layers.dtype)
        except InvalidArgument:
            raise InvalidArgument(f"vLLM's KV cache is {layers.dtype}; Engram stores bfloat16, float16 or float32 KV "
                                  "(and codes it itself): run vLLM with kv_cache_dtype='auto'") from None
        if self.block_tokens % layers.block_size:
            raise InvalidArgument(f"block_tokens={self.block_tokens} must be a multiple of vLLM's block_size "
                                  f"({layers.block_size}): a loaded Engram block fills whole vLLM blocks")
        every = (LayerSpec(LayerKind.GLOBAL),) * len(layers.names)
        if layers.mla:  # one latent a token and layer: the transformers integration's layout of an MLA model
            layout = KVLayout(layers=every, dtype=dtype, block_tokens=self.block_tokens, streams=layers.streams)
        else:
            layout = KVLayout(layers=every, num_kv_heads=layers.num_kv_heads, head_dim=layers.head_dim, dtype=dtype,
                              block_tokens=self.block_tokens)
        weights = self.weights_id or weights_id
        if hf_config is not None:
            weights = with_config(weights, hf_config)
        return ModelSpec(self.name or name, weights, layout, self.codec)


@dataclass(frozen=True)
class LayerCache:
    """One layer's KV cache as vLLM's KVCacheConfig describes it."""

    name: str  # vLLM's layer name, e.g. model.layers.3.self_attn.attn
    kind: str  # "full", "mla", or what Engram refuses: "sliding" (hybrid manager on), another spec's name
    num_kv_heads: int  # 1 for an MLA layer
    head_dim: int  # an MLA layer's: the latent's width (kv_lora_rank + rope dims)
    head_dim_v: int
    dtype: torch.dtype
    block_size: int  # tokens per vLLM block id


def _layer_index(name: str) -> int:
    """The layer's number in its name (model.layers.12.self_attn.attn -> 12): blocks carry layers in model order."""
    numbers = re.findall(r"\d+", name)
    return int(numbers[0]) if numbers else -1


@dataclass(frozen=True)
class VllmLayers:
    """The layers whose KV Engram stores for a vLLM engine, in the order a block carries them, and their shape
    (an MLA model's: one head of the latent's width, `mla` set)."""

    names: tuple[str, ...]
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    mla: bool = False

    @classmethod
    def from_caches(cls, caches: Sequence[LayerCache]) -> VllmLayers:
        if not caches:
            raise InvalidArgument("vLLM's KV cache config lists no attention layer: nothing for Engram to store")
        kinds = {c.kind for c in caches}
        if "mla" in kinds and kinds != {"mla"}:
            raise InvalidArgument(f"vLLM's KV cache mixes MLA layers with {sorted(kinds - {'mla'})} ones; Engram's "
                                  "vLLM connector stores a model whose layers are all MLA or all full attention")
        for c in caches:
            if c.kind == "mla":
                if c.num_kv_heads != 1:
                    raise InvalidArgument(f"layer {c.name}: an MLA cache of {c.num_kv_heads} heads; vLLM's MLA keeps one "
                                          "latent a token")
                continue
            if c.kind == "sliding":
                raise InvalidArgument(f"layer {c.name} keeps only a sliding window (vLLM's hybrid KV cache manager); "
                                      "run vLLM with --disable-hybrid-kv-cache-manager so every layer holds all tokens")
            if c.kind != "full":
                raise InvalidArgument(f"layer {c.name}'s KV cache is {c.kind}; Engram's vLLM connector stores full "
                                      "attention and MLA layers only")
            if c.head_dim_v != c.head_dim:
                raise InvalidArgument(f"layer {c.name} has K head dim {c.head_dim} and V head dim {c.head_dim_v}; "
                                      "Engram stores K and V of one shape")
        shapes = {(c.num_kv_heads, c.head_dim, c.dtype, c.block_size) for c in caches}
        if len(shapes) != 1:
            raise InvalidArgument(f"vLLM's attention layers differ in (kv heads, head dim, dtype, block size): "
                                  f"{sorted(shapes, key=str)}; Engram's layout has one shape for every layer")
        heads, head_dim, dtype, block_size = shapes.pop()
        names = tuple(c.name for c in sorted(caches, key=lambda c: _layer_index(c.name)))
        return cls(names, heads, head_dim, dtype, block_size, mla=kinds == {"mla"})

    @property
    def streams(self) -> tuple[StreamSpec, ...]:
        """An MLA model's one stream: the latent, grouped along it (like V), in the model's codec. () for K/V."""
        if not self.mla:
            return ()
        return (StreamSpec(LATENT, (self.head_dim,), DType.from_torch(self.dtype), "", Axis.TOKEN),)


def model_defaults(model_config: Any) -> tuple[str, str, dict[str, Any] | None]:
    """From vLLM's ModelConfig: the model's name and weights identity in Engram when the connector config names
    none (the checkpoint, its revision and quantization), and its HF config as the engine runs it (with
    --hf-overrides applied: a RoPE scaling or theta changes every K), for `ConnectorConfig.model_spec` to hash."""
    if model_config is None:
        return "vllm-model", "vllm:unknown", None
    hf = model_config.hf_config
    name = getattr(hf, "model_type", "") or "vllm-model"
    weights = f"vllm:{model_config.model}@{model_config.revision or ''}"
    if model_config.quantization:
        weights += f"+{model_config.quantization}"
    return name, weights, hf.to_dict()
