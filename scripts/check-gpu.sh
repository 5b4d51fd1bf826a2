#!/usr/bin/env bash
# shellcheck disable=SC2317  # the step functions run through `check`
# The one prepared GPU check (#26): what a session lent a GPU runs, in one
# go, before anyone books GPUs for a real run.
#
# 1. Build checks, on any machine: scripts/check-cuda-build.sh (the CUDA
#    libtorch from PyPI's torch wheel, target-server and drafter-server
#    linked to libtorch_cuda), then the release build of what the device
#    checks run, against the same CUDA libtorch: the examples
#    `capture_overhead` (target-server) and `drafter_step` (drafter-server),
#    and `dflash` with the broker and both servers (`dflash local` runs
#    them from its own folder).
# 2. Without a GPU (no nvidia-smi, or libtorch sees no CUDA device): says so
#    and exits 0 after the build checks.
# 3. On the GPU, with random weights of real shapes (nothing downloaded;
#    DFLASH_GPU_SECONDS, default 600, bounds the device steps in all):
#    a. a Qwen3-8B-shaped target (36 layers, hidden 4096, bf16) written
#       once, then its forward with capture: tokens/s and bytes/s of hidden
#       states, against the same forward without capture;
#    b. transformers' forward of the same weights on the same GPU, when the
#       venv of scripts/python-venv.sh can be had (torch, transformers);
#    c. the DFlash drafter step of the reference shape (hidden 4096, 5
#       layers, block 16, vocab 151936; 4 sequences of 3072 tokens, 512
#       anchors: the recipe's batch) in Rust: tokens/s, MFU, GPU memory
#       peak; and the same step in PyTorch eager when that venv is there;
#    d. `dflash local` with its targets and drafters sharing the one GPU:
#       the run must end COMPLETE (result OK) with τ above the untrained
#       drafter's;
#    e. the hidden states a.'s capture sent, against transformers' forward
#       of the same weights and ids in bf16 and in float32: the capture's
#       error from float32 at most twice transformers' own bf16 error, per
#       layer (scripts/bench/target_parity_hf.py).
#    The Rust steps (a, c, d) run first, then the PyTorch ones (b, e, c's
#    PyTorch eager).
#
# On a GPU machine without a Rust toolchain or network (a lent device):
# build here with the CUDA libtorch of the torch version installed there,
# copy the six programs (dflash, broker, target-server, drafter-server and
# the examples capture_overhead and drafter_step) into one folder, and run
#   DFLASH_GPU_PREBUILT=FOLDER DFLASH_GPU_PYTHON=python3 bash scripts/check-gpu.sh
# there: the build checks are skipped, the programs come from FOLDER (with
# LD_LIBRARY_PATH to that torch's lib folder) and the PyTorch steps use that
# python (torch, transformers, and the `dflash` package) instead of the venv.
# Prints `check-gpu: N passed, M failed` last; the figures are the lines
# marked `check-gpu: figure`. Usage: bash scripts/check-gpu.sh
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
cuda_venv="$cache_root/venv-torch-cuda"
device_budget="${DFLASH_GPU_SECONDS:-600}"
prebuilt="${DFLASH_GPU_PREBUILT:-}"
check_name=check-gpu
# shellcheck source=lib/check.sh
source "$repo_root/scripts/lib/check.sh"
# shellcheck source=lib/device-programs.sh
source "$repo_root/scripts/lib/device-programs.sh"
figure() { echo "check-gpu: figure $*"; }

cd "$repo_root" || exit 1
started=$SECONDS
if [[ -n "$prebuilt" ]]; then
  release="$prebuilt"
  examples="$prebuilt"
  programs_there() {
    local program
    for program in "${device_programs[@]}"; do
      program="$(basename "$program")"
      [[ -x "$prebuilt/$program" ]] || { echo "    $prebuilt/$program is missing"; return 1; }
    done
  }
  check "the prebuilt programs are in $prebuilt (build checks skipped)" programs_there || true
  ((failed == 0)) || finish
else
  echo "check-gpu: build checks (scripts/check-cuda-build.sh)" >&2
  if bash scripts/check-cuda-build.sh; then
    check "scripts/check-cuda-build.sh" true
  else
    check "scripts/check-cuda-build.sh" false
    finish
  fi

  # The same CUDA libtorch and target folder check-cuda-build.sh used.
  libtorch="$("$cuda_venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
  base_target="${CARGO_TARGET_DIR:-$repo_root/target}"
  cuda_target="${base_target%/}-cuda"
  build_started=$SECONDS
  if CARGO_TARGET_DIR="$cuda_target" LIBTORCH="$libtorch" LIBTORCH_CXX11_ABI=1 cargo build --quiet --release "${device_build_args[@]}"; then
    check "the device checks' programs build in release against the CUDA libtorch ($((SECONDS - build_started)) s)" true
  else
    check "the device checks' programs build in release against the CUDA libtorch" false
    finish
  fi
  release="$cuda_target/release"
  examples="$release/examples"
