"""Regenerate the protobuf/gRPC modules of this folder: ``python -m kiln.serve.proto.regenerate``
(needs grpcio-tools). The generated ``*_pb2*.py`` files are committed, so serving needs only
protobuf and grpcio at run time."""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[3]  # the folder holding kiln/
    here = Path(__file__).resolve().parent
    protos = sorted(str(p.relative_to(root)) for p in here.glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={root}",
            *protos]
    rc = protoc.main(args)
    if rc == 0:
        print("regenerated:", ", ".join(protos))
    return rc


if __name__ == "__main__":
    sys.exit(main())
