// Added to kube-router's netpol package by the dev cluster's build (devcluster/drs_devcluster/nodebuild.py).
//
// kube-router filters the pods of its own node: those whose status.hostIP is its node's IP. The
// dev cluster's real nodes share one network namespace (one bridge, every node's address on it),
// so one kube-router in that namespace filters the pods of every real node: a pod is local when
// its hostIP is an address of this network namespace. Pods of simulated (kwok) nodes, whose
// addresses are nowhere here, stay outside as before.

package netpol

import "net"

func drsHostIPIsLocal(hostIP string, nodeIP string) bool {
	if hostIP == nodeIP {
		return true
	}
	ip := net.ParseIP(hostIP)
	if ip == nil {
		return false
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, addr := range addrs {
		if ipNet, ok := addr.(*net.IPNet); ok && ipNet.IP.Equal(ip) {
			return true
		}
	}
	return false
}
