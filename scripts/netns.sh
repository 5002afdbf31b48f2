#!/usr/bin/env bash
# Throttled links between replica processes on one machine (root; Debian's iproute2).
#
#   scripts/netns.sh up M RATE [DELAY] [LOSS]   # e.g. up 2 100mbit 1ms; up 5 10mbit 100ms 1%
#   scripts/netns.sh shape M RATE [DELAY] [LOSS] # change rate/delay/loss of existing links
#   scripts/netns.sh down M
#   scripts/netns.sh status M
#
# Topology: replica i (0-based) lives in network namespace `dlrep$i` with one interface
# `eth0` = 10.77.0.$((i+1))/24, a veth pair whose other end `dlv$i` sits on bridge `dlbr0` in the
# root namespace. Every replica's egress (eth0 inside its namespace) is shaped by a token
# bucket (tbf) at RATE (integer with kbit|mbit|gbit) whose burst is 5 ms of RATE (at least 4 KiB,
# so that a payload cannot pass at line rate on saved-up tokens), with a netem child adding a one-way DELAY and
# dropping LOSS of the packets when either is not 0 (needs the sch_netem kernel module; the script says so if it is
# missing, and the links keep their rate). A transfer between two
# replicas therefore crosses exactly one shaped hop per direction, like one datacenter uplink.
# Run a command in replica i's namespace with `ip netns exec dlrep$i CMD`; `diloco launch
# --netns` does that for you (process i → dlrep$i, coordinator on 10.77.0.1).
set -euo pipefail

cmd=${1:?usage: $0 up|shape|down|status M [RATE] [DELAY] [LOSS]}
M=${2:?number of replicas M}
RATE=${3:-1gbit}
DELAY=${4:-0ms}
LOSS=${5:-0%}
# Names can be changed (tests use their own, so they never touch a running measurement):
PFX=${DILOCO_NETNS_PREFIX:-dlrep}
BR=${DILOCO_NETNS_BRIDGE:-dlbr0}
NET=${DILOCO_NETNS_SUBNET:-10.77.0}
V=${PFX/#dlrep/dl}  # veth names: dlv$i (root side), dlp$i (moved into the namespace as eth0)

need_root() { [ "$(id -u)" = 0 ] || { echo "netns.sh: needs root (ip netns, tc)" >&2; exit 1; }; }

burst_bytes() {  # 5 ms at RATE (integer kbit|mbit|gbit), at least 4 KiB: a transfer cannot ride the bucket
  local n=${1%%[a-z]*} u=${1##*[0-9]} bps b
  case $u in
    kbit) bps=$((n * 1000)) ;; mbit) bps=$((n * 1000000)) ;; gbit) bps=$((n * 1000000000)) ;;
    *) echo "netns.sh: rate $1: use an integer with kbit, mbit or gbit" >&2; exit 2 ;;
  esac
  b=$((bps / 8 / 200))
  echo $((b < 4096 ? 4096 : b))
}

shape() {  # shape NS RATE DELAY LOSS
  local ns=$1 burst
  burst=$(burst_bytes "$2")
  ip netns exec "$ns" tc qdisc del dev eth0 root 2>/dev/null || true
  ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: tbf rate "$2" burst "$burst" latency 1s
  if { [ "$3" != 0ms ] && [ "$3" != 0 ]; } || { [ "$4" != 0% ] && [ "$4" != 0 ]; }; then
    ip netns exec "$ns" tc qdisc add dev eth0 parent 1:1 handle 10: netem delay "$3" loss "$4" limit 100000 || {
      echo "netns.sh: netem (sch_netem) unavailable in this kernel: $ns has rate $2 but no added delay or loss" >&2; }
  fi
}

up() {
  need_root
  ip link show "$BR" >/dev/null 2>&1 || { ip link add "$BR" type bridge; ip link set "$BR" up; }
  for ((i = 0; i < M; i++)); do
    local ns=$PFX$i
    ip netns list | grep -qw "$ns" || ip netns add "$ns"
    if ! ip link show "${V}v$i" >/dev/null 2>&1; then
      ip link add "${V}v$i" type veth peer name "${V}p$i"
      ip link set "${V}p$i" netns "$ns"
      ip netns exec "$ns" ip link set "${V}p$i" name eth0
      ip link set "${V}v$i" master "$BR"
      ip link set "${V}v$i" up
      ip netns exec "$ns" ip addr add "$NET.$((i + 1))/24" dev eth0
      ip netns exec "$ns" ip link set eth0 up
      ip netns exec "$ns" ip link set lo up
    fi
    shape "$ns" "$RATE" "$DELAY" "$LOSS"
  done
  echo "netns.sh: $M replicas ${PFX}0..$PFX$((M - 1)) on $NET.1..$M, egress $RATE, delay $DELAY, loss $LOSS"
}

down() {
  need_root
  for ((i = 0; i < M; i++)); do
    ip link del "${V}v$i" 2>/dev/null || true
    ip netns del "$PFX$i" 2>/dev/null || true
  done
  ip link del "$BR" 2>/dev/null || true
}

status() {
  for ((i = 0; i < M; i++)); do
    echo "== $PFX$i"
    ip netns exec "$PFX$i" ip -brief addr show eth0 || true
    ip netns exec "$PFX$i" tc qdisc show dev eth0 || true
  done
}

case $cmd in
  up) up ;;
  shape) need_root; for ((i = 0; i < M; i++)); do shape "$PFX$i" "$RATE" "$DELAY" "$LOSS"; done ;;
  down) down ;;
  status) status ;;
  *) echo "netns.sh: unknown command $cmd (up|shape|down|status)" >&2; exit 2 ;;
esac
