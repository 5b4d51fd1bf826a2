#!/usr/bin/env bash
# A multi-host test bed on one machine: N hosts, each a Linux network
# namespace with one link (a veth pair) into a switch namespace that holds a
# bridge, plus an unshaped control host from which the measuring command
# runs. A link profile shapes every host's link at both ends (host egress
# and switch-port egress): a tbf bandwidth cap, and a netem delay where the
# kernel has netem. Root only (iproute2).
#
#   scripts/hosts.sh run [--hosts N] [--tag TAG] [--profile P] [--on HOST] -- COMMAND...
#       builds the bed, applies profile P (default native), runs COMMAND in
#       the control host (or in host HOST, 0-based, with --on) with the bed
#       described in DFLASH_HOSTS_* (below), then tears everything down,
#       also on error, Ctrl-C or SIGTERM; exits with COMMAND's status.
#   scripts/hosts.sh profile NAME     (re)shape every link of the live bed
#   scripts/hosts.sh link HOST up|down   connect or cut host HOST (0-based)
#   scripts/hosts.sh profiles         list the profiles, runnable or not here
#   scripts/hosts.sh clean [--tag T]  remove a bed (a crashed run's, too)
#
# Names: every namespace of a bed is `dflash-<tag>-<role>` (h0..hN-1, sw,
# ctl), nothing is created in the root namespace, so removing the bed is
# removing its namespaces (which deletes their links), and `run` first
# removes whatever an earlier run with the same tag left behind. One bed
# per tag at a time: `run` holds /run/dflash-hosts-<tag>.lock.
#
# What COMMAND gets (and `profile`/`link` read back):
#   DFLASH_HOSTS_SCRIPT      this script's path
#   DFLASH_HOSTS_TAG         the tag
#   DFLASH_HOSTS_NAMESPACES  h0..hN-1, space separated (run a role with
#                            `ip netns exec NS ...`)
#   DFLASH_HOSTS_ADDRESSES   their IPv4 addresses, same order
#   DFLASH_HOSTS_PROFILES    the profiles runnable on this kernel
#   DFLASH_HOSTS_SKIPPED     the others, each `name:reason`, space separated
set -euo pipefail

script_path="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
subnet_prefix=10.77.0
control_address="$subnet_prefix.254"

# name | rate cap of each link, each direction (empty: none) | round trip
# between two hosts in microseconds (empty: none). A packet between two
# hosts crosses two shaped egresses (the sender's link, then the receiver's
# switch port), so each egress holds a quarter of the round trip.
profile_table() {
  cat <<'EOF'
native||
bw-10gbit|10gbit|
bw-1gbit|1gbit|
rtt-50us-10gbit|10gbit|50
rtt-500us-10gbit|10gbit|500
rtt-2ms-1gbit|1gbit|2000
EOF
}

die() { echo "hosts.sh: $*" >&2; exit 1; }

namespace() { echo "dflash-${tag}-$1"; }

netem_available() {
  # A throwaway namespace with a veth pair: netem is in the kernel when a
  # netem qdisc can be attached (a kernel without it says "Specified qdisc
  # kind is unknown"; there is no modprobe to load it here).
  local probe="dflash-netem-probe-$$" result=1
  ip netns add "$probe" 2>/dev/null || return 1
  if ip -n "$probe" link add probe0 type veth peer name probe1 2>/dev/null &&
    ip netns exec "$probe" tc qdisc add dev probe0 root netem delay 1us 2>/dev/null; then
    result=0
  fi
  ip netns del "$probe" 2>/dev/null || true
  return $result
}

# Sets runnable_profiles and skipped_profiles for this kernel.
classify_profiles() {
  runnable_profiles=""
  skipped_profiles=""
  local has_netem=0 name rate rtt_us
  netem_available && has_netem=1
  while IFS='|' read -r name rate rtt_us; do
    if [[ -n "$rtt_us" && $has_netem -eq 0 ]]; then
      skipped_profiles+="${skipped_profiles:+ }$name:no-netem-qdisc-in-this-kernel"
    else
      runnable_profiles+="${runnable_profiles:+ }$name"
    fi
  done < <(profile_table)
}

