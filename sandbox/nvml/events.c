/*
 * Events: event sets, the fault poller and nvmlEventSetWait.
 *
 * A fault is a change of a GPU's Xid in the state file. While any event set has a GPU
 * registered, a poller thread re-reads the state every HWSANDBOX_NVML_REFRESH_MS (10 ms
 * when 0) and queues each change to a non-zero Xid in every set that registered that GPU,
 * so a fault is kept until waited for (like the driver's event queue) even if the GPU
 * recovers meanwhile. nvmlEventSetWait also polls itself. nvmlShutdown to zero stops and
 * joins the poller, so no thread runs in this library when a caller dlcloses it.
 *
 * With HWSANDBOX_NVML_WATCH naming the node's control socket, the poller also watches its
 * change stream (docs/control-api.md, "watch") and re-reads the state file as soon as a
 * change is committed, instead of at its next tick; the timer stays as the fallback, and a
 * socket that cannot be reached or closes leaves the timer alone (logged).
 */
#include "nvml_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

struct event_reg {
    int gpu;
    u64 mask;
    unsigned int last_xid;
};

#define EVENT_QUEUE 32

struct event_set {
    int used;
    int nregs;
    struct event_reg regs[MAX_GPUS];
    int qhead, qlen; /* events seen but not yet waited for, oldest first */
    struct {
        int gpu;
        unsigned int xid;
    } queue[EVENT_QUEUE];
};

static struct event_set g_sets[MAX_EVENT_SETS];
static pthread_cond_t g_cond = PTHREAD_COND_INITIALIZER; /* new events, or stop */
static pthread_t g_poller;
static int g_poller_state; /* 0 none, 1 running, 2 being stopped */

static struct event_set *as_set(void *h) {
    int i = index_in(h, g_sets, sizeof g_sets[0], MAX_EVENT_SETS);
    return i < 0 || !g_sets[i].used ? NULL : &g_sets[i];
}

/* Queue the Xid changes of the set's GPUs; 1 if any was queued. Lock held. */
static int poll_set(struct event_set *s) {
    int queued = 0;
    for (int i = 0; i < s->nregs; i++) {
        struct event_reg *reg = &s->regs[i];
        if (reg->gpu >= g_st.ngpus)
            continue;
        struct gpu *g = &g_st.gpus[reg->gpu];
        unsigned int xid = g->lost && !g->xid ? XID_FALLEN_OFF_BUS : g->xid;
        if (xid == reg->last_xid)
            continue;
        reg->last_xid = xid; /* back to 0: recovered, re-armed silently */
        if (!xid || !(reg->mask & EV_XID_CRITICAL))
            continue;
        if (s->qlen == EVENT_QUEUE) { /* full: the oldest is dropped */
            s->qhead = (s->qhead + 1) % EVENT_QUEUE;
            s->qlen--;
        }
        int slot = (s->qhead + s->qlen) % EVENT_QUEUE;
        s->queue[slot].gpu = reg->gpu;
        s->queue[slot].xid = xid;
        s->qlen++;
        queued = 1;
    }
    return queued;
}

static int poll_all_locked(void) {
    int queued = 0;
    for (int i = 0; i < MAX_EVENT_SETS; i++)
        if (g_sets[i].used && g_sets[i].nregs)
            queued |= poll_set(&g_sets[i]);
    return queued;
}

