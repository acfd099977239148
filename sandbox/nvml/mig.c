/*
 * MIG entry points: MIG mode, MIG device handles, GPU instances and compute instances and
 * their profiles. Each of our MIG devices is one GPU instance holding one compute instance
 * that spans it (docs/nvml.md, "MIG").
 */
#include "nvml_internal.h"

#include <stdio.h>
#include <string.h>

/* handles for GPU and compute instances: the address is the handle, one per GPU and GPU
 * instance id, so a handle stays valid while its instance exists */
struct gi_handle {
    int gpu, mig;
};
struct ci_handle {
    int gpu, mig;
};
_Static_assert(sizeof(struct gi_handle) == sizeof(struct ci_handle), "as_instance");
static struct gi_handle g_gi[MAX_GPUS][MAX_GI];
static struct ci_handle g_ci[MAX_GPUS][MAX_GI];

void *gi_handle_of(const struct gpu *g, unsigned int gi) {
    return &g_gi[g - g_st.gpus][gi];
}

void *ci_handle_of(const struct gpu *g, unsigned int gi) {
    return &g_ci[g - g_st.gpus][gi];
}

void reset_instance_handles(void) {
    for (int i = 0; i < MAX_GPUS; i++)
        for (int j = 0; j < MAX_GI; j++) {
            g_gi[i][j] = (struct gi_handle){i, j};
            g_ci[i][j] = (struct ci_handle){i, j};
        }
}

