// drs-device-plugin is a test double of NVIDIA's device plugin for the dev cluster's real nodes:
// it speaks the kubelet's device-plugin gRPC API (v1beta1) exactly as a real plugin does, so a
// real kubelet advertises nvidia.com/gpu capacity, but the devices it lists are not hardware.
// Allocate answers with NVIDIA_VISIBLE_DEVICES (and CUDA_VISIBLE_DEVICES) naming the allocated
// device ids, which is what a container on a GPU node sees.
//
//	drs-device-plugin --dir /var/lib/kubelet/device-plugins --count 8 --resource nvidia.com/gpu
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
	stop    chan struct{}
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	select {
	case <-p.stop:
	case <-stream.Context().Done():
	}
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		ids := strings.Join(c.DevicesIds, ",")
		log.Printf("allocate %s", ids)
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": ids, "CUDA_VISIBLE_DEVICES": ids},
		})
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func register(dir, endpoint, resource string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: endpoint, ResourceName: resource,
	})
	return err
}

func main() {
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	count := flag.Int("count", 8, "number of devices to advertise")
	resource := flag.String("resource", "nvidia.com/gpu", "extended resource name")
	endpoint := flag.String("endpoint", "drs-gpu.sock", "socket name of this plugin in --dir")
	flag.Parse()

	devices := []*pluginapi.Device{}
	for i := 0; i < *count; i++ {
		devices = append(devices, &pluginapi.Device{ID: fmt.Sprintf("GPU-drs-%d", i), Health: pluginapi.Healthy})
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	// A restarted kubelet recreates kubelet.sock and deletes every socket in the directory: serve
	// and register again whenever kubelet.sock is a new file, as real device plugins do.
	for {
		kubeletSock := waitForFile(filepath.Join(*dir, "kubelet.sock"), sigs)
		if kubeletSock == nil {
			return
		}
		p := &plugin{devices: devices, stop: make(chan struct{})}
		sock := filepath.Join(*dir, *endpoint)
		_ = os.Remove(sock)
		lis, err := net.Listen("unix", sock)
		if err != nil {
			log.Fatalf("listen %s: %v", sock, err)
		}
		server := grpc.NewServer()
		pluginapi.RegisterDevicePluginServer(server, p)
		go func() { _ = server.Serve(lis) }()
		if err := register(*dir, *endpoint, *resource); err != nil {
			log.Printf("register with the kubelet: %v (retrying)", err)
		} else {
			log.Printf("registered %d %s devices at %s", *count, *resource, sock)
		}
		stopped := waitForChange(filepath.Join(*dir, "kubelet.sock"), kubeletSock, sock, sigs)
		close(p.stop)
		server.Stop()
		if stopped {
			_ = os.Remove(sock)
			return
		}
	}
}

// waitForFile returns the file's info once it exists, or nil on a signal.
func waitForFile(path string, sigs chan os.Signal) os.FileInfo {
	for {
		if info, err := os.Stat(path); err == nil {
			return info
		}
		select {
		case <-sigs:
			return nil
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// waitForChange waits until kubelet.sock is replaced or our own socket is gone (true on a signal).
func waitForChange(path string, was os.FileInfo, own string, sigs chan os.Signal) bool {
	for {
		select {
		case <-sigs:
			return true
		case <-time.After(500 * time.Millisecond):
		}
		now, err := os.Stat(path)
		_, ownErr := os.Stat(own)
		if err != nil || !os.SameFile(was, now) || ownErr != nil {
			return false
		}
	}
}
