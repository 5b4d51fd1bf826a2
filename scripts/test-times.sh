#!/usr/bin/env bash
# The slowest tests of the workspace, timed by libtest itself: runs every
# test binary of the test build (`make test-build`) once, each from its
# package's folder as `cargo test` does, with `--report-time`
# (`-Z unstable-options`, accepted by a stable-built test binary only when
# RUSTC_BOOTSTRAP is set in its environment: set here for the test binaries
# alone, never for cargo or rustc, so nothing is rebuilt), and prints the
# N slowest (default 20) as `seconds  binary  test`.
#
# Usage: scripts/test-times.sh [N] [FILTER]   (FILTER: only binaries whose
# name contains it). Same features as `make test`.
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
count="${1:-20}"
filter="${2:-}"
cd "$repo_root"
features=(--features dflash-target-server/test-hooks,dflash-drafter-server/test-hooks)
times="$(mktemp)"
trap 'rm -f "$times"' EXIT
export DFLASH_LOCAL_RUN_DIR="$repo_root/runs/test-local"
cargo test --workspace --no-run "${features[@]}" --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable") and message["profile"]["test"]:
        manifest = message["manifest_path"].rsplit("/", 1)[0]
        print(manifest, message["executable"], message["target"]["name"])
' | while read -r package_dir executable name; do
  [[ -z "$filter" || "$name" == *"$filter"* ]] || continue
  (cd "$package_dir" && RUSTC_BOOTSTRAP=1 "$executable" -Z unstable-options --report-time 2>&1) |
    sed -nE "s/^test (.+) \.\.\. (ok|FAILED|ignored) <([0-9.]+)s>.*/\3 $name \1 \2/p" >>"$times"
done
sort -rn "$times" | head -n "$count" | awk '{ printf "%8.2f s  %-22s %s %s\n", $1, $2, $3, ($4 == "ok" ? "" : $4) }'
