"""Block identity: content-addressed, chained block keys.

    key_0 = H(root(namespace, fingerprint) || tokens_0)
    key_i = H(key_{i-1} || tokens_i)

The namespace, the model fingerprint and the namespace's secret salt enter through the chain's root, so
every key of a chain depends on all three: two tenants, or two models, never produce the same key for the
same tokens, and a tenant who does not hold another namespace's salt cannot compute that namespace's keys
(so it cannot name them in a Get or a Pin, nor match them in a shared cluster index). The salt is empty
when tenancy is off; engram/tenancy.py derives it from the daemon's secret when it is on.

Hash choice: BLAKE2b with a 16-byte digest (hashlib, no extra dependency). A predictable non-cryptographic
hash (xxhash, Python's hash) lets anyone who can submit tokens craft two token blocks with the same key and
so poison or probe another session's chain; a cryptographic hash makes that infeasible. 128 bits keeps
accidental collisions negligible (birthday bound ~2^64 blocks) and the key small in every index. The cost,
about 1 GB/s per core, is far below the cost of the KV bytes a block carries. Even so a key match is only a
hint: the store compares the stored tokens before it reports a hit.

The seed is fixed and versioned (not random per process, not Python's salted hash()), so every process on
every node computes the same keys and prefixes written by one daemon match in another. Changing the key
function means a new KEY_VERSION, which changes every key: old blocks simply stop matching.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

KEY_VERSION = 1
KEY_BYTES = 16
# Fixed seed for key_{-1}; part of the wire contract between daemons (see module docstring).
_SEED = hashlib.blake2b(b"engram/block-key/v1", digest_size=KEY_BYTES).digest()
_TOKEN_DTYPE = np.dtype("<i4")


def _tokens_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a flat sequence, got shape {arr.shape}")
    return arr.astype(_TOKEN_DTYPE, copy=False).tobytes()


def root_key(namespace: str, model_fingerprint: bytes, salt: bytes = b"") -> bytes:
    """The chain's parent before block 0: binds the namespace, its salt and the model into every key."""
    h = hashlib.blake2b(_SEED, digest_size=KEY_BYTES)
    ns = namespace.encode("utf-8")
    # Length-prefix both fields so ("ab", "c") and ("a", "bc") cannot collide.
    h.update(len(ns).to_bytes(4, "little"))
    h.update(ns)
    h.update(len(model_fingerprint).to_bytes(4, "little"))
    h.update(model_fingerprint)
    if salt:  # appended last: an empty salt keeps an untenanted daemon's keys (and NVMe files) as they were
        h.update(len(salt).to_bytes(4, "little"))
        h.update(salt)
    return h.digest()


def block_key(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """Key of one block given its parent's key (or the root key) and the block's tokens."""
    return block_key_of_bytes(parent, _tokens_bytes(tokens))


def block_key_of_bytes(parent: bytes, data: bytes) -> bytes:
    """`block_key` of tokens given as int32 little-endian bytes (the trace replayer's blocks)."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(len(data).to_bytes(4, "little"))  # a partial block differs from a full one with more tokens
    h.update(data)
    return h.digest()


def chain_keys(
    namespace: str, model_fingerprint: bytes, tokens: Sequence[int] | np.ndarray, block_tokens: int,
    salt: bytes = b"",
) -> Iterator[tuple[bytes, int, int]]:
    """Yield (key, start, end) for each block of a token sequence; the last block may be partial."""
    arr = np.asarray(tokens, dtype=_TOKEN_DTYPE)
    parent = root_key(namespace, model_fingerprint, salt)
    for start in range(0, len(arr), block_tokens):
        end = min(start + block_tokens, len(arr))
        parent = block_key(parent, arr[start:end])
        yield parent, start, end


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Canonical byte form of tokens (int32 little-endian), used to store and compare them."""
    return _tokens_bytes(tokens)
