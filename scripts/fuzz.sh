#!/usr/bin/env bash
# `make fuzz`: runs every cargo-fuzz target of tests/fuzz for FUZZ_SECONDS
# each (default 60), one after the other, and prints per target the
# executions, exec/s, crashes and libFuzzer's final coverage (cov, ft).
#
# Installs cargo-fuzz from crates.io when it is missing; needs the nightly
# toolchain (`cargo +nightly`). Builds into $CACHE_DIR/fuzz-target, not the
# repository. Each target starts from the committed corpus
# (tests/fuzz/corpus/<target>/, read only) plus a working corpus in the
# cache that keeps what earlier runs found; a crash's input is written to
# $CACHE_DIR/fuzz-artifacts/<target>/: copy it into the committed corpus
# (as `crash-<what>`) with its fix, and `cargo test` replays it from then on.
#
# FUZZ_TARGETS picks targets (default: all); FUZZ_ARGS adds libFuzzer flags.
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
cache_dir="${DFLASH_CACHE_DIR:-$HOME/.cache/dflash}"
seconds="${FUZZ_SECONDS:-60}"
target_dir="$cache_dir/fuzz-target"
fuzz_dir="tests/fuzz"

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzz: the nightly toolchain is needed (rustup toolchain install nightly)" >&2
  exit 1
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked || exit 1
fi

targets="${FUZZ_TARGETS:-$(cargo +nightly fuzz list --fuzz-dir "$fuzz_dir" | tr '\n' ' ')}"
echo "fuzz: building ${targets}" >&2
cargo +nightly fuzz build --fuzz-dir "$fuzz_dir" --target-dir "$target_dir" || exit 1
triple="$(rustc +nightly -vV | sed -n 's/^host: //p')"

summary=()
failed=0
for target in $targets; do
  working="$cache_dir/fuzz-corpus/$target"
  artifacts="$cache_dir/fuzz-artifacts/$target"
  log="$cache_dir/fuzz-logs/$target.log"
  mkdir -p "$working" "$artifacts" "$(dirname "$log")"
  echo "fuzz: $target for ${seconds}s (log: $log)" >&2
  started=$(date +%s)
  # The binary `cargo fuzz build` made, run as `cargo fuzz run` would run
  # it, without `run`'s rebuild check (a rebuild of a changed tree would
  # count against the target's time).
  # shellcheck disable=SC2086 # FUZZ_ARGS is a list of flags
  "$target_dir/$triple/release/$target" "$working" "$fuzz_dir/corpus/$target" \
    -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" ${FUZZ_ARGS:-} >"$log" 2>&1
  status=$?
  elapsed=$(( $(date +%s) - started ))
  executions=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  coverage=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$log" | tail -1)
  crash=$(grep -o 'Test unit written to [^ ]*' "$log" | tail -1 | sed 's/Test unit written to //')
  if [ "$status" -ne 0 ] || [ -n "$crash" ]; then
    failed=$((failed + 1))
    result="CRASH (exit $status) ${crash:-see the log}"
    grep -m1 -E 'panicked at|ERROR: libFuzzer|ERROR: AddressSanitizer' "$log" >&2 || true
  else
    result="no crash"
  fi
  summary+=("$(printf '%-18s %5ss %12s execs %8s exec/s  %-20s %s' \
    "$target" "$elapsed" "${executions:-?}" "${rate:-?}" "${coverage:-cov: ?}" "$result")")
done

echo
echo "fuzz: ${seconds}s per target, $(nproc) cores"
printf '%s\n' "${summary[@]}"
[ "$failed" -eq 0 ]