static void deadline_in(struct timespec *ts, long ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static long poll_interval(void) { return g_refresh_ms > 0 ? g_refresh_ms : 10; }

static int g_wake[2] = {-1, -1}; /* a byte here wakes a poller that watches the socket */
static char g_watch[256];          /* HWSANDBOX_NVML_WATCH when the poller started */

/* The control socket HWSANDBOX_NVML_WATCH names, asked for its change stream: its fd, or
 * -1 (logged) without one. Lock not held: a connect may take its time. */
static int watch_open(const char *path) {
    if (!*path)
        return -1;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) {
        logf_("watch: socket path too long: %s; polling instead", path);
        return -1;
    }
    memcpy(addr.sun_path, path, strlen(path) + 1);
    static const char request[] = "{\"v\":1,\"op\":\"watch\"}\n";
    /* at most 2 s to connect and send, then the timer alone; the reply is awaited as long
     * (or until nvmlShutdown wakes this thread: a server that never answers must not hold
     * up a shutdown) */
    struct timeval limit = {.tv_sec = 2};
    char reply[256];
    ssize_t got = -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit) == 0 &&
        connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0 &&
        send(fd, request, sizeof request - 1, MSG_NOSIGNAL) == (ssize_t)(sizeof request - 1)) {
        struct pollfd p[2] = {{.fd = fd, .events = POLLIN}, {.fd = g_wake[0], .events = POLLIN}};
        int n = poll(p, 2, 2000);
        if (n > 0 && p[0].revents)
            got = recv(fd, reply, sizeof reply - 1, MSG_DONTWAIT);
        else
            errno = n == 0 ? ETIMEDOUT : n > 0 ? ECANCELED : errno;
    }
    if (got <= 0) {
        if (got == 0 || errno != ECANCELED)
            logf_("watch: %s: %s; polling instead", path, got == 0 ? "closed" : strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    /* The ok line first: changes committed from now on are streamed, so the first re-read
     * after this misses none. Anything else (an error line) means no stream. */
    reply[got] = 0;
    if (!strstr(reply, "\"ok\":true")) {
        logf_("watch: %s refused the watch: %.200s; polling instead", path, reply);
        close(fd);
        return -1;
    }
    return fd;
}

/* Wait up to one poll interval for the watch stream (any line: a change, or the ok) or a
 * wake-up. Lock held on entry and return, dropped while waiting. Returns the fd, or -1 once
 * the stream has ended (logged; the timer goes on alone). */
static int watch_wait_locked(int fd) {
    pthread_mutex_unlock(&g_lock);
    struct pollfd p[2] = {{.fd = fd, .events = POLLIN}, {.fd = g_wake[0], .events = POLLIN}};
    if (poll(p, 2, (int)poll_interval()) > 0 && p[0].revents) {
        /* everything queued now is one wake-up: a burst of changes (or a flood) costs one
         * re-read, not one per chunk; bounded, so a sender that never stops cannot keep
         * this thread from its re-read */
        char buf[4096];
        ssize_t got;
        int chunks = 0;
        do
            got = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        while (got > 0 && ++chunks < 64);
        if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN)) {
            logf_("watch: the control socket's stream ended; polling instead");
            close(fd);
            fd = -1;
        }
    }
    pthread_mutex_lock(&g_lock);
    return fd;
}

static void *poller_main(void *arg) {
    int fd = watch_open(arg);
    pthread_mutex_lock(&g_lock);
    while (g_poller_state == 1) {
        refresh_locked(1);
        if (poll_all_locked())
            pthread_cond_broadcast(&g_cond);
        if (fd >= 0) {
            fd = watch_wait_locked(fd);
            continue;
        }
        struct timespec ts;
        deadline_in(&ts, poll_interval());
        pthread_cond_timedwait(&g_cond, &g_lock, &ts);
    }
    pthread_mutex_unlock(&g_lock);
    if (fd >= 0)
        close(fd);
    return NULL;
}

static void start_poller_locked(void) {
    if (g_poller_state != 0)
        return; /* running, or being stopped: waiters poll themselves meanwhile */
    if (g_wake[0] < 0 && pipe2(g_wake, O_CLOEXEC | O_NONBLOCK) != 0)
        g_wake[0] = g_wake[1] = -1; /* poll() ignores a negative fd: stop waits a tick */
    const char *watch = getenv("HWSANDBOX_NVML_WATCH");
    snprintf(g_watch, sizeof g_watch, "%s", watch ? watch : "");
    if (pthread_create(&g_poller, NULL, poller_main, g_watch) == 0)
        g_poller_state = 1;
    else
        logf_("events: no poller thread (%s); faults are seen only while waiting",
              strerror(errno));
}

/* Lock held on entry and on return; dropped while joining. */
void stop_poller_locked(void) {
    if (g_poller_state != 1)
        return;
    g_poller_state = 2;
    pthread_cond_broadcast(&g_cond);
    if (g_wake[1] >= 0 && write(g_wake[1], "", 1) < 0) {
        /* full pipe: a wake-up is pending already */
    }
    pthread_t t = g_poller;
    pthread_mutex_unlock(&g_lock);
    pthread_join(t, NULL);
    pthread_mutex_lock(&g_lock);
    g_poller_state = 0;
    char drain[16];
    while (g_wake[0] >= 0 && read(g_wake[0], drain, sizeof drain) > 0) {
    }
}

