#!/usr/bin/env bash
# Mutation check of the queue's and the lighthouse's rules (issues 43, 48):
# each named mutant below breaks one rule of broker/src/queue (the
# end-of-stream rule, the completion counter, the ack ledger, dead letters,
# leases, target failure, what is refused after the end, a data-parallel
# step's pinned samples) or of broker/src/lighthouse (quorums only at H with
# a holder, the majority, commits only while H is the round's, UNKNOWN never
# a no, commits answered once durable, the wait bound) with a one-line perl
# substitution; their tests (`cargo test -p dflash-broker --lib -- queue
# lighthouse`: scenario, unit and property tests) must then FAIL, or the
# mutant survived.
#
# Each mutant is applied in place to the working tree and reverted from a
# copy taken first (a trap restores every file however the script ends),
# then the tree is checked to be as it was. A mutant whose pattern no longer
# matches the source is reported NOT APPLIED and fails the check (the list
# must follow the code). The unmutated tests run first and must pass.
#
# Usage: bash scripts/mutants.sh [NAME...]   (default: every mutant)
# Env: MUTANT_TIMEOUT seconds per test run, its build not counted (default
# 600; a hang counts as killed, the run is stopped). Prints one line per mutant, then
# `mutants: K killed, S survived, N not applied (of T)`; exits non-zero
# unless every mutant was killed.
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
cargo="${CARGO:-cargo}"
timeout_s="${MUTANT_TIMEOUT:-600}"
queue=broker/src/queue
lighthouse=broker/src/lighthouse

names=()
files=()
exprs=()
# mutant NAME FILE PERL-EXPRESSION (run with perl -0pi -e: the whole file is
# one string, so an expression may span lines; each must change the file).
mutant() { names+=("$1"); files+=("$2"); exprs+=("$3"); }

# --- the end-of-stream rule (ledger.rs, update_broker_state) ---------------
mutant eos-finishes-with-one-target-running "$queue/ledger.rs" \
  's/let all_finished = self\.finished_targets\(\) >= self\.config\.expected_targets\(\);/let all_finished = self.finished_targets() + 1 >= self.config.expected_targets();/'
mutant eos-ignores-leased-items "$queue/ledger.rs" \
  's/if self\.queue\.is_empty\(\) && self\.leases\.is_empty\(\) && self\.pinned\.is_empty\(\) \{/if self.queue.is_empty() \&\& self.pinned.is_empty() {/'
mutant eos-ignores-queued-items "$queue/ledger.rs" \
  's/if self\.queue\.is_empty\(\) && self\.leases\.is_empty\(\) && self\.pinned\.is_empty\(\) \{/if self.leases.is_empty() \&\& self.pinned.is_empty() {/'
mutant eos-ignores-pinned-items "$queue/ledger.rs" \
  's/if self\.queue\.is_empty\(\) && self\.leases\.is_empty\(\) && self\.pinned\.is_empty\(\) \{/if self.queue.is_empty() \&\& self.leases.is_empty() {/'
mutant eos-never-drains "$queue/ledger.rs" \
  's/\} else \{\n            self\.state = BrokerState::Draining;\n/} else {\n/'
mutant end-allows-produce-after-the-end "$queue/producers.rs" \
  's/(let target_key = self\.producer_target\(connection\)\?;)\n        self\.ensure_not_ended\(\)\?;/$1/'

# --- the completion counter (producers.rs report_done, mod.rs) -------------
mutant counter-ignores-failed-targets "$queue/mod.rs" \
  's/matches!\(self\.state, TargetState::Done \| TargetState::Failed \{ \.\. \}\)/matches!(self.state, TargetState::Done)/'
mutant counter-repeated-done-is-new "$queue/producers.rs" \
  's/let already_done = entry\.state == TargetState::Done;/let already_done = false;/'
mutant counter-accepts-a-wrong-count "$queue/producers.rs" \
  's/if accepted != total_items \{/if false \&\& accepted != total_items {/'
mutant counter-accepts-a-fenced-epoch "$queue/producers.rs" \
  's/if epoch != entry\.epoch \{/if false \&\& epoch != entry.epoch {/'
mutant counter-done-after-failure "$queue/producers.rs" \
  's/(let Some\(entry\) = self\.targets\.get\(&key\) else \{\n(?:.*\n){3}\s*\};\n\s*)if let TargetState::Failed \{ reason \} = &entry\.state \{/${1}if let Some(TargetState::Failed { reason }) = None::<\&TargetState> {/'
mutant counter-done-after-abort "$queue/producers.rs" \
  's/if self\.state == BrokerState::Aborted \{\n            return Err\(QueueError::RunEnded \{/if false {\n            return Err(QueueError::RunEnded {/'

