"""Cargo's unit graph of a build, read without building anything, for the
build checks (check-feature-pins.py, check-build-profile.py).

`--unit-graph` is unstable; RUSTC_BOOTSTRAP=1 lets this read-only query run
on the stable toolchain.
"""
import json
import os
import subprocess
import sys


def unit_graph(check, args):
    """The JSON graph of `cargo ARGS --unit-graph`; exits naming CHECK if cargo fails."""
    command = ["cargo", *args, "-Z", "unstable-options", "--unit-graph"]
    env = dict(os.environ, RUSTC_BOOTSTRAP="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{check}: `{' '.join(command)}` failed:\n{done.stderr}")
    return json.loads(done.stdout)