void reset_event_sets(void) { memset(g_sets, 0, sizeof g_sets); }

API nvmlReturn_t nvmlEventSetCreate(nvml_event_set_t *set) {
    ENTER();
    if (!set)
        LEAVE(R_INVALID_ARGUMENT);
    for (int i = 0; i < MAX_EVENT_SETS; i++)
        if (!g_sets[i].used) {
            memset(&g_sets[i], 0, sizeof g_sets[i]);
            g_sets[i].used = 1;
            *set = &g_sets[i];
            LEAVE(R_SUCCESS);
        }
    LEAVE(R_MEMORY);
}

API nvmlReturn_t nvmlEventSetFree(nvml_event_set_t set) {
    ENTER();
    struct event_set *s = as_set(set);
    if (!s)
        LEAVE(R_INVALID_ARGUMENT);
    s->used = 0;
    pthread_cond_broadcast(&g_cond); /* a waiter on it returns */
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvml_device_t device, u64 *types) {
    ENTER_HANDLE(resolve, device, g, m);
    if (!types)
        LEAVE(R_INVALID_ARGUMENT);
    *types = EV_SUPPORTED;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceRegisterEvents(nvml_device_t device, u64 types, nvml_event_set_t set) {
    ENTER_HANDLE(full_gpu, device, g, m);
    struct event_set *s = as_set(set);
    if (!s || (types & ~EV_SUPPORTED))
        LEAVE(R_INVALID_ARGUMENT);
    int idx = (int)(g - g_st.gpus);
    for (int i = 0; i < s->nregs; i++)
        if (s->regs[i].gpu == idx) {
            s->regs[i].mask |= types;
            LEAVE(R_SUCCESS);
        }
    if (s->nregs >= MAX_GPUS)
        LEAVE(R_INSUFFICIENT_RESOURCES);
    /* last_xid 0: a fault already present is delivered by the first wait */
    s->regs[s->nregs++] = (struct event_reg){idx, types, 0};
    start_poller_locked();
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlEventSetWait_v2(nvml_event_set_t set, event_data_t *data,
                                     unsigned int timeout_ms) {
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    pthread_mutex_lock(&g_lock);
    if (!g_refs)
        LEAVE(R_UNINITIALIZED);
    if (!as_set(set) || !data)
        LEAVE(R_INVALID_ARGUMENT);
    unsigned long gen = g_generation;
    for (;;) {
        if (!g_refs || gen != g_generation)
            LEAVE(R_UNINITIALIZED);
        struct event_set *s = as_set(set);
        if (!s)
            LEAVE(R_INVALID_ARGUMENT);
        refresh_locked(0);
        poll_all_locked();
        if (s->qlen) {
            int gpu = s->queue[s->qhead].gpu;
            data->device = &g_st.gpus[gpu];
            data->eventType = EV_XID_CRITICAL;
            data->eventData = s->queue[s->qhead].xid;
            data->gpuInstanceId = NO_ID;
            data->computeInstanceId = NO_ID;
            s->qhead = (s->qhead + 1) % EVENT_QUEUE;
            s->qlen--;
            LEAVE(R_SUCCESS);
        }
        long left = (long)timeout_ms - ms_since(&start);
        if (left <= 0)
            LEAVE(R_TIMEOUT);
        struct timespec ts;
        deadline_in(&ts, left < poll_interval() ? left : poll_interval());
        pthread_cond_timedwait(&g_cond, &g_lock, &ts);
    }
}

API nvmlReturn_t nvmlEventSetWait(nvml_event_set_t set, event_data_v1_t *data,
                                  unsigned int timeout_ms) {
    if (!data) {
        pthread_mutex_lock(&g_lock);
        LEAVE(g_refs ? R_INVALID_ARGUMENT : R_UNINITIALIZED);
    }
    event_data_t ev;
    nvmlReturn_t r = nvmlEventSetWait_v2(set, &ev, timeout_ms);
    if (r == R_SUCCESS) {
        data->device = ev.device;
        data->eventType = ev.eventType;
        data->eventData = ev.eventData;
    }
    return r;
}
