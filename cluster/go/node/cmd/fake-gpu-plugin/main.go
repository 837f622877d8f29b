// Command fake-gpu-plugin is a kubelet device plugin (API v1beta1) that
// advertises N fake nvidia.com/gpu devices, so that a real kubelet on a
// machine without GPUs offers the capacity GPU pods ask for. Allocate hands
// the container NVIDIA_VISIBLE_DEVICES naming the devices it got, as the
// NVIDIA plugin does; there is no device node behind them.
//
// It serves on a socket in the kubelet's device-plugin directory and
// registers with the kubelet's socket there; when the kubelet restarts (its
// socket is made anew) it registers again.
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
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// ListAndWatch sends the devices once and then holds the stream open: fake devices never change health.
func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(c.DevicesIds, ",")},
		})
	}
	return resp, nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func register(kubeletSocket, endpoint, resource string) error {
	conn, err := grpc.NewClient("unix://"+kubeletSocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     endpoint,
		ResourceName: resource,
	})
	return err
}

// inode of path, 0 when it is not there.
func inode(path string) uint64 {
	var st syscall.Stat_t
	if syscall.Stat(path, &st) != nil {
		return 0
	}
	return st.Ino
}

func main() {
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	count := flag.Int("count", 8, "fake devices to advertise")
	resource := flag.String("resource", "nvidia.com/gpu", "extended resource name")
	name := flag.String("socket", "conveyor-fake-gpu.sock", "this plugin's socket, inside -dir")
	flag.Parse()

	p := &plugin{}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("fake-gpu-%d", i), Health: pluginapi.Healthy})
	}
	kubelet := filepath.Join(*dir, "kubelet.sock")
	own := filepath.Join(*dir, *name)

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	var registered uint64
	var server *grpc.Server
	for {
		// Serve (again) when our socket is gone (the kubelet clears the directory at
		// start), and register whenever the kubelet's socket is a new one.
		if inode(own) == 0 || server == nil {
			if server != nil {
				server.Stop()
			}
			_ = os.Remove(own)
			lis, err := net.Listen("unix", own)
			if err != nil {
				log.Fatalf("listen on %s: %v", own, err)
			}
			server = grpc.NewServer()
			pluginapi.RegisterDevicePluginServer(server, p)
			go func() { _ = server.Serve(lis) }()
			registered = 0
		}
		if ino := inode(kubelet); ino != 0 && ino != registered {
			if err := register(kubelet, *name, *resource); err != nil {
				log.Printf("register with %s: %v (will retry)", kubelet, err)
			} else {
				registered = ino
				log.Printf("registered %d %s devices with %s", *count, *resource, kubelet)
			}
		}
		select {
		case <-stop:
			server.Stop()
			_ = os.Remove(own)
			return
		case <-time.After(500 * time.Millisecond):
		}
	}
}
