// pause is the sandbox ("pause") container of the dev cluster's real nodes: it holds a pod's
// namespaces open, reaps orphaned children and exits on SIGTERM/SIGINT. The dev cluster has no
// registry to pull registry.k8s.io/pause from, so `drs dev images` builds this into drs-pause.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range sigs {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