API nvmlReturn_t nvmlDeviceGetMigMode(nvml_device_t device, unsigned int *current,
                                      unsigned int *pending) {
    ENTER_HANDLE(full_gpu, device, g, m);
    if (!current || !pending)
        LEAVE(R_INVALID_ARGUMENT);
    if (!g->mig_capable)
        LEAVE(R_NOT_SUPPORTED);
    *current = *pending = (unsigned int)g->mig_mode;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvml_device_t device, unsigned int *is_mig) {
    ENTER_HANDLE(resolve, device, g, m);
    if (!is_mig)
        LEAVE(R_INVALID_ARGUMENT);
    *is_mig = m != NULL;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvml_device_t device, unsigned int *count) {
    ENTER_HANDLE(full_gpu, device, g, m);
    if (!count)
        LEAVE(R_INVALID_ARGUMENT);
    if (!g->mig_capable)
        LEAVE(R_NOT_SUPPORTED);
    *count = MAX_MIGS - 1; /* seven compute slices on every MIG-capable model */
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvml_device_t device, unsigned int index,
                                                     nvml_device_t *mig) {
    ENTER_HANDLE(full_gpu, device, g, m);
    if (!mig)
        LEAVE(R_INVALID_ARGUMENT);
    if (!g->mig_capable)
        LEAVE(R_NOT_SUPPORTED);
    if (!g->mig_mode || index >= (unsigned int)g->nmig)
        LEAVE(R_NOT_FOUND);
    *mig = &g->migs[g->order[index]];
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvml_device_t mig,
                                                              nvml_device_t *device) {
    ENTER_HANDLE(resolve, mig, g, m);
    if (!device || !m)
        LEAVE(R_INVALID_ARGUMENT);
    *device = g;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvml_device_t device, unsigned int *id) {
    ENTER_HANDLE(mig_only, device, g, m);
    if (!id)
        LEAVE(R_INVALID_ARGUMENT);
    *id = m->gi;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvml_device_t device, unsigned int *id) {
    ENTER_HANDLE(mig_only, device, g, m);
    if (!id)
        LEAVE(R_INVALID_ARGUMENT);
    *id = m->ci;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetAttributes_v2(nvml_device_t device, attributes_t *a) {
    ENTER_HANDLE(resolve, device, g, m);
    if (!a)
        LEAVE(R_INVALID_ARGUMENT);
    memset(a, 0, sizeof *a);
    if (m) {
        a->multiprocessorCount = m->sm;
        a->gpuInstanceSliceCount = m->cslices;
        a->computeInstanceSliceCount = m->cslices;
        a->memorySizeMB = m->mem_mb;
        a->sharedCopyEngineCount = m->cslices;
    } else {
        a->multiprocessorCount = g->sm;
        a->gpuInstanceSliceCount = a->computeInstanceSliceCount = 1;
        a->memorySizeMB = g->memory >> 20;
    }
    LEAVE(R_SUCCESS);
}
API nvmlReturn_t nvmlDeviceGetAttributes(nvml_device_t device, attributes_t *a) {
    return nvmlDeviceGetAttributes_v2(device, a);
}

struct profile *find_profile(struct gpu *g, unsigned int id) {
    for (int i = 0; i < g->nprof; i++)
        if (g->profs[i].giprof == id)
            return &g->profs[i];
    return NULL;
}

/* GPU instance profile ``id`` of the full GPU ``g`` */
static nvmlReturn_t gi_profile(struct gpu *g, unsigned int id, struct profile **p) {
    if (!g->mig_capable)
        return R_NOT_SUPPORTED;
    if (id >= 18)
        return R_INVALID_ARGUMENT;
    *p = find_profile(g, id);
    return *p ? R_SUCCESS : R_NOT_SUPPORTED;
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvml_device_t device, unsigned int id,
                                                     gi_profile_v1_t *info) {
    ENTER_HANDLE(full_gpu, device, g, m);
    struct profile *p;
    CHECK(gi_profile(g, id, &p));
    if (!info)
        LEAVE(R_INVALID_ARGUMENT);
    memset(info, 0, sizeof *info);
    info->id = id;
    info->isP2pSupported = 0;
    info->sliceCount = p->cslices;
    info->instanceCount = p->count;
    info->multiprocessorCount = p->sm;
    info->copyEngineCount = p->cslices;
    info->memorySizeMB = p->mem_mb;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvml_device_t device, unsigned int id,
                                                      void *info) {
    ENTER_HANDLE(full_gpu, device, g, m);
    struct profile *p;
    CHECK(gi_profile(g, id, &p));
    if (!info)
        LEAVE(R_INVALID_ARGUMENT);
    unsigned int version = *(unsigned int *)info;
    char name[96];
    snprintf(name, sizeof name, "MIG %s", p->pname);
    if (version == STRUCT_VERSION(gi_profile_v2_t, 2)) {
        gi_profile_v2_t *v = info;
        memset(v, 0, sizeof *v);
        v->version = version;
        v->id = id;
        v->sliceCount = p->cslices;
        v->instanceCount = p->count;
        v->multiprocessorCount = p->sm;
        v->copyEngineCount = p->cslices;
        v->memorySizeMB = p->mem_mb;
        snprintf(v->name, sizeof v->name, "%s", name);
    } else if (version == STRUCT_VERSION(gi_profile_v3_t, 3)) {
        gi_profile_v3_t *v = info;
        memset(v, 0, sizeof *v);
        v->version = version;
        v->id = id;
        v->sliceCount = p->cslices;
        v->instanceCount = p->count;
        v->multiprocessorCount = p->sm;
        v->copyEngineCount = p->cslices;
        v->memorySizeMB = p->mem_mb;
        snprintf(v->name, sizeof v->name, "%s", name);
    } else {
        LEAVE(R_ARGUMENT_VERSION_MISMATCH);
    }
    LEAVE(R_SUCCESS);
}

/* The GPU's memory and compute slices: its largest profile's. */
static void gpu_slices(const struct gpu *g, unsigned int *mtotal, unsigned int *ctotal) {
    *mtotal = *ctotal = 0;
    for (int i = 0; i < g->nprof; i++) {
        if (g->profs[i].mslices > *mtotal)
            *mtotal = g->profs[i].mslices;
        if (g->profs[i].cslices > *ctotal)
            *ctotal = g->profs[i].cslices;
    }
}

/* Where GPU instance profile ``p`` may start on ``g``, in memory slices: at multiples of its
 * memory slice count, with its compute slices inside the GPU's (A100/H100: 8 memory and 7
 * compute slices, so 3g.40gb at 0 and 4, 2g.20gb at 0, 2, 4, 1g.10gb at 0..6, 4g.40gb and
 * 7g.80gb at 0; NVIDIA's MIG user guide draws the same). Returns how many, filling at most
 * ``max`` of ``out``. */
static unsigned int possible_placements(const struct gpu *g, const struct profile *p,
                                        placement_t *out, unsigned int max) {
    unsigned int mtotal, ctotal, n = 0;
    gpu_slices(g, &mtotal, &ctotal);
    if (p->mslices == 0)
        return 0;
    for (unsigned int start = 0; start + p->mslices <= mtotal; start += p->mslices) {
        if (start + p->cslices > ctotal)
            break;
        if (out && n < max) {
            out[n].start = start;
            out[n].size = p->mslices;
        }
        n++;
    }
    return n;
}

/* nvmlDeviceGetGpuInstancePossiblePlacements(_v2): ``placements`` NULL asks for the count */
static nvmlReturn_t gi_placements(nvml_device_t device, unsigned int id, placement_t *placements,
                                  unsigned int *count) {
    ENTER_HANDLE(full_gpu, device, g, m);
    (void)m;
    struct profile *p;
    if (!count)
        LEAVE(R_INVALID_ARGUMENT);
    CHECK(gi_profile(g, id, &p));
    unsigned int n = possible_placements(g, p, placements, placements ? *count : 0);
    nvmlReturn_t out = placements && n > *count ? R_INSUFFICIENT_SIZE : R_SUCCESS;
    *count = n;
    LEAVE(out);
}

API nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvml_device_t device,
                                                               unsigned int id,
                                                               placement_t *placements,
                                                               unsigned int *count) {
    return gi_placements(device, id, placements, count);
}

API nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements(nvml_device_t device,
                                                            unsigned int id,
                                                            placement_t *placements,
                                                            unsigned int *count) {
    return gi_placements(device, id, placements, count);
}

/* whether an instance of ``p`` at ``start`` fits beside ``g``'s instances (and those in
 * ``extra``, starts of ``p`` counted as made): no shared memory slice, compute slices left */
static int fits(struct gpu *g, const struct profile *p, unsigned int start,
                const unsigned int *extra, unsigned int nextra) {
    unsigned int mtotal, ctotal, cused = p->cslices * (nextra + 1);
    gpu_slices(g, &mtotal, &ctotal);
    for (int j = 1; j < MAX_GI; j++) {
        const struct mig *m = &g->migs[j];
        if (!m->present)
            continue;
        cused += m->cslices;
        if (start < m->start + m->size && m->start < start + p->mslices)
            return 0;
    }
    for (unsigned int k = 0; k < nextra; k++)
        if (start < extra[k] + p->mslices && extra[k] < start + p->mslices)
            return 0;
    return cused <= ctotal;
}

/* How many more instances of ``profileId`` could be made one after another, each at the
 * first placement that fits (the rule sandbox/fakehw/mig.py applies to a create). */
API nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvml_device_t device,
                                                           unsigned int profileId,
                                                           unsigned int *count) {
    ENTER_HANDLE(full_gpu, device, g, m);
    (void)m;
    struct profile *p;
    if (!count)
        LEAVE(R_INVALID_ARGUMENT);
    CHECK(gi_profile(g, profileId, &p));
    if (!g->mig_mode)
        LEAVE(R_NOT_SUPPORTED);
    placement_t starts[MAX_GI];
    unsigned int n = possible_placements(g, p, starts, MAX_GI), made[MAX_GI], nmade = 0, have = 0;
    for (int j = 1; j < MAX_GI; j++)
        have += g->migs[j].present;
    for (unsigned int k = 0; k < n && k < MAX_GI; k++)
        if (have + nmade < MAX_GI - 2 && fits(g, p, starts[k].start, made, nmade))
            made[nmade++] = starts[k].start;
    *count = nmade;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvml_device_t device, unsigned int id,
                                              nvml_gpu_instance_t *gi) {
    ENTER_HANDLE(full_gpu, device, g, m);
    if (!gi)
        LEAVE(R_INVALID_ARGUMENT);
    if (!g->mig_capable)
        LEAVE(R_NOT_SUPPORTED);
    if (id < MAX_GI && g->migs[id].present) {
        *gi = gi_handle_of(g, id);
        LEAVE(R_SUCCESS);
    }
    LEAVE(R_NOT_FOUND);
}

