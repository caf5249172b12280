"""The checked-in stubs in engram/v1 must be exactly what the .proto files generate."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    produced = gen.generate(tmp_path)
    assert produced, "protoc produced nothing"
    for path in produced:
        rel = path.relative_to(tmp_path)
        checked_in = REPO / rel
        assert checked_in.exists(), f"{rel} is generated but not checked in: run `make proto`"
        assert checked_in.read_bytes() == path.read_bytes(), f"{rel} is stale: run `make proto` and commit"
    names = {p.name for p in produced}
    assert {"engram_pb2.py", "engram_pb2_grpc.py", "engram_pb2.pyi"} <= names