fi

gpu_name=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu_name="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
fi
if [[ -z "$gpu_name" ]]; then
  echo "check-gpu: no GPU on this machine (nvidia-smi absent or lists none): the device checks are skipped" >&2
  echo "check-gpu: took $((SECONDS - started)) s" >&2
  finish
fi
echo "check-gpu: GPU: $gpu_name; device steps bounded to $device_budget s in all" >&2

work="${DFLASH_GPU_WORKDIR:-$(mktemp -d)}"
[[ -n "${DFLASH_GPU_WORKDIR:-}" ]] || trap 'rm -rf "$work"' EXIT
device_started=$SECONDS
# The time a step may take: its own cap, within what is left of the budget.
bound() {
  local left=$((device_budget - (SECONDS - device_started)))
  ((left < $1)) && echo $((left > 1 ? left : 1)) || echo "$1"
}
# Runs a step under its bound, its output teed to $work/<name>.log.
step() {
  local name="$1" cap="$2"; shift 2
  echo "check-gpu: $name" >&2
  timeout "$(bound "$cap")" "$@" 2>&1 | tee "$work/$name.log"
  return "${PIPESTATUS[0]}"
}
# A number from the first line of a log matching a pattern (sed -E group 1).
read_value() { sed -nE "s/$2/\1/p" "$work/$1.log" | head -1; }

# bf16 dense peak of the GPU for MFU, in TFLOP/s (DFLASH_GPU_PEAK_TFLOPS
# overrides; unknown GPUs get no MFU).
peak_tflops="${DFLASH_GPU_PEAK_TFLOPS:-}"
if [[ -z "$peak_tflops" ]]; then
  case "$gpu_name" in
    *H200* | *H100*) peak_tflops=989 ;;
    *A100*) peak_tflops=312 ;;
    *L40S*) peak_tflops=362 ;;
  esac
fi

# a. The target forward with capture at Qwen3-8B's shape, 4 x 2048 tokens.
# Writing the 16 GB of random bf16 weights (one thread per core; on one
# thread it took 386 s of a 15-minute device lease) is most of this step
# the first time; DFLASH_GPU_WORKDIR keeps them for the next run.
model_dir="$work/qwen3-8b-shaped"
target_forward() {
  step target-forward 420 "$examples/capture_overhead" --shape qwen3-8b --model-dir "$model_dir" \
    --device cuda:0 --dtype bf16 --batch 4 --seq-len 2048 --rounds 3 --save-hidden "$work/hidden.safetensors"
}
check "Qwen3-8B-shaped target forward with capture on the GPU" target_forward
capture="$(read_value target-forward '^capture .*: ([0-9]+) tokens\/s.*')"
forward="$(read_value target-forward '^forward \(HF-style.*: ([0-9]+) tokens\/s.*')"
capture_bytes="$(read_value target-forward '^capture .* ([0-9.]+) GB\/s of hidden states.*')"
figure "target forward, Qwen3-8B shape, bf16, 4 x 2048 tokens: capture ${capture:-?} tokens/s (${capture_bytes:-?} GB/s of hidden states), forward without capture ${forward:-?} tokens/s"

# c. The drafter step at the reference shape, Rust and PyTorch eager.
# Model FLOPs of one step (an estimate written out here, once, for both):
# Q = seqs * anchors * 16 query tokens through 5 layers (q, k, v, o, MLP),
# the context's seqs * length tokens through fc and each layer's k and v,
# attention over the visible context (anchors lie in the supervised last
# three quarters: 5/8 of the length on average) plus the block, the frozen
# LM head over 15 positions per block; backward twice the forward, but
# once for the LM head (its input's gradient only).
mfu() { # milliseconds per step -> MFU in percent, or ?
  [[ -n "$peak_tflops" && -n "$1" ]] || { echo "?"; return; }
  python3 - "$1" "$peak_tflops" <<'PY'
import sys
ms, peak = float(sys.argv[1]), float(sys.argv[2])
seqs, length, anchors, block, layers = 4, 3072, 512, 16, 5
hidden, inter, heads, kv, hd, vocab, targets = 4096, 12288, 32, 8, 128, 151936, 5
q, c = seqs * anchors * block, seqs * length
layer_q = hidden * heads * hd * 2 + hidden * kv * hd * 2 + 3 * hidden * inter
forward = 2 * layers * (q * layer_q + c * 2 * hidden * kv * hd) + 2 * c * targets * hidden * hidden
forward += 2 * 2 * layers * q * (5 * length / 8 + block) * heads * hd
head = 2 * seqs * anchors * (block - 1) * vocab * hidden
flops = 3 * forward + 2 * head
print(f"{100 * flops / (ms / 1e3) / (peak * 1e12):.1f}")
PY
}
drafter_shape=(--anchors 512 --seq-len 3072 --seqs 4 --steps 5)
# The fused attention, as drafter-server picks on a GPU (`--attention auto`):
# the split attention's scores at this shape ([4, 32, 8192, 3072] floats per
# layer) did not fit an H200's 140 GiB (recorded in e010b21: out of memory with 131.6
# GiB allocated). PyTorch eager likewise through SDPA with a dense mask.
if [[ -f "$model_dir/config.json" ]]; then
  rust_step() {
    step drafter-step 240 "$examples/drafter_step" --target-dir "$model_dir" --device cuda:0 --dtype bf16 \
      --attention fused "${drafter_shape[@]}"
  }
  check "drafter step of the reference shape on the GPU (Rust)" rust_step
  milliseconds="$(read_value drafter-step '^anchors 512: .*\(([0-9.]+) ms per step\).*')"
  figure "drafter step, reference shape, bf16, 4 x 3072 tokens, 512 anchors (Rust): $(read_value drafter-step '^anchors 512: ([0-9]+) tokens\/s.*') tokens/s, ${milliseconds:-?} ms per step, MFU $(mfu "$milliseconds") % of ${peak_tflops:-?} TFLOP/s, GPU memory peak $(read_value drafter-step '.*GPU memory .* peak ([0-9.]+) GiB.*') GiB"