API nvmlReturn_t nvmlDeviceGetGpuInstances(nvml_device_t device, unsigned int profile,
                                           nvml_gpu_instance_t *gis, unsigned int *count) {
    ENTER_HANDLE(full_gpu, device, g, m);
    if (!count)
        LEAVE(R_INVALID_ARGUMENT);
    if (!g->mig_capable)
        LEAVE(R_NOT_SUPPORTED);
    unsigned int n = 0;
    for (int j = 1; j < MAX_GI; j++)
        if (g->migs[j].present && g->migs[j].giprof == profile) {
            if (gis && n < *count)
                gis[n] = gi_handle_of(g, (unsigned int)j);
            n++;
        }
    if (gis == NULL && n > 0) {
        *count = n;
        LEAVE(R_INVALID_ARGUMENT);
    }
    nvmlReturn_t out = n > *count ? R_INSUFFICIENT_SIZE : R_SUCCESS;
    *count = n;
    LEAVE(out);
}

/* a GPU or compute instance handle (one of ``handles``, g_gi or g_ci) -> (gpu, mig) */
static nvmlReturn_t as_instance(void *h, const void *handles, int need_ci, struct gpu **g,
                                struct mig **m) {
    int k = index_in(h, handles, sizeof g_gi[0][0], MAX_GPUS * MAX_GI);
    if (k < 0)
        return R_INVALID_ARGUMENT;
    int i = k / MAX_GI, j = k % MAX_GI;
    if (i >= g_st.ngpus)
        return R_INVALID_ARGUMENT;
    refresh_locked(0);
    *g = &g_st.gpus[i];
    *m = &(*g)->migs[j];
    if (!(*m)->present || (need_ci && !(*m)->has_ci))
        return R_INVALID_ARGUMENT; /* never made, or destroyed since */
    return (*g)->lost ? R_GPU_IS_LOST : R_SUCCESS;
}

nvmlReturn_t as_gi(void *h, struct gpu **g, struct mig **m) {
    return as_instance(h, g_gi, 0, g, m);
}

nvmlReturn_t as_ci(void *h, struct gpu **g, struct mig **m) {
    return as_instance(h, g_ci, 1, g, m);
}

API nvmlReturn_t nvmlGpuInstanceGetInfo(nvml_gpu_instance_t gi, gi_info_t *info) {
    ENTER_HANDLE(as_gi, gi, g, m);
    if (!info)
        LEAVE(R_INVALID_ARGUMENT);
    info->device = g;
    info->id = m->gi;
    info->profileId = m->giprof;
    info->placement.start = m->start;
    info->placement.size = m->size;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvml_gpu_instance_t gi, unsigned int id,
                                                       nvml_compute_instance_t *ci) {
    ENTER_HANDLE(as_gi, gi, g, m);
    if (!ci)
        LEAVE(R_INVALID_ARGUMENT);
    if (!m->has_ci || m->ci != id)
        LEAVE(R_NOT_FOUND);
    *ci = ci_handle_of(g, m->gi);
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvml_gpu_instance_t gi, unsigned int profile,
                                                    nvml_compute_instance_t *cis,
                                                    unsigned int *count) {
    ENTER_HANDLE(as_gi, gi, g, m);
    if (!count)
        LEAVE(R_INVALID_ARGUMENT);
    unsigned int n = m->has_ci && m->ciprof == profile;
    if (n && cis && *count >= 1)
        cis[0] = ci_handle_of(g, m->gi);
    nvmlReturn_t out = n > *count ? R_INSUFFICIENT_SIZE : R_SUCCESS;
    *count = n;
    LEAVE(out);
}

