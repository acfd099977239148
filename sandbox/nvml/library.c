/*
 * The library's life cycle (nvmlInit, nvmlShutdown), its error strings, and the preamble
 * every entry point shares: the one lock, the initialized check and handle validation
 * (nvml_internal.h's ENTER / ENTER_HANDLE and the resolvers here).
 */
#include "nvml_internal.h"

#include <stdint.h>

pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
int g_refs;
unsigned long g_generation;
struct state g_st;

/* ---- init / shutdown ------------------------------------------------------------------ */

static nvmlReturn_t do_init(void) {
    log_open();
    pthread_mutex_lock(&g_lock);
    if (g_refs > 0) {
        g_refs++;
        pthread_mutex_unlock(&g_lock);
        return R_SUCCESS;
    }
    nvmlReturn_t ret = load_tree_locked();
    if (ret == R_SUCCESS) {
        reset_instance_handles();
        reset_event_sets();
        g_generation++;
        g_refs = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return ret;
}

API nvmlReturn_t nvmlInit_v2(void) { return do_init(); }
API nvmlReturn_t nvmlInit(void) { return do_init(); }
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return do_init();
}

API nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t ret = R_SUCCESS;
    if (g_refs == 0)
        ret = R_UNINITIALIZED;
    else if (--g_refs == 0)
        stop_poller_locked();
    pthread_mutex_unlock(&g_lock);
    return ret;
}

API const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case R_SUCCESS: return "Success";
    case R_UNINITIALIZED: return "Uninitialized";
    case R_INVALID_ARGUMENT: return "Invalid Argument";
    case R_NOT_SUPPORTED: return "Not Supported";
    case R_NO_PERMISSION: return "Insufficient Permissions";
    case R_ALREADY_INITIALIZED: return "Already Initialized";
    case R_NOT_FOUND: return "Not Found";
    case R_INSUFFICIENT_SIZE: return "Insufficient Size";
    case R_INSUFFICIENT_POWER: return "Insufficient External Power";
    case R_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case R_TIMEOUT: return "Timeout";
    case R_IRQ_ISSUE: return "Interrupt request issue";
    case R_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case R_FUNCTION_NOT_FOUND: return "Function Not Found";
    case R_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case R_GPU_IS_LOST: return "GPU is lost";
    case R_RESET_REQUIRED: return "GPU requires restart";
    case R_OPERATING_SYSTEM: return "The operating system has blocked the request";
    case R_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch";
    case R_IN_USE: return "In use by another client";
    case R_MEMORY: return "Insufficient Memory";
    case R_NO_DATA: return "No data";
    case R_VGPU_ECC_NOT_SUPPORTED: return "ECC is not supported in vGPU";
    case R_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case R_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case R_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case R_DEPRECATED: return "Deprecated";
    case R_NOT_READY: return "Not ready";
    case R_GPU_NOT_FOUND: return "GPU not found";
    case R_INVALID_STATE: return "Invalid state";
    default: return "Unknown Error";
    }
}

/* ---- handles -------------------------------------------------------------------------- */

/* The index of ``h`` in the array ``base[count]``, or -1 if it points anywhere else. */
int index_in(const void *h, const void *base, size_t size, int count) {
    uintptr_t p = (uintptr_t)h, b = (uintptr_t)base;
    if (p < b || p >= b + size * (size_t)count || (p - b) % size)
        return -1;
    return (int)((p - b) / size);
}

static struct gpu *as_gpu(void *h) {
    int i = index_in(h, g_st.gpus, sizeof g_st.gpus[0], g_st.ngpus);
    return i < 0 ? NULL : &g_st.gpus[i];
}

static struct mig *as_mig(void *h, struct gpu **parent) {
    for (int i = 0; i < g_st.ngpus; i++) {
        struct gpu *g = &g_st.gpus[i];
        int j = index_in(h, g->migs, sizeof g->migs[0], MAX_GI);
        if (j >= 0 && g->migs[j].present && g->migs[j].has_ci) {
            *parent = g;
            return &g->migs[j];
        }
    }
    return NULL;
}

/* A full GPU or a MIG device; exactly one of *g (full) or *m (MIG, *g its parent). */
nvmlReturn_t resolve(void *h, struct gpu **g, struct mig **m) {
    *m = NULL;
    *g = as_gpu(h);
    if (!*g)
        *m = as_mig(h, g);
    if (!*g)
        return R_INVALID_ARGUMENT;
    refresh_locked(0);
    if (*m && !((*m)->present && (*m)->has_ci))
        return R_INVALID_ARGUMENT; /* its instance was destroyed meanwhile */
    return (*g)->lost ? R_GPU_IS_LOST : R_SUCCESS;
}

/* Like resolve, for identity read at init (UUID, name, PCI, minor, index): answered from
 * the cached identity even after the GPU is lost, so an Xid 79 event can be attributed. */
nvmlReturn_t resolve_identity(void *h, struct gpu **g, struct mig **m) {
    nvmlReturn_t r = resolve(h, g, m);
    return r == R_GPU_IS_LOST ? R_SUCCESS : r;
}

nvmlReturn_t full_gpu(void *h, struct gpu **g, struct mig **m) {
    nvmlReturn_t r = resolve(h, g, m);
    if (r == R_SUCCESS && *m)
        return R_NOT_SUPPORTED;
    return r;
}

nvmlReturn_t full_identity(void *h, struct gpu **g, struct mig **m) {
    nvmlReturn_t r = resolve_identity(h, g, m);
    if (r == R_SUCCESS && *m)
        return R_NOT_SUPPORTED;
    return r;
}

nvmlReturn_t mig_only(void *h, struct gpu **g, struct mig **m) {
    nvmlReturn_t r = resolve(h, g, m);
    if (r == R_SUCCESS && !*m)
        return R_INVALID_ARGUMENT;
    return r;
}
