#!/usr/bin/env bash
# DFlash2 checkpoints load in the reference (issue 42): trains a tiny DFlash2
# drafter for a few steps with this project's code, saves its checkpoint and
# one block's draft hidden states and greedy selector path, then loads it
# with PyPI `dflash` 0.1.0's DFlash2DraftModel.from_pretrained (0 missing,
# 0 unexpected keys, every tensor bit for bit) and runs that block through
# the reference. Then the reference's greedy speculative decoding
# (`spec_generate`) against this project's evaluation (`dflash eval`'s code,
# DFlash2 through its candidate selector) with a DFlash and a DFlash2
# drafter trained on the tiny target: the same proposed block and the same
# accepted length at every verification, the same outputs, the same τ, and
# τ above a floor; a DSpark
# drafter trained alike is held to its τ floor (scripts/check_spec_generate.py).
# The Python packages come from scripts/python-venv.sh.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$(bash "$repo_root/scripts/python-venv.sh")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$repo_root"
# BIN_DIR (the first argument): where `make` built the binaries and examples
# (its one test build, BIN_DIR/examples/); without it, cargo runs them.
bin_dir="${1:-}"
example() {
  local name="$1"
  shift
  if [[ -n "$bin_dir" ]]; then
    [[ -x "$bin_dir/examples/$name" ]] || { echo "check-dflash2: $bin_dir/examples/$name is missing (make test-build)" >&2; exit 1; }
    "$bin_dir/examples/$name" "$@"
  else
    cargo run --quiet -p dflash-model --example "$name" -- "$@"
  fi
}
example dflash2_checkpoint "$work/checkpoint"
"$python" "$repo_root/scripts/check_dflash_checkpoint.py" "$work/checkpoint"
example spec_generate_check "$work/speculative"
"$python" "$repo_root/scripts/check_spec_generate.py" "$work/speculative"
echo "check-dflash2: OK"
