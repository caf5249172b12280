"""`EngramConnector`: vLLM's v1 KV connector interface (KVConnectorBase_V1) over EngramScheduler and EngramWorker.

This module imports vLLM; engram.integrations.vllm imports it only when vLLM's factory (or a user) asks for
EngramConnector. Everything here reads vLLM's objects into Engram's plain ones and delegates: the logic lives in
scheduler.py and worker.py, which are tested without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engram.errors import InvalidArgument
from engram.integrations.registration import Registration
from engram.integrations.vllm.config import ConnectorConfig, LayerCache, VllmLayers
from engram.integrations.vllm.scheduler import EngramMetadata, EngramScheduler
from engram.integrations.vllm.worker import EngramWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Engram's tiers as vLLM's hit sources: its HBM pool is on the device, DRAM is host memory, NVMe is disk, and a
# block fetched from a peer daemon (cluster) came over the network.
_SOURCES = {"hbm": CacheHitSource.DEVICE, "dram": CacheHitSource.HOST, "nvme": CacheHitSource.DISK}


@dataclass
class EngramConnectorMetadata(EngramMetadata, KVConnectorMetadata):
    """EngramMetadata as vLLM passes it from its scheduler to its workers."""


def _kind(spec: Any) -> str:
    if isinstance(spec, MLAAttentionSpec):  # before FullAttentionSpec: it subclasses it
        if str(getattr(spec, "cache_role", "sparse")) == "indexer":
            return "the sparse indexer's keys (DeepSeek-V3.2)"
        if getattr(spec, "tokens_per_state", 1) != 1:
            return f"compressed MLA ({spec.tokens_per_state} tokens an entry)"
        return "mla"
    if isinstance(spec, FullAttentionSpec):
        return "full"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding"
    return type(spec).__name__


def layer_caches(kv_cache_config: KVCacheConfig) -> list[LayerCache]:
    """Every layer of vLLM's KV cache config, as Engram's plain rows."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise InvalidArgument(f"vLLM's KV cache has {len(groups)} groups; Engram's connector takes one (every layer "
                              "full attention, the hybrid KV cache manager off: --disable-hybrid-kv-cache-manager)")
    rows = []
    group = groups[0]
    for name in group.layer_names:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[name]
        kind = _kind(spec)
        quantized = getattr(spec, "kv_quant_mode", None)  # KVQuantMode.NONE is 0
        if kind == "mla":  # an fp8 latent cache (fp8, fp8_ds_mla) names itself here
            quantized = getattr(spec, "cache_dtype_str", None) not in (None, "auto", "bfloat16", "float16")
        if kind in ("full", "mla") and quantized:
            raise InvalidArgument("vLLM's KV cache is quantized (kv_cache_dtype); Engram stores bfloat16, float16 or "
                                  "float32 KV and codes it itself: run vLLM with kv_cache_dtype='auto'")
        heads = getattr(spec, "num_kv_heads", 0)
        head_dim = getattr(spec, "head_size", 0)
        rows.append(LayerCache(name, kind, heads, head_dim, getattr(spec, "head_size_v", head_dim) or head_dim,
                               getattr(spec, "dtype", torch.uint8), spec.block_size))
    return rows


def _check_supported(vllm_config: VllmConfig) -> None:
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
        raise InvalidArgument(
            f"Engram's vLLM connector stores one worker's whole KV: tensor_parallel_size={pc.tensor_parallel_size} "
            f"and pipeline_parallel_size={pc.pipeline_parallel_size} split it across workers; run with both at 1 "
            "(per-rank models are not built yet)")


class EngramConnector(KVConnectorBase_V1):
    """Engram as vLLM's external prefix cache. Attach with kv_transfer_config = {"kv_connector": "EngramConnector",
    "kv_connector_module_path": "engram.integrations.vllm", "kv_role": "kv_both", "kv_connector_extra_config":
    {"address": "unix:/run/engram.sock", ...}} (docs/INTEGRATIONS.md)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _check_supported(vllm_config)
        config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.layers = VllmLayers.from_caches(layer_caches(kv_cache_config))
        self.spec = config.engine_model_spec(self.layers, vllm_config.model_config)
        self.client = config.client()
        self.model = Registration(self.client, self.spec)  # registered again if the daemon forgets it
        self.fingerprint: bytes = self.model.register()  # now: an unreachable daemon fails vLLM's start
        self.scheduler: EngramScheduler | None = None
        self.worker: EngramWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = EngramScheduler(self.model, self.layers.block_size, namespace=config.namespace)
        else:
            self.worker = EngramWorker(self.model, self.layers, namespace=config.namespace,
                                       save_client=config.save_client(self.spec),
                                       max_pending_bytes=config.max_pending_bytes)

    @property
    def requires_kv_delivery(self) -> bool:
        """A save that does not happen is a later miss, not lost data: preempted requests need not recompute."""
        return False

    def _sched(self) -> EngramScheduler:
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side method was called on a worker-side EngramConnector")
        return self.scheduler

    def _work(self) -> EngramWorker:
        if self.worker is None:
            raise RuntimeError("a worker-side method was called on a scheduler-side EngramConnector")
        return self.worker

    def _meta(self) -> EngramMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, EngramMetadata)
        return meta

    # ---- scheduler side ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        out: dict[CacheHitSource, int] = {}
        for tier, n in self._sched().hit_tiers(request, num_external_tokens).items():
            source = _SOURCES.get(tier, CacheHitSource.P2P)
            out[source] = out.get(source, 0) + n
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._sched().build_meta(scheduler_output)
        return EngramConnectorMetadata(loads=meta.loads, saves=meta.saves)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    # ---- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are complete when start_load_kv returns."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self._work().save_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        self._work().wait_for_save(self._meta())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()  # the saves in flight are finished first
        self.client.close()
