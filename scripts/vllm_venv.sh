#!/usr/bin/env bash
# A scratch venv with vLLM's Python code on a CPU-only machine, to run tests/test_integration_vllm.py against vLLM's
# real classes (its KV connector base class, VllmConfig, KVCacheConfig, Request, SchedulerOutput, the KV cache
# allocator). vLLM is installed without its dependencies (no CUDA torch); the modules the connector path imports
# are added one by one. Nothing here runs a vLLM server or a model.
#
#   scripts/vllm_venv.sh [VENV]          # default /tmp/vllm-venv; then:
#   VENV/bin/pytest -q tests/test_integration_vllm.py    # from the repository root
set -euo pipefail
VENV=${1:-/tmp/vllm-venv}
REPO=$(cd "$(dirname "$0")/.." && pwd)
VLLM_VERSION=${VLLM_VERSION:-0.34.0}

python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
# torch stays the local CPU build; vLLM stays the version installed without dependencies.
printf 'torch==2.13.0\nvllm==%s\n' "$VLLM_VERSION" > "$pins"
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps "vllm==$VLLM_VERSION"
# What vllm.distributed.kv_transfer, vllm.config and vllm.v1.worker import, found by importing them.
"${PIP[@]}" -c "$pins" packaging psutil pyzmq urllib3 regex numpy pydantic "transformers>=5.16.1,<5.23" \
    aiohttp requests pillow pybase64 cachetools cbor2 msgspec cloudpickle uvloop py-cpuinfo prometheus-client \
    llguidance xgrammar einops
# Engram without the resolver touching the two pins above.
"${PIP[@]}" --no-deps -e "$REPO"
"${PIP[@]}" -c "$pins" "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1" \
    "protobuf>=7.35.1" "redis>=5.2" "aiofiles>=24.1" "lz4>=4.3" "xxhash>=3.5" "typer>=0.15" "rich>=13.9" \
    "safetensors>=0.5" "sortedcontainers>=2.4" "triton>=3.4" pytest pytest-asyncio pytest-timeout hypothesis pyyaml
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "
import vllm, torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
print('vllm', vllm.__version__, 'torch', torch.__version__, 'connector base imports')"
