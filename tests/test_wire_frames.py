"""The Get stream's hand-built GetResponse frames, the Put's and the Resume's (engram/wire/stream.py) parse to
exactly the messages protobuf would build, for every size around the chunk boundaries."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from engram.v1 import engram_pb2 as pb
from engram.wire.stream import bytes_frames, chunk_frames, pieces


def built(key: bytes, header: pb.BlockHeader, payload: bytes, step: int) -> list[pb.GetResponse]:
    return [pb.GetResponse(chunk=pb.BlockChunk(header=header, key=key, data=piece, last=last) if i == 0 else
                           pb.BlockChunk(data=piece, last=last))
            for i, (piece, last) in enumerate(pieces(payload, step))]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 5000), step=st.integers(1, 2100), key=st.binary(max_size=40),
       tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300))
def test_frames_parse_to_the_messages_protobuf_builds(n: int, step: int, key: bytes, tokens: list[int]) -> None:
    payload = os.urandom(n)
    header = pb.BlockHeader(tokens=tokens, dtype=1, shape=[1, 2, len(tokens)], payload_nbytes=n, checksum=2**63 + 5,
                            codec="raw")
    frames = list(chunk_frames(1, key, header.SerializeToString(), memoryview(payload), step))
    assert [pb.GetResponse.FromString(f) for f in frames] == built(key, header, payload, step)
    assert b"".join(pb.GetResponse.FromString(f).chunk.data for f in frames) == payload


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 3000), step=st.integers(1, 1100))
def test_put_frames_parse_to_the_put_requests_protobuf_builds(n: int, step: int) -> None:
    payload = os.urandom(n)
    header = pb.BlockHeader(tokens=[1, 2, 3], dtype=1, shape=[1, 2, 3], payload_nbytes=n, checksum=7, codec="nvfp4")
    frames = list(chunk_frames(2, b"", header.SerializeToString(), payload, step))
    want = [pb.PutRequest(chunk=pb.BlockChunk(header=header, data=piece, last=last) if i == 0 else
                          pb.BlockChunk(data=piece, last=last)) for i, (piece, last) in enumerate(pieces(payload, step))]
    assert [pb.PutRequest.FromString(f) for f in frames] == want


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 3000), step=st.integers(1, 1100))
def test_resume_frames_parse_to_the_resume_responses_protobuf_builds(n: int, step: int) -> None:
    payload = os.urandom(n)
    for field, item in ((2, "window_chunk"), (3, "global_kv_chunk")):
        frames = list(bytes_frames(field, memoryview(payload), step))
        want = [pb.ResumeResponse(**{item: piece}) for piece, _ in pieces(payload, step)]
        assert [pb.ResumeResponse.FromString(f) for f in frames] == want
        assert all(pb.ResumeResponse.FromString(f).WhichOneof("item") == item for f in frames)
