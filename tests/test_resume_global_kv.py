"""The client's assembly of a Resume's global KV from the messages a daemon sends (engram/client.py `_GlobalKV`):
block by block, as daemons send it now; whole, under one checksum, as daemons before
ResumeRequest.global_kv_by_block sent it; and a stream whose blocks do not add up to the header's is DataLoss."""

from __future__ import annotations

import pytest
import torch

from engram import errors
from engram.block import checksum
from engram.client import _GlobalKV
from engram.layout import DType
from engram.v1 import engram_pb2 as pb
from engram.wire.stream import pieces

SHAPE = (2, 2, 37, 3, 4)  # (stored layers, 2, position, kv heads, head dim)


def header(kv: torch.Tensor, with_checksum: bool = False) -> pb.GlobalKVData:
    data = kv.contiguous().view(torch.uint8).numpy().tobytes()
    return pb.GlobalKVData(dtype=int(DType.from_torch(kv.dtype)), shape=list(kv.shape),  # type: ignore[arg-type]
                           checksum=checksum(data) if with_checksum else 0)


def block_messages(kv: torch.Tensor, block_tokens: int, step: int = 100) -> list[pb.ResumeResponse]:
    out = []
    for start in range(0, kv.shape[2], block_tokens):
        data = kv[:, :, start : start + block_tokens].contiguous().view(torch.uint8).numpy().tobytes()
        out.append(pb.ResumeResponse(global_kv_block=pb.GlobalKVBlock(tokens=min(block_tokens, kv.shape[2] - start),
                                                                      checksum=checksum(data))))
        out += [pb.ResumeResponse(global_kv_chunk=piece) for piece, _ in pieces(data, step)]
    return out


def assemble(g: pb.GlobalKVData, messages: list[pb.ResumeResponse]) -> torch.Tensor:
    kv = _GlobalKV(g)
    for m in messages:
        kv.add(m)
    return kv.tensor()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_are_placed_in_order_and_an_older_daemons_whole_tensor_is_taken_too(dtype: torch.dtype) -> None:
    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(assemble(header(kv), block_messages(kv, 16)), kv)  # two full blocks and a partial one
    data = kv.view(torch.uint8).numpy().tobytes()
    whole = [pb.ResumeResponse(global_kv_chunk=piece) for piece, _ in pieces(data, 100)]
    assert torch.equal(assemble(header(kv, with_checksum=True), whole), kv)


def test_blocks_that_do_not_add_up_to_the_header_are_data_loss() -> None:
    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    with pytest.raises(errors.DataLoss, match="32 of the global KV's 37 tokens"):
        assemble(header(kv), block_messages(kv[:, :, :32], 16))  # the last block missing
    with pytest.raises(errors.DataLoss, match="past its 37 tokens"):
        assemble(header(kv), block_messages(torch.cat([kv, kv], dim=2), 16))
    damaged = block_messages(kv, 16)
    damaged[1] = pb.ResumeResponse(global_kv_chunk=bytes(len(damaged[1].global_kv_chunk)))
    with pytest.raises(errors.DataLoss, match="damaged"):
        assemble(header(kv), damaged)
    whole_then_block = [pb.ResumeResponse(global_kv_chunk=b"x"), *block_messages(kv, 16)]
    with pytest.raises(errors.DataLoss, match="block after the global KV's bytes"):
        assemble(header(kv), whole_then_block)