# --- the ack ledger (consumers.rs, ledger.rs take_lease) -------------------
mutant ack-accepts-another-streams-lease "$queue/ledger.rs" \
  's/Some\(lease\) if lease\.connection == connection => \{\}/Some(_) => {}/'
mutant ack-counts-stale-as-acked "$queue/consumers.rs" \
  's/(outcome\.acked \+= 1;\n                \}\n                )None => outcome\.stale \+= 1,/${1}None => outcome.acked += 1,/'
mutant ack-leaves-the-lease-open "$queue/consumers.rs" \
  's/(pub fn ack\((?:.*\n){8}\s*)match self\.take_lease\(connection, delivery_id\) \{/${1}match self.leases.get(\&delivery_id).filter(|lease| lease.connection == connection).map(|lease| lease.item_id) {/'
mutant ack-stale-ack-leaves-stream-stalled "$queue/consumers.rs" \
  's/(None => outcome\.stale \+= 1,\n            \}\n        \}\n        )self\.consumer_alive\(connection, now\);\n        self\.dispatch\(now\);\n        outcome\n    \}\n\n    \/\/\/ Returns deliveries/${1}if outcome.acked > 0 { self.consumer_alive(connection, now); }\n        self.dispatch(now);\n        outcome\n    }\n\n    \/\/\/ Returns deliveries/'
mutant nack-poison-is-requeued "$queue/consumers.rs" \
  's/match disposition \{/match NackDisposition::Requeue {/'
mutant nack-drops-the-item "$queue/consumers.rs" \
  's/NackDisposition::Requeue => returned\.push\(item_id\),/NackDisposition::Requeue => {}/'

# --- dead letters and leases (ledger.rs) -----------------------------------
mutant dead-letter-branch-dropped "$queue/ledger.rs" \
  's/if item\.deliveries >= self\.config\.max_deliveries \{/if false {/'
mutant dead-letter-one-delivery-late "$queue/ledger.rs" \
  's/if item\.deliveries >= self\.config\.max_deliveries \{/if item.deliveries > self.config.max_deliveries {/'
mutant lease-expires-one-tick-late "$queue/ledger.rs" \
  's/\.take_while\(\|\(deadline, _\)\| \*deadline <= now\)/.take_while(|(deadline, _)| *deadline < now)/'
mutant lease-expiry-does-not-stall "$queue/ledger.rs" \
  's/entry\.expired_leases \+= 1;\n                entry\.stalled = true;/entry.expired_leases += 1;/'
mutant disconnect-keeps-leases-out "$queue/consumers.rs" \
  's/self\.return_to_head\(returned, "drafter disconnected"\);//'

# --- targets: failure, duplicates, done (ledger.rs, producers.rs) ----------
mutant grace-fails-one-tick-late "$queue/ledger.rs" \
  's/now\.saturating_duration_since\(since\) >= grace/now.saturating_duration_since(since) > grace/'
mutant continue-policy-aborts "$queue/ledger.rs" \
  's/FailurePolicy::Continue => self\.dispatch\(now\),/FailurePolicy::Continue => self.abort(reason),/'
mutant produce-after-done-accepted "$queue/producers.rs" \
  's/if entry\.state == TargetState::Done \{\n            entry\.rejected_items \+= 1;/if false {\n            entry.rejected_items += 1;/'
mutant duplicate-queued-again "$queue/producers.rs" \
  's/if entry\.accepted_seqs\.contains\(seq\) \{/if false \&\& entry.accepted_seqs.contains(seq) {/'
mutant dispatch-ignores-credit "$queue/ledger.rs" \
  's/&& items < u64::from\(entry\.credit\.items\)//'

# --- data-parallel steps' samples (steps.rs) --------------------------------
mutant pin-ignores-the-sample-key "$queue/steps.rs" \
  's/&\*item\.target_id == \*target_id && item\.seq == \*seq/true/'
mutant abort-charges-every-sample "$queue/steps.rs" \
  's/if !charge_on_abort \{/if false {/'
mutant commit-journals-no-record "$queue/steps.rs" \
  's/self\.record\(JournalEntry::StepCommitted \{\n            record,\n            acked: acked\.clone\(\),\n        \}\);//'

# --- the lighthouse (state.rs, votes.rs, types.rs) --------------------------
mutant quorum-without-a-holder-of-h "$lighthouse/state.rs" \
  's/if self\.adopting\n            \|\| self/if true || self.adopting\n            || self/'
mutant quorum-without-a-majority "$lighthouse/state.rs" \
  's/asking \* 2 > live\.len\(\)/asking > 0/'
mutant commit-ignores-h "$lighthouse/votes.rs" \
  's/if round\.base != self\.record \{/if false {/'
mutant unknown-reads-as-no "$lighthouse/votes.rs" \
  's/Decision::unknown\(format!/Decision::abort(format!/g'
