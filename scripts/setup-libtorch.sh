#!/usr/bin/env bash
# Fetches the CPU libtorch 2.13.0 that tch 0.26 expects, once, from PyPI wheels
# (the PyTorch download site is not reachable on every machine, PyPI is), into a
# cache folder outside the clone, and links it at .cache/libtorch, where
# .cargo/config.toml points LIBTORCH. Idempotent: a second run does nothing.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
libtorch_dir="$cache_root/libtorch-2.13.0-cpu"
link="$repo_root/.cache/libtorch"

if [[ ! -f "$libtorch_dir/.complete" ]]; then
  echo "setup-libtorch: fetching torch 2.13.0 wheels into $cache_root (once)" >&2
  download_dir="$cache_root/wheels"
  mkdir -p "$download_dir"
  python3 -m pip download --quiet --no-deps -d "$download_dir" \
    torch==2.13.0 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
  staging="$(mktemp -d "$cache_root/libtorch-staging.XXXXXX")"
  torch_wheel="$(ls "$download_dir"/torch-2.13.0-*.whl | head -n1)"
  python3 - "$torch_wheel" "$staging" <<'PY'
import sys, zipfile, os
wheel, out = sys.argv[1], sys.argv[2]
keep_libs = {"libtorch_cpu.so", "libtorch.so", "libc10.so", "libgomp.so.1", "libshm.so", "libtorch_global_deps.so"}
with zipfile.ZipFile(wheel) as archive:
    for name in archive.namelist():
        if name.startswith("torch/include/") and not name.endswith("/"):
            target = os.path.join(out, name[len("torch/"):])
        elif name.startswith("torch/lib/") and os.path.basename(name) in keep_libs:
            target = os.path.join(out, "lib", os.path.basename(name))
        else:
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with archive.open(name) as src, open(target, "wb") as dst:
            dst.write(src.read())
PY
  python3 - "$download_dir" "$staging/lib" <<'PY'
import sys, zipfile, glob, os
download_dir, lib_dir = sys.argv[1], sys.argv[2]
for pattern, wanted in (("nvidia_cuda_runtime-*.whl", "libcudart.so.13"), ("nvidia_cuda_cupti-*.whl", "libcupti.so.13")):
    wheel = glob.glob(os.path.join(download_dir, pattern))[0]
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith("/" + wanted))
        with archive.open(member) as src, open(os.path.join(lib_dir, wanted), "wb") as dst:
            dst.write(src.read())
PY
  echo "2.13.0" > "$staging/build-version"
  touch "$staging/.complete"
  rm -rf "$libtorch_dir"
  mv "$staging" "$libtorch_dir"
fi

mkdir -p "$repo_root/.cache"
if [[ "$(readlink "$link" 2>/dev/null || true)" != "$libtorch_dir" ]]; then
  rm -rf "$link"
  ln -s "$libtorch_dir" "$link"
fi
echo "$link"
