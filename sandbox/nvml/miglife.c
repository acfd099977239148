/*
 * MIG lifecycle entry points: MIG mode, GPU instance create (with and without placement) and
 * destroy, compute instance create and destroy, remaining capacities.
 *
 * Nothing changes here: each change is asked of the node's control server (the socket
 * HWSANDBOX_NVML_WATCH names, docs/control-api.md), which applies the one rule
 * (sandbox/fakehw/mig.py), rebuilds the tree (this library's state file, the driver's
 * capabilities, /dev/nvidia-caps) and replies once every reader can see the change; the
 * state file is then re-read, so the caller sees it at once too, and every other process at
 * its next refresh (docs/nvml.md, "Dynamic MIG"). A refusal comes back with a code this file
 * maps onto NVML's return codes.
 */
#include "nvml_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#define REPLY_MAX 4096 /* a change's reply is one short line */

/* the refusal's code (sandbox.errors.ControlError.code) -> NVML's return code */
static nvmlReturn_t code_of(const char *reply) {
    static const struct {
        const char *code;
        nvmlReturn_t ret;
    } map[] = {
        {"insufficient-resources", R_INSUFFICIENT_RESOURCES},
        {"invalid-argument", R_INVALID_ARGUMENT},
        {"not-supported", R_NOT_SUPPORTED},
        {"not-found", R_NOT_FOUND},
        {"in-use", R_IN_USE},
    };
    char want[64];
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        snprintf(want, sizeof want, "\"code\":\"%s\"", map[i].code);
        if (strstr(reply, want))
            return map[i].ret;
    }
    return R_UNKNOWN;
}

/* the non-negative integer after "key": in ``reply``, or -1 */
static long int_field(const char *reply, const char *key) {
    char want[32];
    snprintf(want, sizeof want, "\"%s\":", key);
    const char *at = strstr(reply, want);
    if (!at)
        return -1;
    char *end;
    long v = strtol(at + strlen(want), &end, 10);
    return end == at + strlen(want) || v < 0 ? -1 : v;
}

/* One request line to the control socket and its reply line into ``reply``. Lock held: a
 * change takes a few milliseconds, and this process's next read must see it. */
static nvmlReturn_t exchange(const char *request, char *reply, size_t size) {
    const char *path = getenv("HWSANDBOX_NVML_WATCH");
    if (!path || !*path) {
        logf_("MIG change refused: HWSANDBOX_NVML_WATCH does not name the node's control "
              "socket (only the server behind it may change MIG)");
        return R_NO_PERMISSION;
    }
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) {
        logf_("MIG change: socket path too long: %s", path);
        return R_UNKNOWN;
    }
    memcpy(addr.sun_path, path, strlen(path) + 1);
    struct timeval limit = {.tv_sec = 30}; /* a big node's rebuild; never forever */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit) ||
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit) ||
        connect(fd, (struct sockaddr *)&addr, sizeof addr)) {
        int e = errno;
        logf_("MIG change: %s: %s", path, strerror(e));
        if (fd >= 0)
            close(fd);
        return e == EACCES || e == EPERM ? R_NO_PERMISSION : R_UNKNOWN;
    }
    size_t len = strlen(request), sent = 0, got = 0;
    while (sent < len) {
        ssize_t n = send(fd, request + sent, len - sent, MSG_NOSIGNAL);
        if (n <= 0)
            break;
        sent += (size_t)n;
    }
    while (sent == len && got < size - 1 && !memchr(reply, '\n', got)) {
        ssize_t n = recv(fd, reply + got, size - 1 - got, 0);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    int e = errno;
    close(fd);
    reply[got] = 0;
    if (!memchr(reply, '\n', got)) {
        logf_("MIG change: %s: no reply (%s)", path, got ? "cut short" : strerror(e));
        return R_UNKNOWN;
    }
    return R_SUCCESS;
}

/* Ask for one MIG change of ``g``: ``fields`` is the request's op-specific JSON. On success
 * the state file is re-read and ``*gi_out`` (if given) is the reply's "gi". */
static nvmlReturn_t ask(struct gpu *g, const char *op, const char *fields, long *gi_out) {
    for (const char *c = g->devid; *c; c++)
        if (!(('a' <= *c && *c <= 'z') || ('A' <= *c && *c <= 'Z') || ('0' <= *c && *c <= '9') ||
              *c == '-' || *c == '_' || *c == '.'))
            return R_UNKNOWN;
    if (!g->devid[0]) {
        logf_("MIG change: the state file names no device id for %s", g->bdf);
        return R_UNKNOWN;
    }
    char request[256], reply[REPLY_MAX];
    snprintf(request, sizeof request, "{\"v\":1,\"op\":\"%s\",\"device\":\"%s\"%s%s}\n", op,
             g->devid, *fields ? "," : "", fields);
    nvmlReturn_t sent = exchange(request, reply, sizeof reply);
    if (sent)
        return sent;
    if (!strstr(reply, "\"ok\":true")) {
        nvmlReturn_t r = code_of(reply);
        logf_("MIG change %s %s refused: %.300s", op, g->devid, reply);
        return r;
    }
    if (gi_out)
        *gi_out = int_field(reply, "gi");
    refresh_locked(1);
    return R_SUCCESS;
}

