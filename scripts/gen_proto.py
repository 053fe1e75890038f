#!/usr/bin/env python3
"""Regenerate the committed gRPC stubs from proto/ (run from anywhere: python scripts/gen_proto.py).

Stubs land beside the package path of each .proto: proto/ftrt/v1/x.proto -> ftrt/v1/x_pb2.py,
x_pb2_grpc.py and x_pb2.pyi. Needs grpcio-tools (in the test extras). With --check, nothing is
written and the exit code says whether the committed stubs are up to date.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    files = sorted(PROTO.rglob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(f) for f in files],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the message above.")
    return [p.relative_to(out) for p in sorted(out.rglob("*_pb2*"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only compare with the committed stubs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        produced = generate(Path(tmp))
        stale = [p for p in produced if not (ROOT / p).exists() or not filecmp.cmp(Path(tmp) / p, ROOT / p, shallow=False)]
        if args.check:
            for p in stale:
                print(f"stale or missing: {p}")
            return 1 if stale else 0
        for p in produced:
            shutil.copyfile(Path(tmp) / p, ROOT / p)
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
