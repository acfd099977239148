/*
 * Events: event sets, the fault poller and nvmlEventSetWait.
 *
 * A fault is a change of a GPU's Xid in the state file. While any event set has a GPU
 * registered, a poller thread re-reads the state every HWSANDBOX_NVML_REFRESH_MS (10 ms
 * when 0) and queues each change to a non-zero Xid in every set that registered that GPU,
 * so a fault is kept until waited for (like the driver's event queue) even if the GPU
 * recovers meanwhile. nvmlEventSetWait also polls itself. nvmlShutdown to zero stops and
 * joins the poller, so no thread runs in this library when a caller dlcloses it.
 */
#include "nvml_internal.h"

#include <errno.h>
#include <string.h>

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

static void *poller_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&g_lock);
    while (g_poller_state == 1) {
        refresh_locked(1);
        if (poll_all_locked())
            pthread_cond_broadcast(&g_cond);
        struct timespec ts;
        deadline_in(&ts, poll_interval());
        pthread_cond_timedwait(&g_cond, &g_lock, &ts);
    }
    pthread_mutex_unlock(&g_lock);
    return NULL;
}

static void start_poller_locked(void) {
    if (g_poller_state != 0)
        return; /* running, or being stopped: waiters poll themselves meanwhile */
    if (pthread_create(&g_poller, NULL, poller_main, NULL) == 0)
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
    pthread_t t = g_poller;
    pthread_mutex_unlock(&g_lock);
    pthread_join(t, NULL);
    pthread_mutex_lock(&g_lock);
    g_poller_state = 0;
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
