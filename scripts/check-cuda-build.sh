#!/usr/bin/env bash
# The CUDA variant: target-server and drafter-server built against the CUDA
# libtorch of PyPI's torch 2.13.0 wheel (with its nvidia-* libraries, in a
# venv in the cache folder, made once: several GB), linked to libtorch_cuda
# (checked with readelf and ldd), and `--device cuda:0` on a machine without
# a GPU failing at once with a clear message (on a GPU machine: libtorch
# sees the device). Builds into its own target folder
# ($CARGO_TARGET_DIR-cuda) so the CPU build is left alone. Not in `make
# test`: the first run downloads the wheels and compiles tch again.
# Prints `check-cuda-build: N passed, M failed` last.
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
venv="$cache_root/venv-torch-cuda"
torch_version=2.13.0
check_name=check-cuda-build
# shellcheck source=lib/check.sh
source "$repo_root/scripts/lib/check.sh"

started=$SECONDS
if [[ "$(cat "$venv/.complete" 2>/dev/null)" != "$torch_version" ]]; then
  echo "check-cuda-build: installing torch==$torch_version with its CUDA libraries into $venv (once)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv" &&
    "$venv/bin/pip" install --quiet --disable-pip-version-check --find-links "$cache_root/wheels" "torch==$torch_version" &&
    echo "$torch_version" >"$venv/.complete" ||
    { check "torch $torch_version (CUDA) installs from PyPI" false; finish; }
fi
libtorch="$("$venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
check "the torch wheel carries libtorch_cuda.so" test -f "$libtorch/lib/libtorch_cuda.so"

cd "$repo_root"
base_target="${CARGO_TARGET_DIR:-$repo_root/target}"
export CARGO_TARGET_DIR="${base_target%/}-cuda"
build_started=$SECONDS
if LIBTORCH="$libtorch" LIBTORCH_CXX11_ABI=1 cargo build --quiet \
  -p dflash-target-server -p dflash-drafter-server --bins; then
  check "target-server and drafter-server build against the CUDA libtorch ($((SECONDS - build_started)) s)" true
else
  check "target-server and drafter-server build against the CUDA libtorch" false
  finish
fi

for binary in target-server drafter-server; do
  path="$CARGO_TARGET_DIR/debug/$binary"
  needs_cuda() { readelf -d "$path" | grep -q 'NEEDED.*\[libtorch_cuda\.so\]'; }
  check "$binary: readelf lists libtorch_cuda.so as NEEDED" needs_cuda
  resolves() { ! ldd "$path" | grep -q "not found" && ldd "$path" | grep -q "libtorch_cuda.so => $libtorch/lib/"; }
  check "$binary: ldd resolves libtorch_cuda.so and every library" resolves
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The tiny model, written by the CPU build's dflash (`cargo build --workspace --bins`).
"$base_target/debug/dflash" init-tiny "$work/tiny" >/dev/null ||
  { check "the tiny model is written (dflash init-tiny of the CPU build)" false; finish; }
printf '{"input_ids":[1,2,3,4,5,6,7,8],"loss_mask":[0,0,1,1,1,1,1,1]}\n' >"$work/data.jsonl"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "check-cuda-build: a GPU is present: the no-GPU failure is not checked here" >&2
else
  fails_clearly() {
    local begun=$SECONDS output status
    output="$(timeout 60 "$CARGO_TARGET_DIR/debug/target-server" --broker http://127.0.0.1:9 \
      --model "$work/tiny" --data "$work/data.jsonl" --device cuda:0 2>&1)"
    status=$?
    echo "    exit $status after $((SECONDS - begun)) s: $(grep -m1 -i cuda <<<"$output")"
    ((status != 0 && status != 124 && SECONDS - begun < 30)) &&
      grep -q "cuda:0 requested, but libtorch sees 0 CUDA device" <<<"$output"
  }
  check "--device cuda:0 without a GPU fails at once with a clear message" fails_clearly
fi
echo "check-cuda-build: took $((SECONDS - started)) s" >&2
finish
