"""What a model computes, as a hash of its config: part of the identity a worker integration gives a model when
it is not told a weights id, so that two engines whose KV differs never share blocks.

Why a config hash and not the checkpoint path alone: the same weights run with another RoPE scaling or theta (a
serving engine's config overrides), another sliding window, or another attention variant compute other K for the
same tokens (RoPE is applied before K is cached). Entries that say how a model was saved or is run, not what it
computes, are left out, so the same weights loaded from their directory hash the same.
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
