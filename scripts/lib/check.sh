# The check scripts' shared helpers (sourced, not run). Set `check_name`
# (the prefix of every line, e.g. check-k8s) before sourcing.
#
#   check NAME COMMAND [ARGS...]  runs COMMAND; prints "ok   NAME" or
#                                 "FAIL NAME" and counts it
#   finish                        prints "<name>: P passed, F failed" (the
#                                 line .ci/run adds up) and exits 0 only
#                                 when nothing failed
passed=0
failed=0
check() {
  local name="$1"; shift
  if "$@"; then echo "$check_name: ok   $name"; passed=$((passed + 1))
  else echo "$check_name: FAIL $name"; failed=$((failed + 1)); fi
}
finish() { echo "$check_name: $passed passed, $failed failed"; [[ $failed -eq 0 ]]; exit $?; }