static void fill_ci(struct gpu *g, struct mig *m, ci_info_t *info) {
    info->device = g;
    info->gpuInstance = gi_handle_of(g, m->gi);
    info->id = m->ci;
    info->profileId = m->ciprof;
    info->placement.start = 0;
    info->placement.size = m->cslices;
}

API nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvml_compute_instance_t ci, ci_info_t *info) {
    ENTER_HANDLE(as_ci, ci, g, m);
    if (!info)
        LEAVE(R_INVALID_ARGUMENT);
    fill_ci(g, m, info);
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlComputeInstanceGetInfo(nvml_compute_instance_t ci, ci_info_v1_t *info) {
    ENTER_HANDLE(as_ci, ci, g, m);
    if (!info)
        LEAVE(R_INVALID_ARGUMENT);
    ci_info_t full;
    fill_ci(g, m, &full);
    memcpy(info, &full, sizeof *info);
    LEAVE(R_SUCCESS);
}

/* compute instance profile ids in slice order: 1,2,3,4,7,8,6 slices -> 0,1,2,3,4,5,6 */
static int ci_profile_slices(unsigned int id) {
    static const int slices[] = {1, 2, 3, 4, 7, 8, 6};
    return id < sizeof slices / sizeof slices[0] ? slices[id] : -1;
}

/* compute instance profile ``id`` (engine ``eng``) of the GPU instance of ``m`` */
static nvmlReturn_t ci_profile(const struct mig *m, unsigned int id, unsigned int eng) {
    if (id >= 9 || eng >= 1)
        return R_INVALID_ARGUMENT;
    /* each of our GPU instances holds one compute instance spanning all its slices */
    if (ci_profile_slices(id) != (int)m->cslices)
        return R_NOT_SUPPORTED;
    return R_SUCCESS;
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvml_gpu_instance_t gi,
                                                              unsigned int id, unsigned int eng,
                                                              ci_profile_v1_t *info) {
    ENTER_HANDLE(as_gi, gi, g, m);
    CHECK(ci_profile(m, id, eng));
    if (!info)
        LEAVE(R_INVALID_ARGUMENT);
    memset(info, 0, sizeof *info);
    info->id = id;
    info->sliceCount = m->cslices;
    info->instanceCount = 1;
    info->multiprocessorCount = m->sm;
    info->sharedCopyEngineCount = m->cslices;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvml_gpu_instance_t gi,
                                                               unsigned int id, unsigned int eng,
                                                               void *info) {
    ENTER_HANDLE(as_gi, gi, g, m);
    CHECK(ci_profile(m, id, eng));
    if (!info)
        LEAVE(R_INVALID_ARGUMENT);
    unsigned int version = *(unsigned int *)info;
    ci_profile_v3_t v;
    memset(&v, 0, sizeof v);
    v.version = version;
    v.id = id;
    v.sliceCount = m->cslices;
    v.instanceCount = 1;
    v.multiprocessorCount = m->sm;
    v.sharedCopyEngineCount = m->cslices;
    snprintf(v.name, sizeof v.name, "MIG %s", m->pname);
    if (version == STRUCT_VERSION(ci_profile_v2_t, 2))
        memcpy(info, &v, sizeof(ci_profile_v2_t));
    else if (version == STRUCT_VERSION(ci_profile_v3_t, 3))
        memcpy(info, &v, sizeof v);
    else
        LEAVE(R_ARGUMENT_VERSION_MISMATCH);
    LEAVE(R_SUCCESS);
}

