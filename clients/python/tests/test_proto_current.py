"""The committed stubs are what grpcio-tools makes of the repository's one
proto today."""

import subprocess
import sys

from harness import PACKAGE_ROOT


def test_generated_stubs_match_the_proto():
    result = subprocess.run(
        [sys.executable, str(PACKAGE_ROOT / "tools" / "generate_proto.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