# The qdisc of one egress under profile $1 on device $2 in namespace $3.
shape_device() {
  local profile="$1" device="$2" ns="$3" rate rtt_us delay line
  line="$(profile_table | grep "^${profile}|")" || die "no profile '$profile' (scripts/hosts.sh profiles lists them)"
  IFS='|' read -r _ rate rtt_us <<<"$line"
  ip netns exec "$ns" tc qdisc del dev "$device" root 2>/dev/null || true
  if [[ -n "$rtt_us" ]]; then
    delay="$(awk -v rtt="$rtt_us" 'BEGIN { printf "%.3fus", rtt / 4 }')"
    # netem holds each packet for the delay and paces at the rate; its
    # queue holds 100 ms at the rate's packets of 1500 bytes.
    local bits_per_second
    bits_per_second="$(rate_bits "$rate")"
    ip netns exec "$ns" tc qdisc add dev "$device" root netem delay "$delay" rate "$rate" \
      limit $((bits_per_second / 8 / 10 / 1500 + 1000))
  elif [[ -n "$rate" ]]; then
    # Burst of one millisecond at the rate (at least 64 KiB, one GSO
    # segment); a queue of 10 ms at the rate before tbf drops.
    local bits_per_second burst
    bits_per_second="$(rate_bits "$rate")"
    burst=$((bits_per_second / 8 / 1000))
    ((burst < 65536)) && burst=65536
    ip netns exec "$ns" tc qdisc add dev "$device" root tbf rate "$rate" burst "$burst" latency 10ms
  fi
}

rate_bits() {
  case "$1" in
    *gbit) echo $((${1%gbit} * 1000000000)) ;;
    *mbit) echo $((${1%mbit} * 1000000)) ;;
    *) die "rate '$1': write it as Ngbit or Nmbit" ;;
  esac
}

bed_hosts() {
  # The host count of the live bed with this tag, from its namespaces.
  ip netns list | awk '{print $1}' | grep -c "^dflash-${tag}-h[0-9]*$" || true
}

apply_profile() {
  local profile="$1" hosts index
  hosts="$(bed_hosts)"
  ((hosts > 0)) || die "no bed with tag '$tag' is up"
  classify_profiles
  [[ " $runnable_profiles " == *" $profile "* ]] ||
    die "profile '$profile' cannot run here (${skipped_profiles:-unknown profile})"
  for ((index = 0; index < hosts; index++)); do
    shape_device "$profile" eth0 "$(namespace "h$index")"
    shape_device "$profile" "port$index" "$(namespace sw)"
  done
}

set_link() {
  local host="$1" state="$2"
  [[ "$state" == up || "$state" == down ]] || die "link HOST up|down"
  # The switch's side: the host keeps its address and its processes, and
  # sees its carrier go, as when a cable or a top-of-rack port fails.
  ip -n "$(namespace sw)" link set "port$host" "$state"
}

remove_bed() {
  local ns pid
  for ns in $(ip netns list | awk '{print $1}' | grep "^dflash-${tag}-" || true); do
    # Processes still in the bed's namespaces were started in it by this
    # script's command: end them by pid before the namespace goes.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      kill -KILL "$pid" 2>/dev/null || true
    done
    ip netns del "$ns" 2>/dev/null || true
  done
}

build_bed() {
  local hosts="$1" index ns
  ip netns add "$(namespace sw)"
  ip -n "$(namespace sw)" link add br0 type bridge
  ip -n "$(namespace sw)" link set br0 up
  ip -n "$(namespace sw)" link set lo up
  attach() { # namespace, port name, address
    ip netns add "$1"
    ip -n "$1" link set lo up
    ip -n "$1" link add eth0 type veth peer name "$2" netns "$(namespace sw)"
    ip -n "$1" addr add "$3/24" dev eth0
    ip -n "$1" link set eth0 up
    ip -n "$(namespace sw)" link set "$2" master br0
    ip -n "$(namespace sw)" link set "$2" up
  }
  for ((index = 0; index < hosts; index++)); do
    attach "$(namespace "h$index")" "port$index" "$subnet_prefix.$((index + 1))"
  done
  attach "$(namespace ctl)" portctl "$control_address"
  # Every link is up at both ends before the command starts (the bridge
  # forwards at once: STP is off on a bridge made by ip link).
  for ((index = 0; index < hosts; index++)); do
    ip -n "$(namespace "h$index")" -br link show eth0 | grep -q 'LOWER_UP' ||
      die "host h$index: its link did not come up"
  done
}

