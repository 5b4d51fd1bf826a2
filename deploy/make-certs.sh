#!/usr/bin/env bash
# The TLS material and the credentials of one dflash deployment, made with
# the openssl CLI into a folder of your choice (keep it outside the
# repository: nothing in it may be committed):
#
#   ca.pem, ca.key        a CA (P-256, self-signed). ca.key signs the broker's
#                         certificate and nothing else: keep it offline, it
#                         never goes into the cluster.
#   broker.pem, broker.key  the broker's certificate (serverAuth), naming
#                         `broker`, `broker.<namespace>.svc`,
#                         `broker.<namespace>.svc.cluster.local`, `localhost`
#                         and 127.0.0.1 (the probes and `kubectl
#                         port-forward`), plus every --dns name given.
#   target.token          the targets' token (32 random bytes, hex), one for
#                         every target (`target *`); with --target-ids
#                         ID,... instead one token per target, ID.token,
#                         good for that target only (`target ID`).
#   drafter.token         the drafters' token.
#   operator.token        the operator's token (`dflash status`, `top`).
#   credentials           the broker's --credentials file: one
#                         `role identity sha256:<hex>` line per token above,
#                         the SHA-256 of each token and never the token
#                         itself. The broker holds no token.
#
# With --secrets FOLDER it prints, from such a folder, the Kubernetes Secrets
# the manifests in deploy/k8s mount (`kubectl create secret --dry-run=client
# -o yaml`: no cluster is contacted), for `kubectl apply -n NS -f -`:
#
#   dflash-ca                  generic, ca.crt                every pod
#   dflash-broker-tls          kubernetes.io/tls, tls.crt/key the broker only
#   dflash-broker-credentials  generic, credentials (hashes)  the broker only
#   dflash-token-target        generic, token                 targets
#   dflash-token-drafter       generic, token                 drafters
#   dflash-token-operator      generic, token                 the operator pod
#
# (The targets' StatefulSet shares one Secret, so --secrets needs
# target.token: a folder made with --target-ids only is for compose.)
#
# Usage: deploy/make-certs.sh [--namespace NS] [--dns NAME]... [--days N]
#                             [--target-ids ID,ID,...] FOLDER
#        deploy/make-certs.sh --secrets FOLDER
# An existing file in FOLDER is never overwritten: remove it to make it anew.
# A credentials file that lacks the line of a token in FOLDER (or holds a
# token in the clear) is an error: add the line, or remove the file to make
# it anew from the tokens in FOLDER.
set -euo pipefail

usage() { sed -n '/^# Usage:/,/^# An existing/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
namespace=default
days=365
extra_names=()
target_ids=()
mode=make
folder=""
while (($#)); do
  case "$1" in
    --namespace) namespace="$2"; shift 2 ;;
    --dns) extra_names+=("$2"); shift 2 ;;
    --days) days="$2"; shift 2 ;;
    --target-ids) IFS=, read -r -a listed <<<"$2"; target_ids+=("${listed[@]}"); shift 2 ;;
    --secrets) mode=secrets; shift ;;
    -h | --help) usage ;;
    -*) echo "make-certs: unknown option $1" >&2; usage ;;
    *) [[ -z "$folder" ]] || usage; folder="$1"; shift ;;
  esac
done
[[ -n "$folder" ]] || usage
roles=(target drafter operator)
for id in "${target_ids[@]}"; do
  [[ "$id" =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$ ]] ||
    { echo "make-certs: --target-ids: $id is not an id (letters, digits, . _ -)" >&2; exit 2; }
  [[ " ${roles[*]} " != *" $id "* ]] ||
    { echo "make-certs: --target-ids: $id is a role's name, not a target id" >&2; exit 2; }
done

