"""Generate the Python gRPC stubs for proto/engram/v1 into engram/v1 (run: python scripts/gen_proto.py).

The stubs are checked in so that a user needs no protoc; tests/test_proto_fresh.py regenerates them into a
temporary directory and fails when the checked-in copies differ from what the .proto files produce.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) and return the files it wrote under out_dir."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
    return sorted((out_dir / "engram" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(REPO):
        print(path.relative_to(REPO))
    sys.exit(0)
