"""Engram as vLLM's external prefix cache: a KV connector for vLLM's v1 connector interface.

    --kv-transfer-config '{"kv_connector": "EngramConnector",
                           "kv_connector_module_path": "engram.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"address": "unix:/run/engram.sock", "codec": "raw"}}'

The scheduler side asks the daemon how much of each prompt it holds (whole vLLM blocks, never the whole prompt)
and plans loads and saves; the worker side loads the cached prefix straight into vLLM's paged KV cache before
the forward (the client's hit path into the request's blocks) and, in the step a prompt's last token is
computed, gathers the prompt's KV out of its blocks and stores it (docs/INTEGRATIONS.md, "vLLM").

The package imports without vLLM: the logic is in plain classes (config.py, paged.py, scheduler.py, worker.py)
that take vLLM's objects by attribute; `EngramConnector`, the KVConnectorBase_V1 subclass (connector.py),
imports vLLM and is loaded on first use, as vLLM's connector factory does with getattr(module, name).

MLA models (DeepSeek-V2/V3: one 576-wide latent a token and layer in vLLM's cache) are stored as one "latent"
stream (a stream layout, docs/LAYOUTS.md), loaded into and saved out of vLLM's MLA pages like K and V pages.

What it does not do: tensor or pipeline parallelism (refused), vLLM's hybrid KV cache manager (sliding-window
layers keeping only their window), quantized vLLM KV caches (fp8 K/V, fp8_ds_mla latents), the sparse indexer's
cache of DeepSeek-V3.2 and compressed MLA caches (refused), requests with multimodal inputs, LoRA adapters or cache
salts (served and computed as usual, not cached), generated tokens' KV (a prompt's only), asynchronous loads and
saves.
"""

from __future__ import annotations

from typing import Any

from engram.integrations.vllm.config import LATENT, ConnectorConfig, LayerCache, VllmLayers
from engram.integrations.vllm.paged import FromToken, kv_pages, latent_pages, page_table
from engram.integrations.vllm.scheduler import EngramMetadata, EngramScheduler, LoadSpec, SaveSpec
from engram.integrations.vllm.worker import EngramWorker

__all__ = [
    "LATENT",
    "ConnectorConfig",
    "EngramConnector",
    "EngramMetadata",
    "EngramScheduler",
    "EngramWorker",
    "FromToken",
    "LayerCache",
    "LoadSpec",
    "SaveSpec",
    "VllmLayers",
    "kv_pages",
    "latent_pages",
    "page_table",
]


def __getattr__(name: str) -> Any:
    if name in ("EngramConnector", "EngramConnectorMetadata"):
        try:
            from engram.integrations.vllm import connector
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] != "vllm":
                raise
            raise ImportError(f"engram.integrations.vllm.{name} subclasses vLLM's KV connector base class: install "
                              "vllm in this environment (the rest of this package works without it)") from exc
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