run_bed() {
  local hosts=9 profile=native on=ctl
  while (($#)); do
    case "$1" in
      --hosts) hosts="$2"; shift 2 ;;
      --on) on="h$2"; shift 2 ;;
      --tag) tag="$2"; shift 2 ;;
      --profile) profile="$2"; shift 2 ;;
      --) shift; break ;;
      *) die "run: unknown argument '$1'" ;;
    esac
  done
  (($#)) || die "run: no command after --"
  ((hosts >= 1 && hosts <= 250)) || die "run: --hosts between 1 and 250"
  [[ "$on" == ctl || ( "${on#h}" =~ ^[0-9]+$ && ${on#h} -lt $hosts ) ]] || die "run: --on takes a host of the bed (0..$((hosts - 1)))"
  [[ $EUID -eq 0 ]] || die "run: needs root (network namespaces)"
  exec 9>"/run/dflash-hosts-${tag}.lock"
  flock -w 600 9 || die "another bed with tag '$tag' held the lock for 10 minutes"
  remove_bed
  command_pid=""
  # Whatever ends the script tears the bed down; a signal first ends the
  # command (by its pid) so its processes are not killed mid-write unwarned.
  trap 'remove_bed' EXIT
  trap 'echo "hosts.sh: interrupted, tearing the bed down" >&2; [[ -n "$command_pid" ]] && kill -TERM "$command_pid" 2>/dev/null; wait "$command_pid" 2>/dev/null; exit 130' INT TERM
  build_bed "$hosts"
  classify_profiles
  apply_profile "$profile"
  local namespaces="" addresses="" index
  for ((index = 0; index < hosts; index++)); do
    namespaces+="${namespaces:+ }$(namespace "h$index")"
    addresses+="${addresses:+ }$subnet_prefix.$((index + 1))"
  done
  echo "hosts.sh: bed '$tag' up: $hosts hosts ($addresses), profile $profile; runnable profiles: $runnable_profiles${skipped_profiles:+; not here: $skipped_profiles}" >&2
  local status=0
  DFLASH_HOSTS_SCRIPT="$script_path" DFLASH_HOSTS_TAG="$tag" DFLASH_HOSTS_NAMESPACES="$namespaces" \
    DFLASH_HOSTS_ADDRESSES="$addresses" DFLASH_HOSTS_PROFILES="$runnable_profiles" \
    DFLASH_HOSTS_SKIPPED="$skipped_profiles" \
    ip netns exec "$(namespace "$on")" "$@" &
  command_pid=$!
  wait "$command_pid" || status=$?
  command_pid=""
  return $status
}

tag="${DFLASH_HOSTS_TAG:-bench}"
case "${1:-}" in
  run) shift; run_bed "$@" ;;
  profile) [[ $# -eq 2 ]] || die "profile NAME"; apply_profile "$2" ;;
  link) [[ $# -eq 3 ]] || die "link HOST up|down"; set_link "$2" "$3" ;;
  profiles)
    classify_profiles
    while IFS='|' read -r name rate rtt_us; do
      state="runnable"
      [[ " $runnable_profiles " == *" $name "* ]] || state="not here: no netem qdisc in this kernel"
      printf '%-18s link cap %-7s added round trip %-8s %s\n' "$name" "${rate:-none}" "${rtt_us:+${rtt_us}us}${rtt_us:-none}" "$state"
    done < <(profile_table)
    ;;
  clean)
    shift
    [[ "${1:-}" == --tag ]] && tag="$2"
    remove_bed
    ;;
  *) sed -n '2,32p' "$script_path" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
