"""Generate the Python stubs in this package from proto/rlfleet/v1/*.proto.

One command regenerates everything: `python -m services.api.codegen`. The stubs are written flat
into services/api/ with their cross-imports rewritten to `services.api`, so the package needs no
sys.path tricks. tests/unit/test_api_stubs.py fails when the committed stubs are stale.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_PACKAGE = "rlfleet/v1"
_IMPORT_RE = re.compile(r"^from rlfleet\.v1 import (\w+_pb2)", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every proto file and write the rewritten stubs into out_dir."""
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        for src in sorted((Path(tmp) / PROTO_PACKAGE).iterdir()):
            text = _IMPORT_RE.sub(r"from services.api import \1", src.read_text())
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PACKAGE_DIR)
    args = parser.parse_args(argv)
    for stale in args.out.glob("*_pb2*.py*"):
        stale.unlink()
    for path in generate(args.out):
        print(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
