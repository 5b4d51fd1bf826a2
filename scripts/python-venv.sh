#!/usr/bin/env bash
# The project's one Python environment for checks: a venv in the cache folder
# with the packages of scripts/golden/requirements.txt (torch 2.13.0 with its
# CUDA libraries, transformers, the reference `dflash` package, and the Python
# client's grpcio, protobuf and pytest). Made once; its `.complete` marker
# holds the requirements file's sha256, so when the requirements change the
# next run installs the difference into the existing venv (`pip install -r`,
# incremental) instead of starting over. Works from an empty cache.
#
# Prints the venv's python on stdout; progress goes to stderr.
# Usage: PY="$(bash scripts/python-venv.sh)"
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
requirements="$repo_root/scripts/golden/requirements.txt"
venv="$cache_root/venv-dflash-reference"
marker="$venv/.complete"
wanted="$(sha256sum "$requirements" | cut -d' ' -f1)"

mkdir -p "$cache_root"
# Several checkouts may share the cache: one installer at a time.
exec 9>"$cache_root/venv-dflash-reference.lock"
if command -v flock >/dev/null; then
  flock 9
fi

if [[ -f "$marker" && "$(cat "$marker")" == "$wanted" && -x "$venv/bin/python" ]]; then
  echo "$venv/bin/python"
  exit 0
fi
if [[ -f "$marker" && -x "$venv/bin/python" ]]; then
  echo "python-venv: requirements changed; updating $venv" >&2
else
  echo "python-venv: creating $venv from $requirements (once)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
fi
rm -f "$marker"
"$venv/bin/pip" install --quiet --disable-pip-version-check --find-links "$cache_root/wheels" -r "$requirements" >&2
printf '%s\n' "$wanted" >"$marker"
echo "$venv/bin/python"
