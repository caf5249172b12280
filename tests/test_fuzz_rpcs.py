"""Every RPC driven by hypothesis with malformed, oversized and adversarial messages against a real daemon
(an `engram serve` subprocess with tenancy, an HBM tier on the CPU, DRAM and NVMe): no crash, no INTERNAL
or UNKNOWN, a good client served after every example, its data intact, and `check` finding nothing wrong.

Messages come from each request type's own descriptor, so a new field or RPC is fuzzed without touching
this file: every scalar is drawn from edge values (0, -1, 2^31-1, 2^64-1, NaN, Inf, long and non-ASCII
strings), fields that name things (namespace, fingerprint, keys, session ids) draw from what the daemon
really holds (the good tenant's keys among them) as often as from garbage, and a tenth of the requests are
raw bytes that are no message at all. The attacker is another tenant, an unknown token or no token; the
good tenant's data must come out of it untouched. Bounded (derandomized, a fixed number of examples per RPC)
so it takes seconds, not minutes."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram.block import checksum
from engram.codec import stored
from engram.keys import chain_keys
from engram.v1 import engram_pb2 as pb
from engram.wire import convert

from helpers import BLOCK_TOKENS, ENGRAM, NEUTRAL_CWD, random_kv, tiny_model, tokens, wait_for

GOOD, EVIL, ADMIN = "good-token", "evil-token", "admin-token"
SERVICE = pb.DESCRIPTOR.services_by_name["Engram"]
METHODS = [m.name for m in SERVICE.methods]
CODES: dict[bool, dict[str, dict[str, int]]] = {}  # tenancy -> method -> status code -> count
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE}


@dataclass
class Target:
    proc: subprocess.Popen[str]
    channel: grpc.Channel
    fp: bytes
    good_keys: list[bytes]
    evil_keys: list[bytes]
    good_tokens: np.ndarray
    good_payloads: list[bytes]
    sessions: list[str]
    tenancy: bool

    def call(self, method: str, request: Any, token: str | None, timeout: float = 10.0) -> grpc.StatusCode:
        """One RPC with raw bytes (or a message, or for Put a list of them); returns its status code."""
        md = () if token is None else (("authorization", f"Bearer {token}"),)
        desc = SERVICE.methods_by_name[method]
        path = f"/{SERVICE.full_name}/{method}"
        ser: Callable[[Any], bytes] = lambda m: m if isinstance(m, bytes) else m.SerializeToString()  # noqa: E731
        try:
            if desc.client_streaming:
                self.channel.stream_unary(path, request_serializer=ser)(iter(request), metadata=md, timeout=timeout)
            elif desc.server_streaming:
                for _ in self.channel.unary_stream(path, request_serializer=ser)(request, metadata=md, timeout=timeout):
                    pass
            else:
                self.channel.unary_unary(path, request_serializer=ser)(request, metadata=md, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK


def _good_put(channel: grpc.Channel, fp: bytes, toks: np.ndarray, payloads: list[bytes], ns: str) -> list[bytes]:
    msgs = [pb.PutRequest(header=pb.PutHeader(namespace=ns, model_fingerprint=fp))]
    spec = tiny_model()
    for i, payload in enumerate(payloads):
        t = toks[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]
        header = pb.BlockHeader(tokens=t.tolist(), dtype=pb.DTYPE_BF16, shape=list(spec.layout.block_shape(len(t))),
                                payload_nbytes=len(payload), checksum=checksum(payload), codec="raw")
        msgs.append(pb.PutRequest(chunk=pb.BlockChunk(header=header, data=payload, last=True)))
    token = GOOD if ns == "good" else EVIL
    reply = channel.stream_unary(f"/{SERVICE.full_name}/Put", request_serializer=pb.PutRequest.SerializeToString,
                                 response_deserializer=pb.PutResponse.FromString)(
        iter(msgs), metadata=(("authorization", f"Bearer {token}"),), timeout=30)
    return list(reply.keys)


@pytest.fixture(scope="module", params=["tenancy", "open"])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """A daemon with small tiers (HBM on the CPU, DRAM, NVMe), so hostile puts push blocks through every
    demotion; with tenancy (the attacker is another tenant) or without (the attacker may name anything)."""
    tenancy = request.param == "tenancy"
    tmp = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    sock = tmp / "engram.sock"
    env = {**os.environ, "ENGRAM_TIERS__HBM__CAPACITY": "16KiB", "ENGRAM_TIERS__HBM__DEVICE": "cpu",
           "ENGRAM_TIERS__DRAM__CAPACITY": "32KiB", "ENGRAM_TIERS__DRAM__SHM_DIR": str(tmp),
           "ENGRAM_TIERS__NVME__PATH": str(tmp / "nvme"), "ENGRAM_TIERS__NVME__FSYNC": "false",
           "ENGRAM_SERVER__MAX_MESSAGE_BYTES": "256KiB", "ENGRAM_SERVER__CHUNK_BYTES": "64KiB",
           "ENGRAM_SERVER__MAX_TOKENS_PER_REQUEST": "4096", "ENGRAM_SERVER__MAX_BLOCKS_PER_REQUEST": "64",
           "ENGRAM_SERVER__MAX_BLOCK_BYTES": "1MiB", "ENGRAM_SERVER__MAX_MODELS": "64",
           "ENGRAM_SERVER__MAX_SESSIONS_PER_NAMESPACE": "32"}
    if tenancy:
        env.update({"ENGRAM_AUTH__TENANTS__GOOD__TOKEN": GOOD, "ENGRAM_AUTH__TENANTS__EVIL__TOKEN": EVIL,
                    "ENGRAM_AUTH__TENANTS__EVIL__QUOTA": "256KiB", "ENGRAM_AUTH__ADMIN_TOKENS": ADMIN,
                    "ENGRAM_AUTH__SALT_SECRET": "fuzz-secret"})
    proc = subprocess.Popen([*ENGRAM, "serve", "--unix-socket", str(sock), "--log-level", "error"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=NEUTRAL_CWD)
    address = f"unix:{sock}"
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 8 << 20)])
    try:
        wait_for(address, proc)
        spec = tiny_model()
        register = channel.unary_unary(f"/{SERVICE.full_name}/RegisterModel",
                                       request_serializer=pb.RegisterModelRequest.SerializeToString,
                                       response_deserializer=pb.RegisterModelResponse.FromString)
        for token in (EVIL, GOOD):  # each its own registration: a tenant sees only the models it registered
            fp = register(pb.RegisterModelRequest(model=convert.model_to_pb(spec)),
                          metadata=(("authorization", f"Bearer {token}"),)).model_fingerprint
        toks = tokens(6 * BLOCK_TOKENS, seed=1)
        kv = random_kv(spec, len(toks), seed=1)
        payloads = [stored.encode(kv[:, :, i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS], stored.RAW) for i in range(6)]
        good_keys = _good_put(channel, fp, toks, payloads, "good")
        evil_toks = tokens(3 * BLOCK_TOKENS, seed=2)
        evil_kv = random_kv(spec, len(evil_toks), seed=2)
        evil_keys = _good_put(channel, fp, evil_toks, [stored.encode(evil_kv[:, :, i * 16:(i + 1) * 16], stored.RAW)
                                                       for i in range(3)], "evil")
        t = Target(proc, channel, fp, good_keys, evil_keys, toks, payloads, ["s1", "plan", ""], tenancy)
        for ns, token in (("evil", EVIL), ("good", GOOD)):
            t.channel.unary_unary(f"/{SERVICE.full_name}/OpenSession",
                                  request_serializer=pb.OpenSessionRequest.SerializeToString)(
                pb.OpenSessionRequest(namespace=ns, model_fingerprint=fp, mode=pb.REPLAY_MODE_PERSIST, session_id="plan",
                                      tokens=toks[:32].tolist() if ns == "good" else evil_toks[:32].tolist()),
                metadata=(("authorization", f"Bearer {token}"),))
        yield t
    finally:
        channel.close()
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


# ---- strategies from descriptors ------------------------------------------------------------------

INT32 = st.sampled_from([0, 1, -1, 2, 15, 16, 17, 256, 2**31 - 1, -(2**31)]) | st.integers(-(2**31), 2**31 - 1)
UINT32 = st.sampled_from([0, 1, 2, 16, 17, 4095, 4097, 2**16, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1)
INT64 = st.sampled_from([0, -1, 2**63 - 1, -(2**63)]) | st.integers(-(2**63), 2**63 - 1)
UINT64 = st.sampled_from([0, 1, 4096, 2**32, 2**64 - 1]) | st.integers(0, 2**64 - 1)
DOUBLE = st.sampled_from([0.0, -1.0, 1.0, float("nan"), float("inf"), float("-inf"), 1e308]) | st.floats()
TEXT = st.sampled_from(["", "evil", "good", "a" * 2000, "é" * 600, "\x00", "../../etc", "plan"]) | st.text(max_size=40)
BYTES = st.sampled_from([b"", b"\0" * 16, b"\xff" * 16, b"x" * 300_000]) | st.binary(max_size=64)


def scalar(f: FieldDescriptor, target: Target) -> st.SearchStrategy[Any]:
    t = f.type
    name = f.name
    if name == "namespace":
        return st.sampled_from(["", "evil", "evil", "good", "n" * 1100, "é" * 513, "x" * 70_000]) | TEXT
    if name == "model_fingerprint":
        return st.sampled_from([target.fp, target.fp, b"", b"\0" * 16]) | BYTES
    if name in ("key", "keys", "parent_key"):
        return st.sampled_from(target.good_keys + target.evil_keys) | BYTES
    if name in ("session_id", "key_prefixes"):
        return st.sampled_from(target.sessions + [k.hex()[:6] for k in target.good_keys + target.evil_keys]) | TEXT
    if name == "codec":
        return st.sampled_from(["", "raw", "nvfp4", "mxfp4", "fp8_e4m3", "nope"])
    if t == FieldDescriptor.TYPE_STRING:
        return TEXT
    if t == FieldDescriptor.TYPE_BYTES:
        return BYTES
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32,
             FieldDescriptor.TYPE_ENUM):
        return INT32
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return UINT32
    if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return INT64
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return UINT64
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return DOUBLE if t == FieldDescriptor.TYPE_DOUBLE else st.floats(width=32)
    raise AssertionError(f"no strategy for field {f.full_name} of type {t}")


def plausible_layouts() -> st.SearchStrategy[Message]:
    """The tiny layout with one field pushed to an edge, so RegisterModel gets past its first check."""
    base = convert.layout_to_pb(tiny_model().layout)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = pb.KVLayout()
        msg.CopyFrom(base)
        field = draw(st.sampled_from(["none", "num_kv_heads", "head_dim", "block_tokens", "window", "dtype"]))
        if field in ("num_kv_heads", "head_dim", "block_tokens"):
            setattr(msg, field, draw(st.sampled_from([1, 3, 16, 32, 1024, 4096, 65536])))
        elif field == "window":
            msg.layers[0].window = draw(st.sampled_from([1, 2, 1 << 20]))
        elif field == "dtype":
            msg.dtype = draw(st.sampled_from([1, 2, 3]))
        return msg

    return build()


def plausible_models() -> st.SearchStrategy[Message]:
    return st.builds(lambda w, layout, codec: pb.ModelSpec(name="fuzz", weights_id=w, layout=layout, codec=codec),
                     st.text(min_size=1, max_size=8), plausible_layouts(),
                     st.sampled_from(["", "raw", "nvfp4", "mxfp4", "fp8_e4m3"]))


def message(desc: Descriptor, target: Target, depth: int = 0) -> st.SearchStrategy[Message]:
    if desc.name == "KVLayout":
        return plausible_layouts() | _generic(desc, target, depth)
    if desc.name == "ModelSpec":
        return plausible_models() | _generic(desc, target, depth)
    return _generic(desc, target, depth)


def _generic(desc: Descriptor, target: Target, depth: int) -> st.SearchStrategy[Message]:
    cls = getattr(pb, desc.name)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            if depth >= 3:
                continue
            inner = message(f.message_type, target, depth + 1)
            value = st.lists(inner, max_size=3) if f.is_repeated else inner
        else:
            item = scalar(f, target)
            if f.is_repeated and f.name == "tokens":
                value = st.lists(INT32, max_size=40) | st.sampled_from([list(range(16)), list(range(5000))])
            elif f.is_repeated:
                value = st.lists(item, max_size=8) | st.just([]) if f.name != "shape" else \
                    st.lists(UINT32, max_size=6) | st.sampled_from([[2, 2, 16, 2, 16], [0, 2, 16, 2, 16], [2, 2, 0, 2, 16]])
            else:
                value = item
        fields[f.name] = value

    def build(values: dict[str, Any]) -> Message:
        msg = cls()
        for k, v in values.items():
            f = desc.fields_by_name[k]
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                if f.is_repeated:
                    getattr(msg, k).extend(v)
                else:
                    getattr(msg, k).CopyFrom(v)
            elif f.is_repeated:
                getattr(msg, k).extend(v)
            else:
                setattr(msg, k, v)
        return msg

    return st.fixed_dictionaries({}, optional=fields).map(build)


def plausible_chunks(target: Target) -> st.SearchStrategy[list[Message]]:
    """Put streams close to valid ones (so they get past the first checks): a header, then blocks whose
    headers are right or wrong in one field, with payloads whole, cut short, oversized or garbage."""
    spec = tiny_model()

    @st.composite
    def build(draw: st.DrawFn) -> list[Message]:
        valid = draw(st.booleans())  # every field right: the block is stored, and pushes others down the tiers
        ns = draw(st.sampled_from(["evil", "x" * 70_000, "é" * 600] if valid else ["", "evil", "good", "x" * 1100]))
        parent = b"" if valid else draw(st.sampled_from([b"", *target.evil_keys, *target.good_keys, b"\1" * 16]))
        msgs: list[Message] = [pb.PutRequest(header=pb.PutHeader(namespace=ns, model_fingerprint=target.fp,
                                                                 parent_key=parent, pin=not valid and draw(st.booleans())))]
        for _ in range(draw(st.integers(1 if valid else 0, 3))):
            n = 16 if valid else draw(st.sampled_from([16, 16, 5, 0, 17]))
            payload = b"\0" * 4096 if valid else \
                draw(st.sampled_from([b"\0" * (n * 256), b"\1" * 100, b"", b"\2" * 300_000]))
            header = pb.BlockHeader(tokens=draw(st.lists(INT32, min_size=n, max_size=n)), dtype=pb.DTYPE_BF16,
                                    shape=list(spec.layout.block_shape(n)), payload_nbytes=len(payload),
                                    checksum=checksum(payload),
                                    codec="raw" if valid else draw(st.sampled_from(["raw", "", "nvfp4"])))
            field = "none" if valid else draw(st.sampled_from(["none", "checksum", "payload_nbytes", "dtype", "shape"]))
            if field == "checksum":
                header.checksum ^= 1
            elif field == "payload_nbytes":
                header.payload_nbytes = draw(UINT64)
            elif field == "dtype":
                header.dtype = draw(INT32)
            elif field == "shape":
                header.shape[:] = draw(st.lists(UINT32, max_size=6))
            cut = len(payload) if valid else draw(st.sampled_from([len(payload), 0, len(payload) // 2]))
            msgs.append(pb.PutRequest(chunk=pb.BlockChunk(header=header, data=payload[:cut],
                                                          last=draw(st.booleans()) or cut == len(payload))))
        return msgs

    return build()


def request(method: str, target: Target) -> st.SearchStrategy[Any]:
    desc = SERVICE.methods_by_name[method]
    garbage = st.binary(max_size=256) | st.sampled_from([b"\xff" * 8, b"\x0a\xff\xff\xff\xff\x0f"])
    one = message(desc.input_type, target)
    if desc.client_streaming:
        stream = st.lists(one | garbage, max_size=5) | plausible_chunks(target)
        return stream
    return st.one_of(one, one, one, garbage)


READ_ONLY = {"Lookup", "Get", "Stats", "Check", "ListNamespaces", "ListSessions", "DescribeBlocks", "FetchBlocks",
             "DescribeNamespace"}


def callers(method: str, target: Target) -> st.SearchStrategy[str | None]:
    """With tenancy: mostly the other tenant (to get past authentication); an admin where the call changes
    nothing of the good tenant's (Check without fix mutates nothing valid); unknown tokens and none.
    Without: anyone (a token is ignored)."""
    if not target.tenancy:
        return st.sampled_from([None, None, EVIL])
    known = [EVIL] * 6 + ([ADMIN] * 3 if method in READ_ONLY else [])
    return st.sampled_from([*known, None, "not-a-token", f"{EVIL} ", "x" * 5000])


def good_lookup(target: Target) -> None:
    """The good tenant is served between every two hostile calls, and (tenancy on, where nobody else may
    touch it) sees its whole prefix."""
    if not target.tenancy:
        target.channel.unary_unary(f"/{SERVICE.full_name}/Stats")(b"", timeout=10)
        return
    resp = target.channel.unary_unary(f"/{SERVICE.full_name}/Lookup", request_serializer=pb.LookupRequest.SerializeToString,
                                      response_deserializer=pb.LookupResponse.FromString)(
        pb.LookupRequest(namespace="good", model_fingerprint=target.fp, tokens=target.good_tokens.tolist()),
        metadata=(("authorization", f"Bearer {GOOD}"),), timeout=10)
    assert resp.matched_tokens == len(target.good_tokens)


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_rpc_gives_internal_on_hostile_input(target: Target, method: str, data: st.DataObject) -> None:
    req = data.draw(request(method, target), label="request")
    token = data.draw(callers(method, target), label="token")
    code = target.call(method, req, token)
    seen = CODES.setdefault(target.tenancy, {}).setdefault(method, {})
    seen[code.name] = seen.get(code.name, 0) + 1
    assert code not in BAD_CODES, f"{method} answered {code.name}"
    assert target.proc.poll() is None, "the daemon exited"
    good_lookup(target)


def test_after_the_fuzz_the_daemon_is_whole(target: Target) -> None:
    """Runs after the fuzz above (file order): the good tenant's blocks come back bit for bit, a new put
    and lookup work, and the daemon's own check of every stored copy finds nothing wrong."""
    assert target.proc.poll() is None
    seen = CODES.get(target.tenancy, {})
    if set(seen) == set(METHODS):  # the whole fuzz ran: it must have reached past authentication and decoding
        shallow = [m for m, codes in seen.items() if not set(codes) - {"UNAUTHENTICATED", "INVALID_ARGUMENT"}]
        assert not shallow, f"the fuzz never got past the first checks of {shallow}: {seen}"
    good = target.tenancy  # without tenancy the fuzz may legitimately have evicted the good tenant's blocks
    if good:
        got = []
        for r in target.channel.unary_stream(f"/{SERVICE.full_name}/Get", request_serializer=pb.GetRequest.SerializeToString,
                                             response_deserializer=pb.GetResponse.FromString)(
                pb.GetRequest(namespace="good", model_fingerprint=target.fp, keys=target.good_keys),
                metadata=(("authorization", f"Bearer {GOOD}"),), timeout=30):
            assert r.HasField("chunk")
            got.append(r.chunk.data)
        assert b"".join(got) == b"".join(target.good_payloads)
        # and it can still store (without tenancy the fuzz may have pinned every block of the top tier, which
        # then refuses new blocks with RESOURCE_EXHAUSTED: correct, but no test of a healthy daemon)
        more = tokens(2 * BLOCK_TOKENS, seed=3)
        kv = random_kv(tiny_model(), len(more), seed=3)
        keys = _good_put(target.channel, target.fp, more, [stored.encode(kv[:, :, :16], stored.RAW),
                                                           stored.encode(kv[:, :, 16:], stored.RAW)], "good")
        assert keys == [k for k, _, _ in chain_keys("good", target.fp, more, BLOCK_TOKENS, keys_salt(target))]
    else:
        good_lookup(target)
    report = target.channel.unary_unary(f"/{SERVICE.full_name}/Check", request_serializer=pb.CheckRequest.SerializeToString,
                                        response_deserializer=pb.CheckResponse.FromString)(
        pb.CheckRequest(fix=False), metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=60)
    assert report.scanned > 0 and not list(report.findings), list(report.findings)


def keys_salt(target: Target) -> bytes:
    return target.channel.unary_unary(f"/{SERVICE.full_name}/DescribeNamespace",
                                      request_serializer=pb.DescribeNamespaceRequest.SerializeToString,
                                      response_deserializer=pb.NamespaceStats.FromString)(
        pb.DescribeNamespaceRequest(namespace="good"), metadata=(("authorization", f"Bearer {GOOD}"),)).key_salt

