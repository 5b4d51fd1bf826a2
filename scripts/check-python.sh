#!/usr/bin/env bash
# The Python client's tests (clients/python/tests, pytest) against the real
# broker, target-server and drafter-server binaries in BIN_DIR, in a venv
# holding exactly what the package declares for its tests
# (`pip install "clients/python[test]"`, scripts/python-venv.sh client): an
# import the package does not declare fails here as it fails for a user.
# This checkout's client is pip-installed (non-editable, --no-deps) into a
# folder of the checkout and imported from there, so several checkouts
# sharing the venv never overwrite each other's copy.
#
# The TLS tests need the openssl command line.
#
# Usage: scripts/check-python.sh BIN_DIR   (e.g. target/debug)
# Last line: `check-python: N passed, M failed` (.ci/run adds it up).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin_dir="${1:?usage: check-python.sh BIN_DIR}"
[[ "$bin_dir" = /* ]] || bin_dir="$repo_root/$bin_dir"
for binary in broker target-server drafter-server dflash; do
  [[ -x "$bin_dir/$binary" ]] || { echo "check-python: $bin_dir/$binary is missing (cargo build --workspace --bins)" >&2; exit 1; }
done
# The TLS tests make their certificates with the openssl command line.
command -v openssl >/dev/null || { echo "check-python: openssl is not on PATH (the TLS tests make their certificates with it)" >&2; exit 1; }
python="$(bash "$repo_root/scripts/python-venv.sh" client)"

site="$repo_root/clients/python/build/installed"
rm -rf "$site"
"$python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  --target "$site" "$repo_root/clients/python" >&2

report="$(mktemp)"
trap 'rm -f "$report"' EXIT
status=0
# From the repository root, so `dflash_client` comes from the installed copy.
(cd "$repo_root" && DFLASH_BIN_DIR="$bin_dir" PYTHONPATH="$site" \
  "$python" -m pytest clients/python/tests -q -p no:cacheprovider --junitxml="$report") || status=$?
"$python" - "$report" <<'PY' || status=1
import sys
import xml.etree.ElementTree as ElementTree

root = ElementTree.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
tests = sum(int(suite.get("tests", 0)) for suite in suites)
failed = sum(int(suite.get("failures", 0)) + int(suite.get("errors", 0)) for suite in suites)
skipped = sum(int(suite.get("skipped", 0)) for suite in suites)
if skipped:
    print(f"check-python: {skipped} tests skipped, counted as failed (every test must run)", file=sys.stderr)
print(f"check-python: {tests - failed - skipped} passed, {failed + skipped} failed")
sys.exit(1 if failed + skipped else 0)
PY
exit "$status"
