#!/usr/bin/env bash
# Puts gloo's C++ headers into the cache folder, once, without root. The torch
# wheel ships c10d's headers but not gloo's, and ProcessGroupGloo.hpp includes
# gloo/*.h; crates/collective's build.rs compiles its shim against these
# (headers only: the code itself is inside libtorch_cpu.so). Source: Debian's
# libgloo-dev, via `apt-get download` (no root) or, where apt has no package
# lists (a fresh container), the same .deb from Debian's pool, checked by its
# sha256. Idempotent: a `.complete` marker; a second run does nothing.
# Prints the include folder (build.rs reads $DFLASH_GLOO_INCLUDE or this path).
set -euo pipefail
cache_root="${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
headers_dir="$cache_root/gloo-headers"
deb_name="libgloo-dev_0.0~git20220518.5b14351-3_amd64.deb"
deb_url="https://deb.debian.org/debian/pool/main/g/gloo/libgloo-dev_0.0~git20220518.5b14351-3_amd64.deb"
deb_sha256="80529c9fd8af452faf489e686b94bf87075965c40673803810c4f41634b1e299"

if [[ ! -f "$headers_dir/.complete" ]]; then
  echo "setup-gloo-headers: fetching libgloo-dev's headers into $headers_dir (once)" >&2
  mkdir -p "$cache_root"
  work_dir="$(mktemp -d "$cache_root/gloo-staging.XXXXXX")"
  trap 'rm -rf "$work_dir"' EXIT
  (
    cd "$work_dir"
    if ! apt-get download libgloo-dev >/dev/null 2>&1; then
      echo "setup-gloo-headers: apt-get download failed; fetching $deb_url" >&2
      curl --fail --silent --show-error --location --output "$deb_name" "$deb_url"
      echo "$deb_sha256  $deb_name" | sha256sum --check --quiet
    fi
  )
  deb_file="$(ls "$work_dir"/libgloo-dev_*.deb | head -n1)"
  dpkg-deb -x "$deb_file" "$work_dir/extracted"
  if [[ ! -f "$work_dir/extracted/usr/include/gloo/context.h" ]]; then
    echo "setup-gloo-headers: $deb_file holds no usr/include/gloo/context.h" >&2
    exit 1
  fi
  rm -rf "$headers_dir"
  mkdir -p "$headers_dir"
  mv "$work_dir/extracted/usr/include" "$headers_dir/include"
  touch "$headers_dir/.complete"
fi
echo "$headers_dir/include"