mutant commit-answered-before-durable "$lighthouse/votes.rs" \
  's/if round\.durable \{/if true {/'
mutant wait-bound-ignores-collective-timeout "$lighthouse/types.rs" \
  's/\.max\(collective_timeout \+ longest_step\.saturating_mul\(2\)\)//'
mutant lateness-ignores-the-members-last-ask "$lighthouse/state.rs" \
  's/let since = started\.max\(clock\.seen_at\);/let since = started;/'

selected=("$@")
wanted() {
  [[ ${#selected[@]} -eq 0 ]] && return 0
  local name
  for name in "${selected[@]}"; do [[ "$name" == "$1" ]] && return 0; done
  return 1
}

backup="$(mktemp -d)"
mutated=""
restore() {
  if [[ -n "$mutated" ]]; then
    cp "$backup/${mutated//\//_}" "$mutated"
    mutated=""
  fi
}
trap 'restore; exit 130' INT TERM
for file in $(printf '%s\n' "${files[@]}" | sort -u); do
  cp "$file" "$backup/${file//\//_}"
done
# Proptest saves each failing case in its regressions file: the mutants'
# cases are kept out of the tree.
regressions=broker/proptest-regressions/queue/proptests.txt
cp "$regressions" "$backup/regressions"
trap 'restore; cp "$backup/regressions" "$regressions"; rm -rf "$backup"' EXIT

# Incremental compilation on, whatever the caller's CARGO_INCREMENTAL (CI
# turns it off for the one workspace build): each mutant changes one line of
# the broker, and an incremental rebuild of its unit tests takes about 4 s
# on the 2-core machine against 20 s from scratch (37 mutants: 9 minutes).
#
# The build comes first and is not under MUTANT_TIMEOUT, which bounds the
# tests alone (once the first build took the whole 600 s, and the unmutated
# run was reported failing). The first build compiles our crates under the
# broker incrementally and reuses every dependency from the workspace's test
# build: crates/feature-pins makes `-p dflash-broker` resolve their features
# as the workspace does (before it, this build compiled 39 crates, jemalloc's
# C among them: 2 min 9 s on an idle 2-core machine, now 27 s). A build that
# fails is the mutant's log's `error[...]`, reported INVALID below.
run_tests() {
  CARGO_INCREMENTAL=1 nice -n 10 "$cargo" test -q -p dflash-broker --lib --no-run >"$1" 2>&1 || return 101
  CARGO_INCREMENTAL=1 timeout "$timeout_s" nice -n 10 "$cargo" test -q -p dflash-broker --lib -- queue lighthouse >>"$1" 2>&1
}

started=$SECONDS
log="$backup/baseline.log"
if ! run_tests "$log"; then
  tail -30 "$log"
  echo "mutants: the unmutated queue and lighthouse tests fail; nothing to measure"
  exit 1
fi
echo "mutants: baseline passes ($((SECONDS - started)) s)"

killed=0
survived=0
not_applied=0
total=0
for index in "${!names[@]}"; do
  name="${names[$index]}"
  file="${files[$index]}"
  wanted "$name" || continue
  total=$((total + 1))
  mutated="$file"
  perl -0pi -e "${exprs[$index]}" "$file"
  if cmp -s "$file" "$backup/${file//\//_}"; then
    restore
    echo "mutant $name: NOT APPLIED (its pattern no longer matches $file)"
    not_applied=$((not_applied + 1))
    continue
  fi
  started=$SECONDS
  log="$backup/$name.log"
  run_tests "$log"
  rc=$?
  restore
  took=$((SECONDS - started))
  if [[ $rc -eq 0 ]]; then
    echo "mutant $name: SURVIVED [$took s]"
    survived=$((survived + 1))
  else
    if [[ $rc -eq 124 ]]; then
      why="timed out after $timeout_s s"
    elif grep -qE '^error\[E[0-9]+\]|^error: could not compile' "$log"; then
      echo "mutant $name: INVALID, does not compile: $(grep -m1 -E '^error' "$log")"
      not_applied=$((not_applied + 1))
      continue
    else
      failing="$(grep -E '^    (queue|lighthouse)::' "$log" | sed 's/^ *//' | sort -u)"
      why="$(grep -c . <<<"$failing") failing: $(paste -sd ' ' - <<<"$failing")"
    fi
    echo "mutant $name: killed [$took s] by ${why:-a failing test}"
    killed=$((killed + 1))
  fi
done
for file in $(printf '%s\n' "${files[@]}" | sort -u); do
  cmp -s "$file" "$backup/${file//\//_}" || { echo "mutants: $file was not restored"; exit 1; }
done
echo "mutants: $killed killed, $survived survived, $not_applied not applied (of $total)"
[[ $survived -eq 0 && $not_applied -eq 0 ]]
