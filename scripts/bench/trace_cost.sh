#!/usr/bin/env bash
# What exporting traces costs, side by side: `dflash local` on the demo,
# alternately without an OTLP endpoint and with every process exporting to a
# real OTLP/gRPC receiver (scripts/bench/otlp_sink.py), RUNS times each. The
# CPU time of the whole process tree (user + system of dflash local and every
# child it waited for) and the pipeline's wall time are printed per run and
# as means. Needs a release build (`make release`) and a Python with
# `opentelemetry-proto` and `grpcio` (PYTHON, default python3).
#
#   RUNS=3 bash scripts/bench/trace_cost.sh
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
runs="${RUNS:-3}"
python="${PYTHON:-python3}"
dflash="${CARGO_TARGET_DIR:-$repo_root/target}/release/dflash"
[ -x "$dflash" ] || { echo "no release build at $dflash: run make release" >&2; exit 1; }
work="$(mktemp -d)"
trap 'kill "${sink_pid:-}" 2>/dev/null || true; rm -rf "$work"' EXIT
port=$(( 20000 + RANDOM % 20000 ))
"$python" "$repo_root/scripts/bench/otlp_sink.py" "127.0.0.1:$port" > "$work/sink.log" 2>&1 &
sink_pid=$!
for _ in $(seq 50); do grep -q 'otlp sink on' "$work/sink.log" && break; sleep 0.1; done
grep -q 'otlp sink on' "$work/sink.log" || { cat "$work/sink.log" >&2; exit 1; }

one_run() { # $1: label, $2: endpoint or empty
  local label="$1" endpoint="$2"
  local dir="$work/$label-$3" cpu
  mkdir -p "$dir"
  local -a env_args=(OTEL_SDK_DISABLED=false)
  [ -n "$endpoint" ] && env_args=(OTEL_EXPORTER_OTLP_ENDPOINT="$endpoint")
  TIMEFORMAT='%U %S'
  cpu=$( { time env "${env_args[@]}" "$dflash" local --workdir "$dir" --view none \
      > "$dir/out.log" 2>&1; } 2>&1 )
  grep -q 'end-of-stream: COMPLETE' "$dir/out.log" || { tail -30 "$dir/out.log" >&2; exit 1; }
  local pipeline
  pipeline=$(sed -n 's/.*pipeline \([0-9.]*\)s.*/\1/p' "$dir/out.log" | head -1)
  local total
  total=$(awk '{printf "%.1f", $1 + $2}' <<<"$cpu")
  echo "$label run $3: cpu ${total}s (user+sys) pipeline ${pipeline}s"
  echo "$label $total $pipeline" >> "$work/results"
}

for run in $(seq "$runs"); do
  one_run none "" "$run"
  one_run otlp "http://127.0.0.1:$port" "$run"
done
kill -TERM "$sink_pid"; wait "$sink_pid" || true
cat "$work/sink.log" | tail -1
awk '{cpu[$1] += $2; wall[$1] += $3; n[$1]++}
     END {for (k in n) printf "%s: mean cpu %.1fs, mean pipeline %.1fs over %d runs\n", k, cpu[k]/n[k], wall[k]/n[k], n[k];
          if (n["none"] && n["otlp"]) printf "export cost: %+.1f%% cpu\n", 100 * (cpu["otlp"]/n["otlp"] - cpu["none"]/n["none"]) / (cpu["none"]/n["none"])}' "$work/results"
