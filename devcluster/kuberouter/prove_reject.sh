#!/bin/bash
# Shows, in scratch network namespaces, that this kernel refuses a bridged TCP connection the way
# kube-router's firewall does (iptables-nft + ipset + physdev, br_netfilter on): a "node"
# namespace with a bridge and two "pod" namespaces, a server in one, connects from the other.
# Run as root; removes its namespaces on exit. docs/isolation.md quotes its output.
set -eu
N=drs-prove-node; A=drs-prove-a; B=drs-prove-b
cleanup() { for ns in $A $B $N; do ip netns del "$ns" 2>/dev/null || true; done; }
cleanup; trap cleanup EXIT
for ns in $N $A $B; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
ip -n $N link add br0 type bridge; ip -n $N addr add 10.77.0.1/24 dev br0; ip -n $N link set br0 up
ip -n $N link add va type veth peer name eth0 netns $A; ip -n $N link set va master br0 up
ip -n $N link add vb type veth peer name eth0 netns $B; ip -n $N link set vb master br0 up
ip -n $A addr add 10.77.0.10/24 dev eth0; ip -n $A link set eth0 up
ip -n $B addr add 10.77.0.11/24 dev eth0; ip -n $B link set eth0 up
ip netns exec $N sysctl -qw net.bridge.bridge-nf-call-iptables=1
ip netns exec $B python3 -m http.server 8080 --bind 10.77.0.11 >/dev/null 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; cleanup' EXIT
probe() {
  ip netns exec $A python3 -c "
import socket
s = socket.socket(); s.settimeout(2)
try:
    s.connect(('10.77.0.11', 8080)); print('connected')
except Exception as exc:
    print('refused:', type(exc).__name__, exc)"
}
until [ "$(probe)" = connected ]; do :; done  # the server is listening
echo "no rules: $(probe)"
fw() { ip netns exec $N "$@"; }
fw ipset create drs-prove-allowed hash:ip
fw iptables -N DRS-PROVE-FW
fw iptables -A FORWARD -m physdev --physdev-is-bridged -d 10.77.0.11 -j DRS-PROVE-FW
fw iptables -A DRS-PROVE-FW -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
fw iptables -A DRS-PROVE-FW -m set --match-set drs-prove-allowed src -j ACCEPT
fw iptables -A DRS-PROVE-FW -j REJECT
echo "source not in the set, REJECT: $(probe)"
fw ipset add drs-prove-allowed 10.77.0.10
echo "source in the set: $(probe)"
fw ipset del drs-prove-allowed 10.77.0.10
fw iptables -R DRS-PROVE-FW 3 -j DROP
echo "source not in the set, DROP: $(probe)"
fw iptables --version
