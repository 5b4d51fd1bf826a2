#!/usr/bin/env bash
# DSpark checkpoints load and run in speculators 0.9.0 (issue 50): trains a
# tiny DSpark drafter for a few steps with this project's trainer on the tiny
# target's own continuations (tapped states and last hidden state captured
# as the target-server does), saves its checkpoint with the drafter's one
# writer (speculators' format), then loads it with speculators'
# DSparkDraftModel.from_pretrained (0 missing, 0 unexpected keys, every
# tensor bit for bit) and runs a held-out sequence through speculators'
# training forward: the same loss and metrics as this project's
# (scripts/check_dspark_checkpoint.py). Once per Markov head variant.
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
    [[ -x "$bin_dir/examples/$name" ]] || { echo "check-dspark: $bin_dir/examples/$name is missing (make test-build)" >&2; exit 1; }
    "$bin_dir/examples/$name" "$@"
  else
    cargo run --quiet -p dflash-model --example "$name" -- "$@"
  fi
}
for variant in vanilla gated rnn; do
  example dspark_checkpoint "$work/$variant" "$variant"
  "$python" "$repo_root/scripts/check_dspark_checkpoint.py" "$work/$variant"
done
echo "check-dspark: OK"
