import numpy as np
import pytest

from engram import keys

FP = bytes(range(16))


def test_key_is_deterministic_and_pinned() -> None:
    # The key function is a wire contract between daemons: this vector must never change within
    # KEY_VERSION 1. If it does, every stored prefix stops matching across nodes and restarts.
    got = [k.hex() for k, _, _ in keys.chain_keys("ns", FP, np.arange(40), 16)]
    again = [k.hex() for k, _, _ in keys.chain_keys("ns", FP, np.arange(40), 16)]
    assert got == again
    assert got[0] == keys.block_key(keys.root_key("ns", FP), np.arange(16)).hex()
    assert keys.KEY_VERSION == 1
    assert got[0] == PINNED_FIRST_KEY


PINNED_FIRST_KEY = "41b29750c22feae8a4858e61574d395b"


def test_pinned_vector_matches_independent_blake2b() -> None:
    import hashlib

    seed = hashlib.blake2b(b"engram/block-key/v1", digest_size=16).digest()
    h = hashlib.blake2b(seed, digest_size=16)
    h.update((2).to_bytes(4, "little") + b"ns" + (16).to_bytes(4, "little") + FP)
    root = h.digest()
    h2 = hashlib.blake2b(root, digest_size=16)
    data = np.arange(16, dtype="<i4").tobytes()
    h2.update(len(data).to_bytes(4, "little") + data)
    assert h2.hexdigest() == PINNED_FIRST_KEY


def test_chain_depends_on_every_previous_block() -> None:
    a = np.arange(48)
    b = a.copy()
    b[3] = 999  # change one token in block 0
    ka = [k for k, _, _ in keys.chain_keys("ns", FP, a, 16)]
    kb = [k for k, _, _ in keys.chain_keys("ns", FP, b, 16)]
    assert all(x != y for x, y in zip(ka, kb, strict=True))


@pytest.mark.parametrize(("ns2", "fp2"), [("other", FP), ("ns", bytes(16))])
def test_namespace_and_model_are_inside_every_key(ns2: str, fp2: bytes) -> None:
    t = np.arange(64)
    k1 = {k for k, _, _ in keys.chain_keys("ns", FP, t, 16)}
    k2 = {k for k, _, _ in keys.chain_keys(ns2, fp2, t, 16)}
    assert not k1 & k2


def test_partial_block_key_differs_from_longer_block() -> None:
    root = keys.root_key("ns", FP)
    assert keys.block_key(root, np.arange(10)) != keys.block_key(root, np.arange(16))
    spans = [(s, e) for _, s, e in keys.chain_keys("ns", FP, np.arange(40), 16)]
    assert spans == [(0, 16), (16, 32), (32, 40)]


def test_namespace_field_boundaries_do_not_collide() -> None:
    assert keys.root_key("ab", b"c") != keys.root_key("a", b"bc")


def test_token_dtype_does_not_change_keys() -> None:
    t = np.arange(16)
    assert keys.block_key(b"p", t.astype(np.int64)) == keys.block_key(b"p", t.astype(np.int32))
    with pytest.raises(ValueError, match="flat"):
        keys.block_key(b"p", np.zeros((2, 8)))
