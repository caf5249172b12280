"""What a model computes, as a hash of its config: part of the identity a worker integration gives a model, with
or without a weights id, so that two engines whose KV differs never share blocks.

Why a config hash and not the checkpoint path alone: the same weights run with another RoPE scaling or theta (a
serving engine's config overrides), another sliding window, or another attention variant compute other K for the
same tokens (RoPE is applied before K is cached). Entries that say how a model was saved or is run, not what it
computes, are left out, so the same weights loaded from their directory hash the same.

A weights id a user gives names the checkpoint, not how it is run, so it never replaces the config hash: it is
joined to it (`with_config`), in the transformers integration and the vLLM connector alike, so the two stacks
still agree on a model they run with the same config and weights id.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

BOOKKEEPING = {"_name_or_path", "name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype",
               "_attn_implementation", "attn_implementation", "_attn_implementation_autoset", "_experts_implementation",
               "use_cache", "return_dict", "output_attentions", "output_hidden_states", "_commit_hash",
               "tie_word_embeddings_autoset"}


def config_hash(config: Mapping[str, Any]) -> hashlib.blake2b:
    """A running BLAKE2b of a model config's dict (bookkeeping left out), for the caller to extend or read."""
    kept = {k: v for k, v in config.items() if k not in BOOKKEEPING}
    return hashlib.blake2b(json.dumps(kept, sort_keys=True, default=str).encode(), digest_size=16)


def with_config(weights_id: str, config: Mapping[str, Any]) -> str:
    """A given weights id as the model's identity: the checkpoint it names and the config it runs with (a RoPE
    theta or scaling override of the same checkpoint computes other K for the same tokens)."""
    return f"{weights_id}#{config_hash(config).hexdigest()}"
