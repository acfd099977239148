// Command my-device-plugin is a plain Kubernetes device plugin for NVIDIA GPUs: it
// advertises every NVIDIA display or 3D controller function on the PCI bus as one
// nvidia.com/gpu, reading nothing but /sys, /proc/driver and /dev.
//
// A GPU's id is its PCI address; it is Unhealthy while its aer_dev_fatal counts a fatal
// error, and it leaves the list when its PCI directory vanishes (hot-unplug). The bus is
// rescanned every second; the kubelet hears of every change through ListAndWatch.
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
	"slices"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

const (
	resourceName = "nvidia.com/gpu"
	socketName   = "my-device-plugin.sock"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devDir, procDriver string

	mu      sync.Mutex
	gpus    []gpu
	changed chan struct{} // closed and replaced when gpus changes
}

// update stores a scan and wakes every ListAndWatch stream if it differs from the last.
func (p *plugin) update(gpus []gpu) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.changed != nil && slices.Equal(p.gpus, gpus) {
		return false
	}
	p.gpus = gpus
	if p.changed != nil {
		close(p.changed)
	}
	p.changed = make(chan struct{})
	return true
}

func (p *plugin) current() ([]gpu, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.gpus, p.changed
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	for {
		gpus, changed := p.current()
		resp := &pluginapi.ListAndWatchResponse{}
		for _, g := range gpus {
			resp.Devices = append(resp.Devices, g.device())
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
		select {
		case <-changed:
		case <-stream.Context().Done():
			return nil
		}
	}
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	gpus, _ := p.current()
	resp := &pluginapi.AllocateResponse{}
	for _, creq := range req.ContainerRequests {
		cresp := &pluginapi.ContainerAllocateResponse{}
		for _, id := range creq.DevicesIds {
			if !slices.ContainsFunc(gpus, func(g gpu) bool { return g.addr == id }) {
				return nil, status.Errorf(codes.InvalidArgument, "no GPU %q on this node", id)
			}
			minor, err := deviceMinor(p.procDriver, id)
			if err != nil {
				return nil, status.Errorf(codes.Internal, "GPU %s: %v", id, err)
			}
			cresp.Devices = append(cresp.Devices, p.devSpec(fmt.Sprintf("nvidia%d", minor)))
		}
		for _, name := range []string{"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"} {
			if _, err := os.Stat(filepath.Join(p.devDir, name)); err == nil {
				cresp.Devices = append(cresp.Devices, p.devSpec(name))
			}
		}
		resp.ContainerResponses = append(resp.ContainerResponses, cresp)
	}
	return resp, nil
}

func (p *plugin) devSpec(name string) *pluginapi.DeviceSpec {
	return &pluginapi.DeviceSpec{
		ContainerPath: "/dev/" + name, HostPath: filepath.Join(p.devDir, name), Permissions: "rw",
	}
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

// serve listens on the plugin's socket (replacing a stale one) and serves in the background.
func (p *plugin) serve(sock string) (*grpc.Server, error) {
	if err := os.Remove(sock); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() {
		if err := srv.Serve(lis); err != nil {
			log.Printf("serving %s: %v", sock, err)
		}
	}()
	return srv, nil
}

// register tells the kubelet behind kubeletSock that resourceName is served at socketName.
func register(ctx context.Context, kubeletSock string) error {
	conn, err := grpc.NewClient("unix://"+kubeletSock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: socketName, ResourceName: resourceName,
		Options: &pluginapi.DevicePluginOptions{},
	}, grpc.WaitForReady(true))
	return err
}

func main() {
	dir := pluginapi.DevicePluginPath
	if env := os.Getenv("PLUGIN_SOCK_DIR"); env != "" {
		dir = env
	}
	pluginDir := flag.String("plugin-dir", dir, "the kubelet's device-plugins directory (env PLUGIN_SOCK_DIR)")
	sysDir := flag.String("sys", "/sys", "where sysfs is mounted")
	devDir := flag.String("dev", "/dev", "where the device nodes are")
	procDriver := flag.String("proc-driver", "/proc/driver", "the driver's /proc/driver")
	flag.Parse()
	log.SetPrefix("my-device-plugin: ")

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	p := &plugin{devDir: *devDir, procDriver: *procDriver}
	sock := filepath.Join(*pluginDir, socketName)
	kubeletSock := filepath.Join(*pluginDir, "kubelet.sock")
	var srv *grpc.Server
	var registeredWith os.FileInfo // the kubelet.sock we registered with; nil: none yet
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for ctx.Err() == nil {
		if gpus := scanGPUs(*sysDir); p.update(gpus) {
			log.Printf("%d GPUs, unhealthy: %v", len(gpus), unhealthy(gpus))
		}
		// A restarting kubelet deletes every socket in its directory and makes a new
		// kubelet.sock: serve again once ours is gone, and register with every new kubelet.
		if _, err := os.Stat(sock); srv == nil || err != nil {
			if srv != nil {
				srv.Stop()
			}
			if srv, err = p.serve(sock); err != nil {
				log.Printf("cannot serve %s: %v", sock, err)
			}
			registeredWith = nil
		}
		fi, err := os.Stat(kubeletSock)
		if srv != nil && err == nil && (registeredWith == nil || !os.SameFile(fi, registeredWith)) {
			if err := register(ctx, kubeletSock); err != nil {
				log.Printf("registering with %s: %v (trying again)", kubeletSock, err)
			} else {
				log.Printf("registered %s at %s with %s", resourceName, sock, kubeletSock)
				registeredWith = fi
			}
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
		}
	}
	log.Printf("stopping")
	if srv != nil {
		srv.Stop()
	}
	os.Remove(sock)
}

func unhealthy(gpus []gpu) (addrs []string) {
	for _, g := range gpus {
		if !g.healthy {
			addrs = append(addrs, g.addr)
		}
	}
	return addrs
}
