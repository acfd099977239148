/*
 * hw-sandbox's nvidia-smi: what its two files share (smi.c: arguments, GPU selection, -L,
 * the table, MIG listing; smi_report.c: the query fields, --query-gpu and -q).
 */
#ifndef HWSANDBOX_SMI_H
#define HWSANDBOX_SMI_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../nvml_abi.h"

/* NVML's entry points (names and signatures are NVML's published API) */
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlShutdown(void);
const char *nvmlErrorString(nvmlReturn_t r);
nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int n);
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v);
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvml_device_t *d);
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvml_device_t *d);
nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus, nvml_device_t *d);
nvmlReturn_t nvmlDeviceGetName(nvml_device_t d, char *s, unsigned int n);
nvmlReturn_t nvmlDeviceGetUUID(nvml_device_t d, char *s, unsigned int n);
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvml_device_t d, pci_info_t *p);
nvmlReturn_t nvmlDeviceGetIndex(nvml_device_t d, unsigned int *v);
nvmlReturn_t nvmlDeviceGetMinorNumber(nvml_device_t d, unsigned int *v);
nvmlReturn_t nvmlDeviceGetNumaNodeId(nvml_device_t d, unsigned int *v);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvml_device_t d, memory_t *m);
nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvml_device_t d, int *major, int *minor);
nvmlReturn_t nvmlDeviceGetArchitecture(nvml_device_t d, unsigned int *v);
nvmlReturn_t nvmlDeviceGetMigMode(nvml_device_t d, unsigned int *current, unsigned int *pending);
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvml_device_t d, unsigned int *n);
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvml_device_t d, unsigned int i, nvml_device_t *m);
nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvml_device_t d, unsigned int *v);
nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvml_device_t d, unsigned int *v);
nvmlReturn_t nvmlDeviceGetAttributes_v2(nvml_device_t d, attributes_t *a);
nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvml_device_t d, unsigned int profile, void *info);
nvmlReturn_t nvmlDeviceGetGpuInstances(nvml_device_t d, unsigned int profile_id,
                                       nvml_gpu_instance_t *gis, unsigned int *n);
nvmlReturn_t nvmlGpuInstanceGetInfo(nvml_gpu_instance_t gi, gi_info_t *info);
nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvml_gpu_instance_t gi,
                                                           unsigned int profile,
                                                           unsigned int eng, void *info);
nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvml_gpu_instance_t gi, unsigned int profile_id,
                                                nvml_compute_instance_t *cis, unsigned int *n);
nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvml_compute_instance_t ci, ci_info_t *info);

#define MAX_SELECTED 64
#define GI_PROFILES 18 /* GPU instance profile indices NVML defines */
#define CI_PROFILES 8  /* compute instance profile indices */

struct gpu {
    nvml_device_t h;
    unsigned int index;
    char name[96], uuid[96];
    pci_info_t pci;
};

enum { F_INDEX, F_NAME, F_UUID, F_BUS, F_DOMAIN, F_BUSNUM, F_DEVNUM, F_DEVICE_ID, F_SUB_ID,
       F_MINOR, F_NUMA, F_MEM_TOTAL, F_MEM_USED, F_MEM_FREE, F_DRIVER, F_COUNT, F_CC,
       F_MIG_CUR, F_MIG_PEND, F_NFIELDS };

extern int g_status; /* the exit status: the last NVML error that mattered */

void fail(const char *what, nvmlReturn_t r);
nvmlReturn_t gpu_load(unsigned int index, struct gpu *g);
int gpu_get(unsigned int index, struct gpu *g); /* gpu_load, failure reported */
/* one field's value for GPU g into out; "[N/A]" where NVML has none */
void field_value(int f, const struct gpu *g, unsigned int count, int units, char *out, size_t n);
int query_gpu(const char *spec, const char *format, const unsigned int *sel, int n,
              unsigned int count);
void report(const unsigned int *sel, int n, unsigned int count);
void list_fields(void);

#endif /* HWSANDBOX_SMI_H */
