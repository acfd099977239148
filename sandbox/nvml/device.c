/*
 * Entry points on the system and on devices (full GPUs and MIG devices): versions,
 * enumeration and handles, identity, PCI and topology, memory and compute capability.
 */
#include "nvml_internal.h"

#include <stdio.h>
#include <string.h>

static int copy_str(char *dst, unsigned int len, const char *src) {
    if (!dst)
        return R_INVALID_ARGUMENT;
    size_t n = strlen(src);
    if ((size_t)len < n + 1)
        return R_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return R_SUCCESS;
}

/* ---- system --------------------------------------------------------------------------- */

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER();
    LEAVE(copy_str(version, length, g_st.driver));
}

API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    ENTER();
    char v[96];
    /* NVML's own version is the CUDA major followed by the driver version */
    snprintf(v, sizeof v, "%d.%s", g_st.cuda / 1000, g_st.driver);
    LEAVE(copy_str(version, length, v));
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) {
    ENTER();
    if (!v)
        LEAVE(R_INVALID_ARGUMENT);
    *v = g_st.cuda;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) {
    return nvmlSystemGetCudaDriverVersion(v);
}

/* ---- enumeration ---------------------------------------------------------------------- */

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER();
    if (!count)
        LEAVE(R_INVALID_ARGUMENT);
    *count = (unsigned int)g_st.ngpus;
    LEAVE(R_SUCCESS);
}
API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvml_device_t *device) {
    ENTER();
    if (!device || index >= (unsigned int)g_st.ngpus)
        LEAVE(R_INVALID_ARGUMENT);
    refresh_locked(0);
    struct gpu *g = &g_st.gpus[index];
    if (g->lost)
        LEAVE(R_GPU_IS_LOST);
    *device = g;
    LEAVE(R_SUCCESS);
}
API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvml_device_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvml_device_t *device) {
    ENTER();
    if (!uuid || !device)
        LEAVE(R_INVALID_ARGUMENT);
    refresh_locked(0);
    for (int i = 0; i < g_st.ngpus; i++) {
        struct gpu *g = &g_st.gpus[i];
        if (strncmp(g->uuid, uuid, UUID_LEN) == 0) {
            if (g->lost)
                LEAVE(R_GPU_IS_LOST);
            *device = g;
            LEAVE(R_SUCCESS);
        }
        for (int k = 0; k < g->nmig; k++)
            if (strncmp(g->migs[g->order[k]].uuid, uuid, UUID_LEN) == 0) {
                if (g->lost)
                    LEAVE(R_GPU_IS_LOST);
                *device = &g->migs[g->order[k]];
                LEAVE(R_SUCCESS);
            }
    }
    LEAVE(R_NOT_FOUND);
}

API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *busid, nvml_device_t *device) {
    ENTER();
    unsigned int dom, bus, dev, fn;
    if (!busid || !device || strnlen(busid, 64) >= 64 || parse_bdf(busid, &dom, &bus, &dev, &fn))
        LEAVE(R_INVALID_ARGUMENT);
    refresh_locked(0);
    for (int i = 0; i < g_st.ngpus; i++) {
        struct gpu *g = &g_st.gpus[i];
        if (g->domain == dom && g->bus == bus && g->dev == dev && g->fn == fn) {
            if (g->lost)
                LEAVE(R_GPU_IS_LOST);
            *device = g;
            LEAVE(R_SUCCESS);
        }
    }
    LEAVE(R_NOT_FOUND);
}
API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *busid, nvml_device_t *device) {
    return nvmlDeviceGetHandleByPciBusId_v2(busid, device);
}

/* ---- identity ------------------------------------------------------------------------- */

API nvmlReturn_t nvmlDeviceGetUUID(nvml_device_t device, char *uuid, unsigned int length) {
    ENTER_HANDLE(resolve_identity, device, g, m);
    LEAVE(copy_str(uuid, length, m ? m->uuid : g->uuid));
}

API nvmlReturn_t nvmlDeviceGetName(nvml_device_t device, char *name, unsigned int length) {
    ENTER_HANDLE(resolve_identity, device, g, m);
    if (!m)
        LEAVE(copy_str(name, length, g->name));
    char full[NAME_LEN + 64];
    snprintf(full, sizeof full, "%s MIG %s", g->name, m->pname);
    LEAVE(copy_str(name, length, full));
}

