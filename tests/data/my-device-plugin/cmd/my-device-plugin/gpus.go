package main

// What the machine says about its GPUs: sysfs for the PCI functions and their health, the
// driver's /proc/driver for their device minors.

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

const nvidiaVendor = "0x10de"

// gpu is one PCI function as the last scan saw it; comparable, so scans compare with ==.
type gpu struct {
	addr    string
	numa    int64 // -1: the platform names no NUMA node
	healthy bool
}

func (g gpu) device() *pluginapi.Device {
	d := &pluginapi.Device{ID: g.addr, Health: pluginapi.Healthy}
	if !g.healthy {
		d.Health = pluginapi.Unhealthy
	}
	if g.numa >= 0 {
		d.Topology = &pluginapi.TopologyInfo{Nodes: []*pluginapi.NUMANode{{ID: g.numa}}}
	}
	return d
}

// scanGPUs lists the NVIDIA display/3D controller functions under sysDir, sorted by address.
func scanGPUs(sysDir string) []gpu {
	dirs, _ := filepath.Glob(filepath.Join(sysDir, "bus/pci/devices/*"))
	var gpus []gpu
	for _, dir := range dirs {
		vendor, err1 := lineValue(filepath.Join(dir, "vendor"), "")
		class, err2 := lineValue(filepath.Join(dir, "class"), "")
		if err1 != nil || err2 != nil || vendor != nvidiaVendor || !strings.HasPrefix(class, "0x03") {
			continue // not a GPU, or it vanished while we looked
		}
		node, _ := lineValue(filepath.Join(dir, "numa_node"), "")
		numa, err := strconv.ParseInt(node, 10, 64)
		if err != nil {
			numa = -1
		}
		gpus = append(gpus, gpu{addr: filepath.Base(dir), numa: numa, healthy: fatalErrors(dir) == 0})
	}
	slices.SortFunc(gpus, func(a, b gpu) int { return strings.Compare(a.addr, b.addr) })
	return gpus
}

// fatalErrors is the function's TOTAL_ERR_FATAL AER counter (0 without AER reporting).
func fatalErrors(dir string) int {
	v, _ := lineValue(filepath.Join(dir, "aer_dev_fatal"), "TOTAL_ERR_FATAL")
	n, _ := strconv.Atoi(v)
	return n
}

// deviceMinor is N of the GPU's /dev/nvidiaN, as the driver tells it.
func deviceMinor(procDriver, addr string) (int, error) {
	v, err := lineValue(filepath.Join(procDriver, "nvidia/gpus", addr, "information"), "Device Minor:")
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(v)
}

// lineValue is the rest of the first line of the file at path that starts with key,
// trimmed; with key "", a one-value sysfs attribute's value.
func lineValue(path, key string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, key); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("%s: no %q line", path, key)
}