API nvmlReturn_t nvmlDeviceSetMigMode(nvml_device_t device, unsigned int mode,
                                      nvmlReturn_t *activationStatus) {
    ENTER_HANDLE(full_gpu, device, g, m);
    (void)m;
    if (!activationStatus || mode > 1)
        LEAVE(R_INVALID_ARGUMENT);
    if (!g->mig_capable)
        LEAVE(R_NOT_SUPPORTED);
    /* applied at once: current and pending mode agree afterwards (no GPU reset needed) */
    nvmlReturn_t r = ask(g, "mig-mode", mode ? "\"enabled\":true" : "\"enabled\":false", NULL);
    /* as NVML: the call succeeds; whether the mode could be activated (IN_USE: instances
     * exist) is the activation status */
    *activationStatus = r;
    LEAVE(r == R_IN_USE ? R_SUCCESS : r);
}

/* gi-create with ``start`` (or -1: the server picks the first placement that fits) */
static nvmlReturn_t create_gi(nvml_device_t device, unsigned int profile, long start,
                              unsigned int size, nvml_gpu_instance_t *out) {
    ENTER_HANDLE(full_gpu, device, g, m);
    (void)m;
    if (!out || profile >= 18)
        LEAVE(R_INVALID_ARGUMENT);
    if (!g->mig_capable || !g->mig_mode)
        LEAVE(R_NOT_SUPPORTED);
    struct profile *p = find_profile(g, profile);
    if (!p)
        LEAVE(R_NOT_SUPPORTED);
    if (start >= 0 && size != p->mslices)
        LEAVE(R_INVALID_ARGUMENT);
    char fields[64];
    if (start >= 0)
        snprintf(fields, sizeof fields, "\"profile\":%u,\"start\":%ld", profile, start);
    else
        snprintf(fields, sizeof fields, "\"profile\":%u", profile);
    long gi = -1;
    CHECK(ask(g, "gi-create", fields, &gi));
    if (gi <= 0 || gi >= MAX_GI || !g->migs[gi].present) {
        logf_("MIG change gi-create %s: the reply's GPU instance %ld is not in the tree",
              g->devid, gi);
        LEAVE(R_UNKNOWN);
    }
    *out = gi_handle_of(g, (unsigned int)gi);
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceCreateGpuInstance(nvml_device_t device, unsigned int profileId,
                                             nvml_gpu_instance_t *gpuInstance) {
    return create_gi(device, profileId, -1, 0, gpuInstance);
}

API nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvml_device_t device,
                                                          unsigned int profileId,
                                                          const placement_t *placement,
                                                          nvml_gpu_instance_t *gpuInstance) {
    if (!placement)
        return R_INVALID_ARGUMENT;
    if (placement->start > 63)
        return R_INVALID_ARGUMENT;
    return create_gi(device, profileId, placement->start, placement->size, gpuInstance);
}

API nvmlReturn_t nvmlGpuInstanceDestroy(nvml_gpu_instance_t gpuInstance) {
    ENTER_HANDLE(as_gi, gpuInstance, g, m);
    char fields[32];
    snprintf(fields, sizeof fields, "\"gi\":%u", m->gi);
    LEAVE(ask(g, "gi-destroy", fields, NULL));
}

API nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvml_gpu_instance_t gpuInstance,
                                                      unsigned int profileId,
                                                      nvml_compute_instance_t *computeInstance) {
    ENTER_HANDLE(as_gi, gpuInstance, g, m);
    if (!computeInstance || profileId >= 9)
        LEAVE(R_INVALID_ARGUMENT);
    unsigned int gi = m->gi;
    char fields[48];
    snprintf(fields, sizeof fields, "\"gi\":%u,\"profile\":%u", gi, profileId);
    CHECK(ask(g, "ci-create", fields, NULL));
    if (!g->migs[gi].present || !g->migs[gi].has_ci)
        LEAVE(R_UNKNOWN);
    *computeInstance = ci_handle_of(g, gi);
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlComputeInstanceDestroy(nvml_compute_instance_t computeInstance) {
    ENTER_HANDLE(as_ci, computeInstance, g, m);
    char fields[48];
    snprintf(fields, sizeof fields, "\"gi\":%u,\"ci\":%u", m->gi, m->ci);
    LEAVE(ask(g, "ci-destroy", fields, NULL));
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    nvml_gpu_instance_t gpuInstance, unsigned int profileId, unsigned int *count) {
    ENTER_HANDLE(as_gi, gpuInstance, g, m);
    (void)g;
    if (!count || profileId >= 9)
        LEAVE(R_INVALID_ARGUMENT);
    if (profileId != m->giprof) /* only the compute instance spanning it */
        LEAVE(R_NOT_SUPPORTED);
    *count = !m->has_ci;
    LEAVE(R_SUCCESS);
}