# The SHA-256 (hex) of the token in file $1, as the broker hashes it (the
# token without surrounding white space).
digest_of() {
  local token
  token="$(<"$1")"
  token="${token#"${token%%[![:space:]]*}"}"
  token="${token%"${token##*[![:space:]]}"}"
  printf %s "$token" | openssl dgst -sha256 -r | cut -d' ' -f1
}
# The per-target token files of the folder (ID.token, not a role's).
per_target_files() {
  local file
  for file in "$folder"/*.token; do
    [[ -e "$file" ]] || continue
    case "$(basename "$file")" in target.token | drafter.token | operator.token) ;; *) echo "$file" ;; esac
  done
}
# The credential line each token file of the folder needs, "FILE<TAB>LINE".
expected_lines() {
  local file
  [[ ! -e "$folder/target.token" ]] || printf '%s\ttarget * sha256:%s\n' "$folder/target.token" "$(digest_of "$folder/target.token")"
  while read -r file; do
    [[ -n "$file" ]] || continue
    printf '%s\ttarget %s sha256:%s\n' "$file" "$(basename "$file" .token)" "$(digest_of "$file")"
  done < <(per_target_files)
  for role in drafter operator; do
    [[ ! -e "$folder/$role.token" ]] || printf '%s\t%s * sha256:%s\n' "$folder/$role.token" "$role" "$(digest_of "$folder/$role.token")"
  done
}
# The credentials file holds every token's line, and hashes only.
verify_credentials() {
  local file line fields listed ok=0
  # The file's credentials, one "role identity token" each, spaces normalized.
  listed="$(awk '!/^[[:space:]]*(#|$)/ { print $1 " " $2 " " $3 }' "$folder/credentials")"
  while IFS=$'\t' read -r file line; do
    grep -Fxq -- "$line" <<<"$listed" || {
      echo "make-certs: $folder/credentials has no line for $file: add \`$line\`, or remove the file to make it anew from the tokens" >&2
      ok=1
    }
  done < <(expected_lines)
  while read -r -a fields; do
    ((${#fields[@]})) && [[ "${fields[0]}" != \#* ]] || continue
    [[ ${#fields[@]} -eq 3 && "${fields[2]}" =~ ^sha256:[0-9a-f]{64}$ ]] || {
      echo "make-certs: $folder/credentials: a line of role ${fields[0]} holds no sha256:<hex> (a token in the clear?): put the token's hash there (printf %s \"\$token\" | sha256sum)" >&2
      ok=1
    }
  done <"$folder/credentials"
  return $ok
}

if [[ "$mode" == secrets ]]; then
  for file in ca.pem broker.pem broker.key drafter.token operator.token credentials; do
    [[ -s "$folder/$file" ]] || { echo "make-certs: $folder/$file is missing (run without --secrets first)" >&2; exit 1; }
  done
  [[ -s "$folder/target.token" ]] || {
    echo "make-certs: $folder/target.token is missing: the targets' StatefulSet shares one token Secret (a folder with per-target tokens, made with --target-ids, is for compose: make another one without --target-ids for Kubernetes)" >&2
    exit 1
  }
  verify_credentials || exit 1
  command -v kubectl >/dev/null || { echo "make-certs: --secrets needs kubectl" >&2; exit 1; }
  secret() { kubectl create secret "$@" --dry-run=client -o yaml; }
  secret generic dflash-ca --from-file=ca.crt="$folder/ca.pem"
  echo ---
  secret tls dflash-broker-tls --cert="$folder/broker.pem" --key="$folder/broker.key"
  echo ---
  secret generic dflash-broker-credentials --from-file=credentials="$folder/credentials"
  for role in "${roles[@]}"; do
    echo ---
    secret generic "dflash-token-$role" --from-file=token="$folder/$role.token"
  done
  exit 0
fi

command -v openssl >/dev/null || { echo "make-certs: openssl is not installed" >&2; exit 1; }
mkdir -p "$folder"
umask 077
cd "$folder"
folder="$(pwd)"
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
# The tokens: the targets' shared one unless targets have their own (given
# now or made before), then the drafters' and the operator's.
token_files=()
if ((${#target_ids[@]})); then
  for id in "${target_ids[@]}"; do token_files+=("$id.token"); done
elif [[ -z "$(per_target_files)" ]]; then
  token_files+=(target.token)
fi
token_files+=(drafter.token operator.token)
for file in "${token_files[@]}"; do
  if [[ ! -e "$file" ]]; then
    openssl rand -hex 32 >"$file"
    made+=("$file")
  fi
done
if [[ ! -e credentials ]]; then
  {
    echo "# The broker's --credentials (deploy/make-certs.sh): role identity sha256:<hex of the token>."
    echo "# Each role's token is in its own file (ROLE.token, or TARGET-ID.token); the broker holds only these hashes."
    expected_lines | cut -f2
  } >credentials
  made+=(credentials)
fi
[[ ! -e token ]] ||
  echo "make-certs: $folder/token (the former shared run token) is no longer used: each role has its own ROLE.token; remove it once nothing reads it" >&2
# The certificates are public; keys, tokens and credentials stay readable by
# their owner only.
chmod 644 ca.pem broker.pem
chmod 600 ca.key broker.key credentials ./*.token
openssl verify -CAfile ca.pem broker.pem >/dev/null
verify_credentials || exit 1
echo "make-certs: ${made[*]:-nothing new} in $folder" >&2
