#!/usr/bin/env bash
# The operator's `dflash-ops status`, `top` and `health` need no libtorch:
# builds `dflash-ops` (clients/ops, part of every workspace build), checks
# that it links no libtorch, and runs it against a live broker with no
# libtorch on the library path, the way an operator's laptop or a bare
# container would.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# BIN_DIR (the first argument): where `make` built the binaries (its one
# test build); without it, dflash-ops and the broker are built here.
if [[ -n "${1:-}" ]]; then
  bin_dir="$1"
else
  cargo build --quiet -p dflash-ops --bin dflash-ops
  cargo build --quiet -p dflash-broker --bin broker
  bin_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug"
fi
for binary in dflash-ops broker; do
  [[ -x "$bin_dir/$binary" ]] || { echo "check-ops-cli: $bin_dir/$binary is missing (make test-build)" >&2; exit 1; }
done
ops_cli="$bin_dir/dflash-ops"
check_name=check-ops-cli
# shellcheck source=lib/check.sh
source "$repo_root/scripts/lib/check.sh"
links_no_torch() { ! ldd "$ops_cli" | grep -Eq 'libtorch|libc10'; }
check "dflash-ops links no libtorch" links_no_torch
no_torch_in_its_dependencies() { ! cargo tree -p dflash-ops -e normal --prefix none | grep -Eq '^(tch|torch-sys|dflash-model|dflash-device) '; }
check "dflash-ops depends on no libtorch crate" no_torch_in_its_dependencies

# The broker binds port 0 and writes the address it got (no free-port race).
work="$(mktemp -d)"
"$bin_dir/broker" --listen "127.0.0.1:0" --ready-file "$work/address" --expected-targets 3 >"$work/log" 2>&1 &
broker_pid=$!
trap 'kill "$broker_pid" 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 100); do
  if [[ -s "$work/address" ]]; then break; fi
  sleep 0.1
done
address="$(cat "$work/address")"
status_json() { env -u LD_LIBRARY_PATH "$ops_cli" status --json --broker "http://$address" 2>/dev/null; }
for _ in $(seq 1 100); do
  if status_json >/dev/null; then break; fi
  sleep 0.1
done
json_names_three_targets() { status_json | python3 -c 'import json,sys; s=json.load(sys.stdin); sys.exit(0 if s["expected_targets"] == 3 else 1)'; }
check "status --json reads a live broker" json_names_three_targets
table_shows_the_broker() { env -u LD_LIBRARY_PATH "$ops_cli" status --broker "http://$address" | grep -q "targets done 0/3"; }
check "status prints the top table" table_shows_the_broker
healthy() { env -u LD_LIBRARY_PATH "$ops_cli" health --broker "http://$address" | grep -q SERVING; }
check "health answers SERVING" healthy
no_model_commands() { ! "$ops_cli" --help | grep -Eq '^  (local|eval|init-tiny|regenerate) '; }
check "the model commands are not in dflash-ops" no_model_commands
finish