API nvmlReturn_t nvmlDeviceGetBrand(nvml_device_t device, int *brand) {
    ENTER_HANDLE(resolve, device, g, m);
    if (!brand)
        LEAVE(R_INVALID_ARGUMENT);
    *brand = (int)g->brand;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetIndex(nvml_device_t device, unsigned int *index) {
    ENTER_HANDLE(full_identity, device, g, m);
    if (!index)
        LEAVE(R_INVALID_ARGUMENT);
    *index = (unsigned int)(g - g_st.gpus);
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMinorNumber(nvml_device_t device, unsigned int *minor) {
    ENTER_HANDLE(full_identity, device, g, m);
    if (!minor)
        LEAVE(R_INVALID_ARGUMENT);
    *minor = g->minor;
    LEAVE(R_SUCCESS);
}

static void fill_pci(const struct gpu *g, pci_info_t *pci) {
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", g->domain & 0xFFFF,
             g->bus & 0xFF, g->dev & 0x1F, g->fn & 0x7);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", g->domain, g->bus & 0xFF,
             g->dev & 0x1F, g->fn & 0x7);
    pci->domain = g->domain;
    pci->bus = g->bus;
    pci->device = g->dev;
    pci->pciDeviceId = g->device << 16 | g->vendor;
    pci->pciSubSystemId = g->subdevice << 16 | g->subvendor;
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvml_device_t device, pci_info_t *pci) {
    ENTER_HANDLE(resolve_identity, device, g, m);
    if (!pci)
        LEAVE(R_INVALID_ARGUMENT);
    fill_pci(g, pci);
    LEAVE(R_SUCCESS);
}
API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvml_device_t device, pci_info_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

API nvmlReturn_t nvmlDeviceGetNumaNodeId(nvml_device_t device, unsigned int *node) {
    ENTER_HANDLE(resolve_identity, device, g, m);
    if (!node)
        LEAVE(R_INVALID_ARGUMENT);
    if (g->numa < 0)
        LEAVE(R_NOT_SUPPORTED);
    *node = (unsigned int)g->numa;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvml_device_t d1, nvml_device_t d2,
                                                     int *level) {
    ENTER_HANDLE(full_gpu, d1, a, ma);
    struct gpu *b;
    struct mig *mb;
    CHECK(full_gpu(d2, &b, &mb));
    if (!level)
        LEAVE(R_INVALID_ARGUMENT);
    /* each GPU sits on its own root port: same GPU, same NUMA node, or across sockets */
    *level = a == b ? TOPO_INTERNAL : (a->numa == b->numa ? TOPO_NODE : TOPO_SYSTEM);
    LEAVE(R_SUCCESS);
}

/* No NVLink and no GPU fabric in the sandbox: what NVML says for PCIe GPUs. Explicit (not
 * stubs) so NVIDIA's plugin (NVLink state, for its preferred allocation) and
 * gpu-feature-discovery (fabric info, for IMEX labels) leave no "unimplemented" lines. */
API nvmlReturn_t nvmlDeviceGetNvLinkState(nvml_device_t device, unsigned int link, int *active) {
    (void)link;
    ENTER_HANDLE(full_gpu, device, g, m);
    LEAVE(active ? R_NOT_SUPPORTED : R_INVALID_ARGUMENT);
}

API nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvml_device_t device, void *info) {
    ENTER_HANDLE(full_gpu, device, g, m);
    LEAVE(info ? R_NOT_SUPPORTED : R_INVALID_ARGUMENT);
}

API nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvml_device_t device, void *info) {
    return nvmlDeviceGetGpuFabricInfo(device, info);
}

/* ---- memory, compute ------------------------------------------------------------------ */

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvml_device_t device, memory_t *mem) {
    ENTER_HANDLE(resolve, device, g, m);
    if (!mem)
        LEAVE(R_INVALID_ARGUMENT);
    mem->total = m ? m->mem_mb << 20 : g->memory;
    mem->used = 0;
    mem->free = mem->total;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvml_device_t device, memory_v2_t *mem) {
    ENTER_HANDLE(resolve, device, g, m);
    if (!mem)
        LEAVE(R_INVALID_ARGUMENT);
    if (mem->version != STRUCT_VERSION(memory_v2_t, 2))
        LEAVE(R_ARGUMENT_VERSION_MISMATCH);
    mem->total = m ? m->mem_mb << 20 : g->memory;
    mem->reserved = 0;
    mem->used = 0;
    mem->free = mem->total;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvml_device_t device, int *major, int *minor) {
    ENTER_HANDLE(resolve, device, g, m);
    if (!major || !minor)
        LEAVE(R_INVALID_ARGUMENT);
    *major = g->cc_major;
    *minor = g->cc_minor;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetArchitecture(nvml_device_t device, unsigned int *arch) {
    ENTER_HANDLE(resolve, device, g, m);
    if (!arch)
        LEAVE(R_INVALID_ARGUMENT);
    *arch = g->arch;
    LEAVE(R_SUCCESS);
}


/* NVML_GPU_VIRTUALIZATION_MODE_NONE (0): a bare-metal GPU, no vGPU or passthrough */
API nvmlReturn_t nvmlDeviceGetVirtualizationMode(nvml_device_t device, unsigned int *mode) {
    ENTER_HANDLE(full_gpu, device, g, m);
    (void)g;
    if (!mode)
        LEAVE(R_INVALID_ARGUMENT);
    *mode = 0;
    LEAVE(R_SUCCESS);
}