fi

# d. The whole pipeline with every role on the one GPU.
local_run() {
  step dflash-local 300 "$release/dflash" local --target-devices cuda:0 --drafter-devices cuda:0 \
    --workdir "$work/local" --view lines || return 1
  python3 - "$work/local/summary.json" <<'PY'
import json, sys
summary = json.load(open(sys.argv[1]))
trained, untrained = summary.get("acceptance_length"), summary.get("untrained_acceptance_length")
print(f"check-gpu: figure dflash local on one GPU: result {'OK' if summary.get('ok') else 'FAILED'}, "
      f"{summary.get('tokens_per_second', 0):.0f} tokens/s, τ {trained} trained vs {untrained} untrained")
sys.exit(0 if summary.get("ok") and trained is not None and untrained is not None and trained > untrained else 1)
PY
}
check "dflash local with targets and drafters sharing the GPU: COMPLETE, τ above untrained" local_run

# b., e. and c.'s PyTorch side: DFLASH_GPU_PYTHON, or the project's Python
# venv (torch with its CUDA libraries, transformers, dflash); made once, so
# it needs PyPI the first time.
python="${DFLASH_GPU_PYTHON:-}"
if [[ -n "$python" ]]; then
  echo "check-gpu: PyTorch side from $python (DFLASH_GPU_PYTHON)" >&2
elif python="$(timeout "$(bound 300)" bash scripts/python-venv.sh 2>"$work/python-venv.log")"; then
  echo "check-gpu: PyTorch side from $python" >&2
else
  python=""
  echo "check-gpu: no PyTorch venv (scripts/python-venv.sh failed, see below): the transformers and PyTorch eager comparisons are skipped" >&2
  tail -3 "$work/python-venv.log" >&2
fi
if [[ -n "$python" && -f "$model_dir/config.json" ]]; then
  transformers_forward() {
    step transformers-forward 240 "$python" scripts/bench/target_forward_hf.py --model-dir "$model_dir" \
      --device cuda:0 --dtype bf16 --batch 4 --seq-len 2048 --rounds 5
  }
  check "transformers' forward of the same weights on the GPU" transformers_forward
  figure "transformers forward (hidden states kept), same weights and batch: $(read_value transformers-forward '.*: ([0-9]+) tokens\/s.*') tokens/s"
fi

# e. The hidden states step a. captured against transformers' bf16 and
# float32 forward of the same weights and ids.
if [[ -n "$python" && -f "$work/hidden.safetensors" ]]; then
  parity() {
    step target-parity 240 "$python" scripts/bench/target_parity_hf.py --model-dir "$model_dir" \
      --hidden "$work/hidden.safetensors" --device cuda:0
  }
  check "the capture's hidden states equal transformers' to bf16 rounding on the GPU" parity
  figure "hidden states against transformers' float32 forward, Qwen3-8B shape, 4 x 2048 tokens: $(read_value target-parity '^parity: (.*)')"
fi

if [[ -n "$python" ]]; then
  torch_step() {
    step drafter-step-torch 240 "$python" scripts/bench/drafter_step_torch.py --shape qwen3-8b --device cuda:0 \
      --dtype bf16 --attention dense "${drafter_shape[@]}"
  }
  check "the same drafter step in PyTorch eager on the GPU" torch_step
  milliseconds="$(read_value drafter-step-torch '^anchors 512: .*\(([0-9.]+) ms per step\).*')"
  figure "drafter step, same shape (PyTorch eager): $(read_value drafter-step-torch '^anchors 512: ([0-9]+) tokens\/s.*') tokens/s, ${milliseconds:-?} ms per step, MFU $(mfu "$milliseconds") %, GPU memory peak $(read_value drafter-step-torch '.*GPU memory peak ([0-9.]+) GiB.*') GiB"
fi

echo "check-gpu: device steps took $((SECONDS - device_started)) s, all $((SECONDS - started)) s" >&2
finish
