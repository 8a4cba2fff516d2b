#!/usr/bin/env bash
# Hosts for the multi-host tests (tests/hosts): Linux network namespaces on one bridge, on a private subnet that
# never leaves this machine. Root only (ip netns).
#
#   scripts/netns.sh up NAME=IP ...   the root namespace first gets `ip route replace blackhole 10.231.0.0/24` (so
#                                     nothing addressed to the test subnet can leave the machine: the root namespace
#                                     routes 10.0.0.0/8 outside); then the namespace emh-bridge holds the bridge, and
#                                     each host is a namespace emh-NAME whose eth0 (IP/24) is one end of a veth whose
#                                     other end (v-NAME) sits on the bridge. No interface of the test lives in the
#                                     root namespace.
#   scripts/netns.sh link NAME down|up
#                                     cut or restore host NAME's link (its bridge-side veth end): its peers' packets
#                                     are dropped, no reset is sent, as when a cable is pulled
#   scripts/netns.sh clean            SIGKILL every process left inside an emh-* namespace (only the tests start
#                                     processes there), delete those namespaces (their veths go with them) and the
#                                     blackhole route; safe to run at any time, idempotent (`make test-hosts-clean`)
#   scripts/netns.sh list             the test's namespaces that exist now
set -euo pipefail

PREFIX=emh-
BRIDGE=${PREFIX}bridge
SUBNET=10.231.0.0/24
NET=10.231.0.

die() { echo "[netns] $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "needs root (ip netns)"
command -v ip >/dev/null || die "no ip command (Debian: iproute2)"

ours() { ip netns list 2>/dev/null | awk '{print $1}' | grep "^${PREFIX}" || true; }

clean() {
  local ns pid
  for ns in $(ours); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
  done
  for ns in $(ours); do
    # A process still exiting keeps the namespace's name bound for a moment: retry a few times.
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      ip netns del "$ns" 2>/dev/null && break
      sleep 0.2
    done
  done
  ip route del blackhole "$SUBNET" 2>/dev/null || true
  [[ -z "$(ours)" ]] || die "namespaces left: $(ours | tr '\n' ' ')"
}

up() {
  ip route replace blackhole "$SUBNET"
  ip netns add "$BRIDGE"
  ip -n "$BRIDGE" link add br0 type bridge
  ip -n "$BRIDGE" link set br0 up
  local spec name addr
  for spec in "$@"; do
    name=${spec%%=*}; addr=${spec#*=}
    [[ "$name" =~ ^[a-z0-9]{1,11}$ ]] || die "bad host name '$name' (a-z0-9, at most 11 characters)"
    [[ "$addr" == "$NET"* ]] || die "address $addr is outside $SUBNET"
    ip netns add "${PREFIX}${name}"
    ip -n "$BRIDGE" link add "v-${name}" type veth peer name eth0 netns "${PREFIX}${name}"
    ip -n "$BRIDGE" link set "v-${name}" master br0 up
    ip -n "${PREFIX}${name}" link set lo up
    ip -n "${PREFIX}${name}" addr add "${addr}/24" dev eth0
    ip -n "${PREFIX}${name}" link set eth0 up
  done
}

link() {
  local name=${1:?host} state=${2:?down|up}
  [[ "$state" == up || "$state" == down ]] || die "link state must be up or down"
  ip -n "$BRIDGE" link set "v-${name}" "$state"
}

cmd=${1:-}
shift || true
case "$cmd" in
  up) up "$@" ;;
  link) link "$@" ;;
  clean) clean ;;
  list) ours ;;
  *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
