#!/usr/bin/env bash
# Builds what scripts/check-gpu.sh runs, for a lent GPU machine that has
# PyTorch but no Rust toolchain and no network (the `device` tool's H200:
# torch 2.11.0+cu130, while this project builds against 2.13), and packs it
# into one folder to carry there:
#
#   bash scripts/build-for-device.sh TORCH_VERSION OUT_DIR
#   # e.g. 2.11.0 .gpu  ->  .gpu/bin.tar.xz (dflash, broker, target-server,
#   #                       drafter-server, capture_overhead, drafter_step,
#   #                       stripped) and .gpu/dflash-0.1.0-py3-none-any.whl
#
# How: PyPI's torch wheel of that version (CUDA libtorch, headers; its CUDA
# libraries are not needed to link) is unpacked into the cache; tch's
# torch-sys is copied and its generated C++ wrappers of operators that
# version lacks are made to throw (the build is tried, the failing
# functions read from the compiler's errors, and tried again; none of them
# is an operator this project calls); the workspace is copied beside it with
# a [patch] to that torch-sys and built in release. On the GPU machine:
#
#   mkdir -p /tmp/bin && tar -xJf .gpu/bin.tar.xz -C /tmp/bin
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/dflash-*.whl
#   export PYTHONPATH=/tmp/site LD_LIBRARY_PATH="$(python3 -c 'import os,torch;print(os.path.dirname(torch.__file__))')/lib"
#   DFLASH_GPU_PREBUILT=/tmp/bin DFLASH_GPU_PYTHON=python3 bash scripts/check-gpu.sh
#
# A cross-version build: the programs call libtorch through 2.13's C++
# API compiled against the other version's headers. The H200 run recorded
# in e010b21 (BENCHMARKS.md, "The GPU check") saw one unexplained libtorch
# error that may come from it.
set -euo pipefail
torch_version="${1:?usage: build-for-device.sh TORCH_VERSION OUT_DIR}"
out="${2:?usage: build-for-device.sh TORCH_VERSION OUT_DIR}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib/device-programs.sh
source "$repo_root/scripts/lib/device-programs.sh"
cache_root="${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
work="$cache_root/device-build-$torch_version"
mkdir -p "$work/wheels" "$out"
out="$(cd "$out" && pwd)"

if [[ ! -f "$work/torch/lib/libtorch_cuda.so" ]]; then
  echo "build-for-device: torch $torch_version's wheel into $work" >&2
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$work/wheels" "torch==$torch_version"
  unzip -q -o "$work"/wheels/torch-"$torch_version"-*.whl 'torch/lib/*' 'torch/include/*' -d "$work"
fi
python3 -m pip download --quiet --no-deps -d "$out" dflash==0.1.0

# The tch version the workspace locks, and its torch-sys source.
cd "$repo_root"
sys_version="$(cargo metadata --format-version 1 --locked | python3 -c '
import json, sys
print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "torch-sys"))')"
registry_copy="$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -maxdepth 1 -mindepth 1 -type d \
  -exec test -d '{}/torch-sys-'"$sys_version" ';' -print -quit)/torch-sys-$sys_version"
rm -rf "$work/torch-sys" "$work/workspace"
cp -r "$registry_copy" "$work/torch-sys"
mkdir -p "$work/workspace"
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$work/workspace"
printf '\n[patch.crates-io]\ntorch-sys = { path = "%s" }\n' "$work/torch-sys" >>"$work/workspace/Cargo.toml"

build() {
  (cd "$work/workspace" &&
    CARGO_TARGET_DIR="$work/target" LIBTORCH="$work/torch" LIBTORCH_CXX11_ABI=1 \
      LIBTORCH_BYPASS_VERSION_CHECK=1 RUSTFLAGS="-C link-arg=-Wl,--allow-shlib-undefined" \
      cargo build --release "${device_build_args[@]}")
}

# Stubs every generated wrapper the compiler rejected (their line numbers in
# the log): the body inside PROTECT( ... ) becomes a throw.
stub_failures() {
  python3 - "$1" "$work/torch-sys/libtch/torch_api_generated.cpp" <<'PY'
import re, sys
log, path = sys.argv[1], sys.argv[2]
failing = sorted({int(n) for n in re.findall(r"torch_api_generated\.cpp:(\d+):\d+: error", open(log).read())})
lines = open(path).read().split("\n")
stubbed = set()
for number in failing:
    start = number - 1
    while "PROTECT(" not in lines[start]:
        start -= 1
    if start in stubbed:
        continue
    end = start + 1
    while lines[end].strip() != ")":
        end += 1
    stubbed.add(start)
    lines[start + 1:end] = ['    throw std::runtime_error("not in the libtorch this torch-sys was built against");'] + [""] * (end - start - 2)
open(path, "w").write("\n".join(lines))
print(f"build-for-device: stubbed {len(stubbed)} generated wrappers", file=sys.stderr)
sys.exit(0 if stubbed else 1)
PY
}

for attempt in 1 2 3; do
  if build 2>"$work/build.log"; then
    break
  fi
  echo "build-for-device: build $attempt failed; stubbing what the compiler rejected" >&2
  stub_failures "$work/build.log" || { tail -30 "$work/build.log" >&2; exit 1; }
  [[ $attempt -lt 3 ]] || { tail -30 "$work/build.log" >&2; exit 1; }
done

mkdir -p "$work/bin"
release="$work/target/release"
for program in "${device_programs[@]}"; do
  strip -o "$work/bin/$(basename "$program")" "$release/$program"
done
tar -cJf "$out/bin.tar.xz" -C "$work/bin" .
echo "build-for-device: $out/bin.tar.xz ($(du -h "$out/bin.tar.xz" | cut -f1)) and the dflash wheel" >&2
