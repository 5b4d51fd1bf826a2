#!/usr/bin/env bash
# The project's Python environments for checks, made once in the cache folder
# and printed (their python) on stdout; progress goes to stderr. Work from an
# empty cache.
#
#   python-venv.sh            the reference venv: the packages of
#                             scripts/golden/requirements.txt (torch 2.13.0
#                             with its CUDA libraries, transformers, the
#                             reference `dflash` package, grpcio, protobuf,
#                             pytest), for the checkpoint and DFlash2 checks.
#                             Its `.complete` marker holds the requirements
#                             file's sha256, so when the requirements change
#                             the next run installs the difference into it
#                             (`pip install -r`, incremental).
#   python-venv.sh client     the Python client's venv: exactly what
#                             clients/python declares for its tests
#                             (`pip install "clients/python[test]"`, which
#                             pulls in its `examples` and `torch` extras), as
#                             a user installs it, so a missing declaration
#                             fails `make check-python` as it fails for a
#                             user. The versions are held to the reference
#                             venv's (requirements.txt as a constraints file:
#                             it pins, it adds nothing), so pip's cache has
#                             them. One venv per declaration (named by the
#                             sha256 of pyproject.toml and the constraints),
#                             made from nothing: what an earlier declaration
#                             installed never lingers.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
requirements="$repo_root/scripts/golden/requirements.txt"
kind="${1:-reference}"
mkdir -p "$cache_root"

case "$kind" in
  reference)
    venv="$cache_root/venv-dflash-reference"
    lock="$cache_root/venv-dflash-reference.lock"
    wanted="$(sha256sum "$requirements" | cut -d' ' -f1)"
    ;;
  client)
    pyproject="$repo_root/clients/python/pyproject.toml"
    wanted="$(cat "$pyproject" "$requirements" | sha256sum | cut -d' ' -f1)"
    venv="$cache_root/venv-python-client-${wanted:0:12}"
    lock="$venv.lock"
    ;;
  *)
    echo "usage: python-venv.sh [reference|client]" >&2
    exit 2
    ;;
esac
marker="$venv/.complete"

# Several checkouts may share the cache: one installer at a time.
exec 9>"$lock"
if command -v flock >/dev/null; then
  flock 9
fi

if [[ -f "$marker" && "$(cat "$marker")" == "$wanted" && -x "$venv/bin/python" ]]; then
  echo "$venv/bin/python"
  exit 0
fi
if [[ "$kind" == reference && -f "$marker" && -x "$venv/bin/python" ]]; then
  echo "python-venv: requirements changed; updating $venv" >&2
else
  echo "python-venv: creating $venv (once)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
fi
rm -f "$marker"
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check --find-links "$cache_root/wheels")
if [[ "$kind" == reference ]]; then
  "${pip[@]}" -r "$requirements" >&2
else
  "${pip[@]}" -c "$requirements" "$repo_root/clients/python[test]" >&2
fi
printf '%s\n' "$wanted" >"$marker"
echo "$venv/bin/python"
