/*
 * NVML's C ABI as our libnvidia-ml.so.1 implements it: return codes, event type bits,
 * topology levels, struct layouts and handle types.
 *
 * Written for hw-sandbox from NVML's published API facts; no NVIDIA header is used. The
 * names are ours (NVML's are given in comments); the values and layouts are NVML's, which
 * is what binary compatibility needs: a caller built against NVIDIA's header (go-nvml, in
 * NVIDIA's device plugin) passes these structs and reads these codes.
 */
#ifndef HWSANDBOX_NVML_ABI_H
#define HWSANDBOX_NVML_ABI_H

typedef int nvmlReturn_t;
typedef unsigned long long u64;

/* Handles (nvmlDevice_t, nvmlGpuInstance_t, nvmlComputeInstance_t, nvmlEventSet_t): opaque
 * pointers to the caller. Ours point into our own static arrays (nvml_internal.h). */
typedef void *nvml_device_t;           /* a full GPU or a MIG device */
typedef void *nvml_gpu_instance_t;
typedef void *nvml_compute_instance_t;
typedef void *nvml_event_set_t;

/* nvmlReturn_t values (NVML_SUCCESS, NVML_ERROR_*) */
enum {
    R_SUCCESS = 0,
    R_UNINITIALIZED = 1,
    R_INVALID_ARGUMENT = 2,
    R_NOT_SUPPORTED = 3,
    R_NO_PERMISSION = 4,
    R_ALREADY_INITIALIZED = 5,
    R_NOT_FOUND = 6,
    R_INSUFFICIENT_SIZE = 7,
    R_INSUFFICIENT_POWER = 8,
    R_DRIVER_NOT_LOADED = 9,
    R_TIMEOUT = 10,
    R_IRQ_ISSUE = 11,
    R_LIBRARY_NOT_FOUND = 12,
    R_FUNCTION_NOT_FOUND = 13,
    R_CORRUPTED_INFOROM = 14,
    R_GPU_IS_LOST = 15,
    R_RESET_REQUIRED = 16,
    R_OPERATING_SYSTEM = 17,
    R_LIB_RM_VERSION_MISMATCH = 18,
    R_IN_USE = 19,
    R_MEMORY = 20,
    R_NO_DATA = 21,
    R_VGPU_ECC_NOT_SUPPORTED = 22,
    R_INSUFFICIENT_RESOURCES = 23,
    R_FREQ_NOT_SUPPORTED = 24,
    R_ARGUMENT_VERSION_MISMATCH = 25,
    R_DEPRECATED = 26,
    R_NOT_READY = 27,
    R_GPU_NOT_FOUND = 28,
    R_INVALID_STATE = 29,
    R_UNKNOWN = 999,
};

/* event type bits (nvmlEventType*) */
#define EV_SINGLE_BIT_ECC 0x1ULL
#define EV_DOUBLE_BIT_ECC 0x2ULL
#define EV_PSTATE 0x4ULL
#define EV_XID_CRITICAL 0x8ULL
#define EV_CLOCK 0x10ULL

/* topology levels (nvmlGpuTopologyLevel_t) */
#define TOPO_INTERNAL 0
#define TOPO_NODE 40
#define TOPO_SYSTEM 50

/* an Xid event's data for a GPU that fell off the bus */
#define XID_FALLEN_OFF_BUS 79
/* an event's gpuInstanceId / computeInstanceId when it concerns no MIG device */
#define NO_ID 0xFFFFFFFFu

/* ---- published struct layouts (x86-64 / aarch64 LP64) -------------------------------- */

/* nvmlPciInfo_t */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} pci_info_t;

/* nvmlMemory_t */
typedef struct {
    u64 total, free, used;
} memory_t;

/* nvmlMemory_v2_t */
typedef struct {
    unsigned int version;
    u64 total, reserved, free, used;
} memory_v2_t;

/* nvmlEventData_t */
typedef struct {
    void *device;
    u64 eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} event_data_t;

/* what nvmlEventSetWait (v1) fills: nvmlEventData_t without the instance ids */
typedef struct {
    void *device;
    u64 eventType, eventData;
} event_data_v1_t;

/* nvmlDeviceAttributes_t */
typedef struct {
    unsigned int multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount, gpuInstanceSliceCount,
        computeInstanceSliceCount;
    u64 memorySizeMB;
} attributes_t;

/* nvmlGpuInstancePlacement_t, nvmlComputeInstancePlacement_t */
typedef struct {
    unsigned int start, size;
} placement_t;

/* nvmlGpuInstanceInfo_t */
typedef struct {
    void *device;
    unsigned int id, profileId;
    placement_t placement;
} gi_info_t;

/* what nvmlComputeInstanceGetInfo (v1) fills: nvmlComputeInstanceInfo_t without placement */
typedef struct {
    void *device;
    void *gpuInstance;
    unsigned int id, profileId;
} ci_info_v1_t;

/* nvmlComputeInstanceInfo_t */
typedef struct {
    void *device;
    void *gpuInstance;
    unsigned int id, profileId;
    placement_t placement;
} ci_info_t;

/* nvmlGpuInstanceProfileInfo_t */
typedef struct {
    unsigned int id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount,
        copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    u64 memorySizeMB;
} gi_profile_v1_t;

/* nvmlGpuInstanceProfileInfo_v2_t */
typedef struct {
    unsigned int version, id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount,
        copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    u64 memorySizeMB;
    char name[96];
} gi_profile_v2_t;

/* nvmlGpuInstanceProfileInfo_v3_t */
typedef struct {
    unsigned int version, id, sliceCount, instanceCount, multiprocessorCount, copyEngineCount,
        decoderCount, encoderCount, jpegCount, ofaCount;
    u64 memorySizeMB;
    char name[96];
    unsigned int capabilities;
} gi_profile_v3_t;

/* nvmlComputeInstanceProfileInfo_t */
typedef struct {
    unsigned int id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount,
        sharedDecoderCount, sharedEncoderCount, sharedJpegCount, sharedOfaCount;
} ci_profile_v1_t;

/* nvmlComputeInstanceProfileInfo_v2_t */
typedef struct {
    unsigned int version, id, sliceCount, instanceCount, multiprocessorCount,
        sharedCopyEngineCount, sharedDecoderCount, sharedEncoderCount, sharedJpegCount,
        sharedOfaCount;
    char name[96];
} ci_profile_v2_t;

/* nvmlComputeInstanceProfileInfo_v3_t */
typedef struct {
    unsigned int version, id, sliceCount, instanceCount, multiprocessorCount,
        sharedCopyEngineCount, sharedDecoderCount, sharedEncoderCount, sharedJpegCount,
        sharedOfaCount;
    char name[96];
    unsigned int capabilities;
} ci_profile_v3_t;

/* a versioned struct's version word: its size | version << 24 */
#define STRUCT_VERSION(type, v) ((unsigned int)(sizeof(type) | ((v) << 24)))

#endif /* HWSANDBOX_NVML_ABI_H */
