#!/usr/bin/env bash
# Builds the dflash runtime image on this machine, where no registry can be
# reached, from the binaries already built (no second compile):
#
#   1. the base image `dflash-base:bookworm`: a Debian bookworm minbase made
#      with debootstrap from the apt mirror this machine uses, imported with
#      `docker import`. Made once and reused while it exists (the slow part:
#      about a minute on a fresh machine).
#   2. the runtime image (default `dflash-pipeline:local`): deploy/Dockerfile's
#      `prebuilt` stage (the `runtime` stage's settings, with the binaries
#      from the context instead of a compile), the context holding the
#      broker, target-server, drafter-server, dflash and dflash-ops binaries
#      from $CARGO_TARGET_DIR/<profile> and libtorch's libraries from
#      .cache/libtorch/lib. dflash-ops (status, top, health without
#      libtorch) is what the health checks, the probes and the operator pod
#      run. The image runs as the non-root user 10001 (see the Dockerfile's
#      runtime-base stage).
#
# Usage: scripts/build-image.sh [--profile debug|release] [--tag NAME:TAG]
#                               [--rebuild-base] [--base-only]
# Prints the image name on stdout; progress goes to stderr.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
profile=debug
tag=dflash-pipeline:local
base=dflash-base:bookworm
rebuild_base=false
base_only=false
while (($#)); do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --rebuild-base) rebuild_base=true; shift ;;
    --base-only) base_only=true; shift ;;
    *) echo "build-image: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$profile" in debug | release) ;; *) echo "build-image: --profile must be debug or release, got $profile" >&2; exit 2 ;; esac

log() { echo "build-image: $*" >&2; }
# Every binary the image ships, from $CARGO_TARGET_DIR/<profile>.
binaries=(broker target-server drafter-server dflash dflash-ops)

check_binaries() {
target_dir="${CARGO_TARGET_DIR:-$repo_root/target}"
binaries_dir="$target_dir/$profile"
libtorch_lib="$repo_root/.cache/libtorch/lib"
for binary in "${binaries[@]}"; do
  [[ -x "$binaries_dir/$binary" ]] || {
    log "$binaries_dir/$binary is missing: build it first (cargo build --workspace --bins$([[ $profile == release ]] && echo ' --release'))"
    exit 1
  }
done
[[ -d "$libtorch_lib" ]] || { log "$libtorch_lib is missing: run scripts/setup-libtorch.sh"; exit 1; }
# The probes run dflash-ops every few seconds: it must not load libtorch
# (skipped where binutils' readelf is missing).
if command -v readelf >/dev/null &&
  readelf -d "$binaries_dir/dflash-ops" | grep -E 'NEEDED.*(libtorch|libc10)' >&2; then
  log "$binaries_dir/dflash-ops links libtorch (above): it must not"
  exit 1
fi
}
[[ "$base_only" == true ]] || check_binaries

# --- 1. the base image, once ---------------------------------------------
make_base() {
  local mirror rootfs
  # The mirror apt is configured with (deb822 sources or the one-line form).
  mirror="$(
    { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' || true
      grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}' || true
    } | grep -v security | head -n1 || true
  )"
  mirror="${mirror:-http://deb.debian.org/debian}"
  command -v debootstrap >/dev/null || {
    log "installing debootstrap (Debian package)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >&2
  }
  rootfs="$(mktemp -d "${TMPDIR:-/tmp}/dflash-rootfs.XXXXXX")"
  # Removed however this ends (a half-made tree is never imported).
  trap 'rm -rf "$rootfs"' RETURN
  log "debootstrap bookworm minbase from $mirror (once; about a minute)"
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
    tail -20 "$rootfs.log" >&2; rm -f "$rootfs.log"; return 1
  }
  rm -f "$rootfs.log"
  # Smaller image: no apt lists, docs or caches.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase bookworm $mirror" - "$base" >&2
}

if [[ "$rebuild_base" == true ]] || ! docker image inspect "$base" >/dev/null 2>&1; then
  started=$SECONDS
  make_base
  log "base image $base made in $((SECONDS - started)) s"
else
  log "reusing base image $base"
fi

if [[ "$base_only" == true ]]; then
  echo "$base"
  exit 0
fi

# --- 2. the runtime image from the built binaries --------------------------
# A staging folder as the build context: libtorch's libraries hard-linked
# where possible (same file system), copied otherwise, symlinks resolved.
staging="$cache_root/image-context"
rm -rf "$staging"
mkdir -p "$staging/bin" "$staging/lib"
for binary in "${binaries[@]}"; do
  # Without debug info (a debug build's is most of its size); as is when
  # strip is missing.
  strip --strip-debug -o "$staging/bin/$binary" "$binaries_dir/$binary" 2>/dev/null ||
    cp "$binaries_dir/$binary" "$staging/bin/"
done
for library in "$libtorch_lib"/*; do
  resolved="$(readlink -f "$library")"
  cp -l "$resolved" "$staging/lib/$(basename "$library")" 2>/dev/null ||
    cp "$resolved" "$staging/lib/$(basename "$library")"
done
# The image runs as uid 10001, not root: whatever this shell's umask, the
# libraries are readable and the binaries executable by it, and writable by
# nobody but root.
chmod -R u=rwX,go=rX "$staging"
chmod 0755 "$staging"/bin/*
started=$SECONDS
# The classic builder (no buildx here) builds the stages before the target
# only: runtime-base and prebuilt, never the compile stage.
DOCKER_BUILDKIT=0 docker build --quiet \
  -f "$repo_root/deploy/Dockerfile" \
  --build-arg RUNTIME_IMAGE="$base" \
  --target prebuilt \
  -t "$tag" "$staging" >&2 2> >(grep -v -i "deprecat\|legacy builder\|buildx\|BuildKit\|environment-variable\|^ *$" >&2)
log "runtime image $tag built in $((SECONDS - started)) s from $binaries_dir"
echo "$tag"
