#!/usr/bin/env bash
# Loads the drafter checkpoints and the broker's checkpoint of the run's
# model (the drafters' shared model) that the system test's `dflash local` run
# wrote (real drafter-server binaries, real pipeline) with the reference
# implementation: PyPI `dflash` 0.1.0's DFlashDraftModel.from_pretrained,
# which must report no missing, unexpected or mismatched keys. The Python
# packages (torch 2.13.0 with its CUDA libraries, transformers 5.15.0, dflash)
# go once into a venv in the cache folder (scripts/python-venv.sh).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
run_dir="${1:-$repo_root/runs/test-local}"
python="$(bash "$repo_root/scripts/python-venv.sh")"

passed=0
failed=0
shopt -s nullglob
for output in "$run_dir"/checkpoints/*/; do
  latest="$(cat "$output/latest" 2>/dev/null || true)"
  checkpoint="$output${latest}"
  if [[ -z "$latest" || ! -f "$checkpoint/model.safetensors" ]]; then
    echo "check-checkpoint: $output has no complete checkpoint" >&2
    failed=$((failed + 1))
    continue
  fi
  if "$python" "$repo_root/scripts/check_dflash_checkpoint.py" "$checkpoint"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
  fi
done
# The run's shared model: the broker's checkpoint of it (`run-model/`), in
# the same reference format as the drafters' own checkpoints.
if [[ -f "$run_dir/run-model/model.safetensors" ]]; then
  if "$python" "$repo_root/scripts/check_dflash_checkpoint.py" "$run_dir/run-model"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
  fi
elif [[ "${DFLASH_EXPECT_MODEL:-1}" == 1 ]]; then
  echo "check-checkpoint: no checkpoint of the run's model at $run_dir/run-model (the system test's drafters sync by default)" >&2
  failed=$((failed + 1))
fi
if (( passed + failed == 0 )); then
  echo "check-checkpoint: no drafter checkpoints under $run_dir/checkpoints (run the system tests first)" >&2
  exit 1
fi
echo "check-checkpoint: $passed passed, $failed failed"
(( failed == 0 ))
