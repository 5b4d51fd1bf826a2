"""Generates dflash_client/_proto/broker_pb2.py(i) from the repository's one
proto, proto/dflash/v1/broker.proto, with grpcio-tools.

The generated files are committed so that `pip install` needs no protoc;
`--check` regenerates into a temporary folder and fails when the committed
files differ (tests/test_proto_current.py runs it), so they never go stale.

    python tools/generate_proto.py           # rewrite the committed stubs
    python tools/generate_proto.py --check   # exit 1 if they are out of date
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import shutil
import sys
import tempfile

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent.parent
REPOSITORY_ROOT = PACKAGE_ROOT.parent.parent
PROTO_ROOT = REPOSITORY_ROOT / "proto"
PROTO_FILE = pathlib.Path("dflash/v1/broker.proto")
OUTPUT_DIR = PACKAGE_ROOT / "dflash_client" / "_proto"
GENERATED = ("broker_pb2.py", "broker_pb2.pyi")


def generate(destination: pathlib.Path) -> None:
    """Runs protoc (from grpcio-tools) and copies the two files to `destination`."""
    from grpc_tools import protoc  # imported here: only needed to generate

    with tempfile.TemporaryDirectory() as scratch:
        arguments = [
            "grpc_tools.protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            str(PROTO_FILE),
        ]
        if protoc.main(arguments) != 0:
            raise SystemExit(f"protoc failed on {PROTO_ROOT / PROTO_FILE}")
        generated_dir = pathlib.Path(scratch) / PROTO_FILE.parent
        destination.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copyfile(generated_dir / name, destination / name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    arguments = parser.parse_args()
    if not arguments.check:
        generate(OUTPUT_DIR)
        print(f"wrote {', '.join(GENERATED)} to {OUTPUT_DIR}")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        fresh = pathlib.Path(scratch)
        generate(fresh)
        stale = [
            name
            for name in GENERATED
            if not (OUTPUT_DIR / name).is_file()
            or not filecmp.cmp(fresh / name, OUTPUT_DIR / name, shallow=False)
        ]
    if stale:
        print(
            f"stale generated stubs in {OUTPUT_DIR}: {', '.join(stale)}; "
            f"run `python {pathlib.Path(__file__).relative_to(PACKAGE_ROOT)}` in {PACKAGE_ROOT}",
            file=sys.stderr,
        )
        return 1
    print("generated stubs match proto/dflash/v1/broker.proto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
