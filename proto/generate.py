"""Regenerate the Python for proto/eyrie/v1/*.proto (committed beside the .proto files).

Usage: ``python -m proto.generate [OUT_DIR]`` (default: beside the sources). grpc_tools writes
absolute imports (``from eyrie.v1 import x_pb2``); they are rewritten to relative ones so the code
lives in the ``proto.eyrie.v1`` package while the descriptors keep their ``eyrie/v1/*.proto`` names.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SOURCES = sorted((ROOT / "eyrie" / "v1").glob("*.proto"))


def generate(out_dir: Path | None = None) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    out = Path(out_dir) if out_dir else ROOT
    out.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}"] + [str(p.relative_to(ROOT)) for p in SOURCES]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = []
    for path in sorted((out / "eyrie" / "v1").glob("*_pb2*.py*")):
        text = re.sub(r"^from eyrie\.v1 import (\w+)", r"from . import \1", path.read_text(), flags=re.M)
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else None):
        print(p)
