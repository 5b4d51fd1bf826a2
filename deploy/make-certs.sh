#!/usr/bin/env bash
# The TLS material and the run token of one dflash deployment, made with the
# openssl CLI into a folder of your choice (keep it outside the repository:
# nothing in it may be committed):
#
#   ca.pem, ca.key        a CA (P-256, self-signed). ca.key signs the broker's
#                         certificate and nothing else: keep it offline, it
#                         never goes into the cluster.
#   broker.pem, broker.key  the broker's certificate (serverAuth), naming
#                         `broker`, `broker.<namespace>.svc`,
#                         `broker.<namespace>.svc.cluster.local`, `localhost`
#                         and 127.0.0.1 (the probes and `kubectl
#                         port-forward`), plus every --dns name given.
#   token                 the run's bearer token (32 random bytes, hex).
#
# With --secrets FOLDER it prints, from such a folder, the Kubernetes Secrets
# the manifests in deploy/k8s mount (`kubectl create secret --dry-run=client
# -o yaml`: no cluster is contacted), for `kubectl apply -n NS -f -`:
#
#   dflash-ca               generic, ca.crt                 every pod
#   dflash-broker-tls       kubernetes.io/tls, tls.crt/key  the broker only
#   dflash-token-target     generic, token                  targets
#   dflash-token-drafter    generic, token                  drafters
#   dflash-token-operator   generic, token                  the operator pod
#
# (The broker mounts the three token Secrets. It does not yet tell roles
# apart, so the three carry the same run token.)
#
# Usage: deploy/make-certs.sh [--namespace NS] [--dns NAME]... [--days N] FOLDER
#        deploy/make-certs.sh --secrets FOLDER
# An existing file in FOLDER is never overwritten: remove it to make it anew.
set -euo pipefail

usage() { sed -n '/^# Usage:/,/^# An existing/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
namespace=default
days=365
extra_names=()
mode=make
folder=""
while (($#)); do
  case "$1" in
    --namespace) namespace="$2"; shift 2 ;;
    --dns) extra_names+=("$2"); shift 2 ;;
    --days) days="$2"; shift 2 ;;
    --secrets) mode=secrets; shift ;;
    -h | --help) usage ;;
    -*) echo "make-certs: unknown option $1" >&2; usage ;;
    *) [[ -z "$folder" ]] || usage; folder="$1"; shift ;;
  esac
done
[[ -n "$folder" ]] || usage

if [[ "$mode" == secrets ]]; then
  for file in ca.pem broker.pem broker.key token; do
    [[ -s "$folder/$file" ]] || { echo "make-certs: $folder/$file is missing (run without --secrets first)" >&2; exit 1; }
  done
  command -v kubectl >/dev/null || { echo "make-certs: --secrets needs kubectl" >&2; exit 1; }
  secret() { kubectl create secret "$@" --dry-run=client -o yaml; }
  secret generic dflash-ca --from-file=ca.crt="$folder/ca.pem"
  echo ---
  secret tls dflash-broker-tls --cert="$folder/broker.pem" --key="$folder/broker.key"
  for role in target drafter operator; do
    echo ---
    secret generic "dflash-token-$role" --from-file=token="$folder/token"
  done
  exit 0
fi

command -v openssl >/dev/null || { echo "make-certs: openssl is not installed" >&2; exit 1; }
mkdir -p "$folder"
umask 077
cd "$folder"
made=()
if [[ ! -e ca.pem ]]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
    -subj "/CN=dflash CA" -keyout ca.key -out ca.pem 2>/dev/null
  made+=(ca.pem ca.key)
fi
if [[ ! -e broker.pem ]]; then
  names="DNS:broker,DNS:broker.$namespace.svc,DNS:broker.$namespace.svc.cluster.local,DNS:localhost,IP:127.0.0.1"
  for name in "${extra_names[@]}"; do names+=",DNS:$name"; done
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -subj "/CN=broker" -keyout broker.key -out broker.csr 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' "$names" >broker.ext
  openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days "$days" \
    -extfile broker.ext -out broker.pem 2>/dev/null
  rm -f broker.csr broker.ext ca.srl
  made+=(broker.pem broker.key)
fi
if [[ ! -e token ]]; then
  openssl rand -hex 32 >token
  made+=(token)
fi
# The certificates are public; keys and the token stay readable by their owner only.
chmod 644 ca.pem broker.pem
openssl verify -CAfile ca.pem broker.pem >/dev/null
echo "make-certs: ${made[*]:-nothing new} in $(pwd)" >&2
