// drs-coredns is CoreDNS from its Go module with only the plugins the dev cluster's DNS needs
// (the kubernetes plugin answers cluster.local names; nothing is forwarded anywhere), the way
// CoreDNS documents building a custom plugin set.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	dnsserver.Directives = []string{"bind", "errors", "log", "health", "ready", "cache", "kubernetes"}
}

func main() {
	coremain.Run()
}
