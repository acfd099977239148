/*
 * hw-sandbox's NVML: a libnvidia-ml.so.1 that answers from a sandbox node's fake tree.
 *
 * Written for hw-sandbox from NVML's published API facts (entry point names, struct
 * layouts, return codes, enum values); no NVIDIA header or code is used. docs/nvml.md
 * describes what it reads, the state file format and the fault mapping.
 *
 *   identity  <root>/proc/driver/nvidia/gpus/<bdf>/information (UUID, name, minor)
 *             <root>/sys/bus/pci/devices/<bdf>/{vendor,device,subsystem_*,numa_node}
 *   the rest  <root>/proc/driver/nvidia/hwsandbox/nvml (the sandbox-owned state file)
 *
 * <root> is $HWSANDBOX_NVML_ROOT (default "/"). $HWSANDBOX_NVML_LOG (a path, or "-" for
 * stderr) logs every call this library does not implement; those return
 * NVML_ERROR_NOT_SUPPORTED. One mutex guards all state; nvmlEventSetWait sleeps without it,
 * and nothing done with it held waits on a file: every file read must be a regular file,
 * opened O_NONBLOCK | O_NOFOLLOW (slurp), and log lines to a stream that could block are
 * dropped rather than waited for (log_write).
 * Handles point into static arrays and are validated before use, so a stale or bogus
 * handle gives NVML_ERROR_INVALID_ARGUMENT (or UNINITIALIZED), never a crash.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int nvmlReturn_t;
typedef unsigned long long u64;

/* nvmlReturn_t values */
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

/* event type bits */
#define EV_SINGLE_BIT_ECC 0x1ULL
#define EV_DOUBLE_BIT_ECC 0x2ULL
#define EV_PSTATE 0x4ULL
#define EV_XID_CRITICAL 0x8ULL
#define EV_CLOCK 0x10ULL
#define EV_SUPPORTED (EV_SINGLE_BIT_ECC | EV_DOUBLE_BIT_ECC | EV_PSTATE | EV_XID_CRITICAL | EV_CLOCK)

/* topology levels */
#define TOPO_INTERNAL 0
#define TOPO_NODE 40
#define TOPO_SYSTEM 50

#define XID_FALLEN_OFF_BUS 79
#define NO_ID 0xFFFFFFFFu
#define UUID_LEN 96
#define NAME_LEN 96
#define MAX_GPUS 64
#define MAX_MIGS 8
#define MAX_PROFILES 16
#define MAX_EVENT_SETS 64
#define STATE_MAX (1 << 20)
#define DEFAULT_REFRESH_MS 50

/* ---- published struct layouts (x86-64 / aarch64 LP64) -------------------------------- */

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} pci_info_t;

typedef struct {
    u64 total, free, used;
} memory_t;

typedef struct {
    unsigned int version;
    u64 total, reserved, free, used;
} memory_v2_t;

typedef struct {
    void *device;
    u64 eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} event_data_t;

typedef struct {
    void *device;
    u64 eventType, eventData;
} event_data_v1_t;

typedef struct {
    unsigned int multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount, gpuInstanceSliceCount,
        computeInstanceSliceCount;
    u64 memorySizeMB;
} attributes_t;

typedef struct {
    unsigned int start, size;
} placement_t;

typedef struct {
    void *device;
    unsigned int id, profileId;
    placement_t placement;
} gi_info_t;

typedef struct {
    void *device;
    void *gpuInstance;
    unsigned int id, profileId;
} ci_info_v1_t;

typedef struct {
    void *device;
    void *gpuInstance;
    unsigned int id, profileId;
    placement_t placement;
} ci_info_t;

typedef struct {
    unsigned int id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount,
        copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    u64 memorySizeMB;
} gi_profile_v1_t;

typedef struct {
    unsigned int version, id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount,
        copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    u64 memorySizeMB;
    char name[96];
} gi_profile_v2_t;

typedef struct {
    unsigned int version, id, sliceCount, instanceCount, multiprocessorCount, copyEngineCount,
        decoderCount, encoderCount, jpegCount, ofaCount;
    u64 memorySizeMB;
    char name[96];
    unsigned int capabilities;
} gi_profile_v3_t;

typedef struct {
    unsigned int id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount,
        sharedDecoderCount, sharedEncoderCount, sharedJpegCount, sharedOfaCount;
} ci_profile_v1_t;

typedef struct {
    unsigned int version, id, sliceCount, instanceCount, multiprocessorCount,
        sharedCopyEngineCount, sharedDecoderCount, sharedEncoderCount, sharedJpegCount,
        sharedOfaCount;
    char name[96];
} ci_profile_v2_t;

typedef struct {
    unsigned int version, id, sliceCount, instanceCount, multiprocessorCount,
        sharedCopyEngineCount, sharedDecoderCount, sharedEncoderCount, sharedJpegCount,
        sharedOfaCount;
    char name[96];
    unsigned int capabilities;
} ci_profile_v3_t;

/* a versioned struct's version word: its size | version << 24 */
#define STRUCT_VERSION(type, v) ((unsigned int)(sizeof(type) | ((v) << 24)))

/* ---- our state ------------------------------------------------------------------------ */

struct mig {
    unsigned int gi, ci, giprof, ciprof, start, size, cslices, sm;
    u64 mem_mb;
    char uuid[UUID_LEN];
    char pname[32]; /* 3g.40gb */
};

struct profile {
    unsigned int giprof, cslices, mslices, count, sm;
    u64 mem_mb;
    char pname[32];
};

/* handles for GPU and compute instances: the address is the handle */
struct gi_handle {
    int gpu, mig;
};
struct ci_handle {
    int gpu, mig;
};

struct gpu {
    /* identity: read at nvmlInit */
    char bdf[32]; /* 0000:18:00.0, the tree's directory name */
    char uuid[UUID_LEN];
    char name[NAME_LEN];
    unsigned int minor, domain, bus, dev, fn;
    unsigned int vendor, device, subvendor, subdevice;
    int numa;
    /* from the state file, refreshed */
    int seen;
    u64 memory;
    int cc_major, cc_minor;
    unsigned int arch, brand, sm;
    int mig_capable, mig_mode, lost;
    unsigned int xid;
    int nmig, nprof;
    struct mig migs[MAX_MIGS];
    struct profile profs[MAX_PROFILES];
};

struct state {
    char driver[80];
    int cuda;
    int ngpus;
    struct gpu gpus[MAX_GPUS];
};

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

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_refs;
static unsigned long g_generation; /* bumped by every successful first init */
static struct state g_st;
static struct gi_handle g_gi[MAX_GPUS][MAX_MIGS];
static struct ci_handle g_ci[MAX_GPUS][MAX_MIGS];
static struct event_set g_sets[MAX_EVENT_SETS];
static char g_root[4096] = "/";
static long g_refresh_ms = DEFAULT_REFRESH_MS;
static struct timespec g_last_refresh;
static int g_log_fd = -1;   /* HWSANDBOX_NVML_LOG's descriptor; -1: not logging */
static int g_log_guarded;   /* it could block (stderr as a pipe, socket or tty) */

/* True if a write to ``fd`` could wait (a pipe, socket or terminal), not a regular file. */
static int may_block(int fd) {
    struct stat st;
    return !(fstat(fd, &st) == 0 && S_ISREG(st.st_mode));
}

/* One line, in one write(2). Lines are logged with the library's lock held, so a stream
 * that could block (stderr as a pipe nobody drains) gets the line only if poll says it
 * takes one now; else the line is dropped. Lines are under PIPE_BUF, so a writable pipe
 * takes the whole line at once. */
static void log_write(int fd, int guarded, const char *buf, size_t n) {
    if (guarded) {
        struct pollfd pfd = {.fd = fd, .events = POLLOUT};
        if (poll(&pfd, 1, 0) != 1 || !(pfd.revents & POLLOUT))
            return;
    }
    while (n) {
        ssize_t w = write(fd, buf, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return;
        buf += w;
        n -= (size_t)w;
    }
}

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logf_(const char *fmt, ...) {
    if (g_log_fd < 0)
        return;
    char line[512];
    const size_t room = sizeof line - 1; /* the last byte is for the newline */
    int k = snprintf(line, room, "hwsandbox-nvml: ");
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + k, room - (size_t)k, fmt, ap);
    va_end(ap);
    if (m < 0)
        return;
    size_t len = (size_t)k + ((size_t)m < room - (size_t)k ? (size_t)m : room - (size_t)k - 1);
    line[len++] = '\n';
    log_write(g_log_fd, g_log_guarded, line, len);
}

/* HWSANDBOX_NVML_LOG: "-" is stderr; anything else must be a regular file (created if
 * missing, appended to). The log is only diagnostics, so a path that is no regular file,
 * or cannot be opened, means no log, said once on stderr, and nvmlInit goes on as without
 * the variable; failing nvmlInit over it would take the GPUs away for a typo. A FIFO would
 * block a plain open until a reader comes (here, inside pthread_once: every nvmlInit and
 * every stub waits too) and then every write once the pipe is full, with the lock held:
 * so the open is O_NONBLOCK (a FIFO without a reader fails at once, ENXIO) and fstat
 * refuses what opened. Links are followed: this path is the user's, not the tree's.
 * /dev/null is taken as "no log", quietly. */
static pthread_once_t g_log_once = PTHREAD_ONCE_INIT;
static void log_init(void) {
    const char *p = getenv("HWSANDBOX_NVML_LOG");
    if (!p || !*p)
        return;
    if (strcmp(p, "-") == 0) {
        g_log_guarded = may_block(2);
        g_log_fd = 2;
        return;
    }
    const char *why = "not a regular file";
    char err[128];
    struct stat st;
    int fd = open(p, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, 0666);
    int have_st = fd >= 0 && fstat(fd, &st) == 0;
    if (have_st && S_ISREG(st.st_mode)) {
        g_log_fd = fd; /* O_NONBLOCK stays: it means nothing for a regular file */
        return;
    }
    if (fd >= 0) {
        int devnull = have_st && S_ISCHR(st.st_mode) && major(st.st_rdev) == 1 &&
                      minor(st.st_rdev) == 3;
        close(fd);
        if (devnull)
            return;
    } else {
        int e = errno;
        if (stat(p, &st) != 0 || S_ISREG(st.st_mode))
            why = strerror_r(e, err, sizeof err);
    }
    char line[512];
    int n = snprintf(line, sizeof line,
                     "hwsandbox-nvml: HWSANDBOX_NVML_LOG=%s: %s; not logging (give a regular "
                     "file, or - for stderr)\n", p, why);
    if (n <= 0)
        return;
    size_t len = (size_t)n;
    if (len >= sizeof line) { /* cut: still one line */
        len = sizeof line - 1;
        line[len - 1] = '\n';
    }
    log_write(2, may_block(2), line, len);
}

/* called by every stub (generated from entrypoints.txt) */
nvmlReturn_t hwsandbox_nvml_unimplemented(const char *name) {
    pthread_once(&g_log_once, log_init);
    logf_("unimplemented: %s", name);
    return R_NOT_SUPPORTED;
}

/* ---- small helpers -------------------------------------------------------------------- */

static long ms_since(const struct timespec *t) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - t->tv_sec) * 1000L + (now.tv_nsec - t->tv_nsec) / 1000000L;
}

static int path_of(char *out, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int path_of(char *out, size_t n, const char *fmt, ...) {
    int k = snprintf(out, n, "%s", g_root);
    if (k < 0 || (size_t)k >= n)
        return -1;
    while (k > 0 && out[k - 1] == '/')
        out[--k] = 0;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(out + k, n - (size_t)k, fmt, ap);
    va_end(ap);
    return (m < 0 || (size_t)m >= n - (size_t)k) ? -1 : 0;
}

/* why slurp gave NULL */
enum { SL_MISSING = 1, SL_REFUSED, SL_FAILED };

static const char *slurp_why(int why) {
    return why == SL_MISSING ? "missing"
           : why == SL_REFUSED ? "not a regular file"
                               : "unreadable, or too big";
}

/* A file of the tree, whole, into a NUL-terminated malloc'd buffer; NULL (and *why) if it
 * is missing, is no regular file, cannot be read or holds more than ``max`` bytes.
 *
 * Called with the library's lock held (every state-file refresh, nvmlInit), so it never
 * waits on the file: a FIFO's open waits for a writer and its read for data, a device's
 * for whatever the device does, and every other thread calling in would wait behind the
 * lock. Opened O_NONBLOCK (a FIFO or device opens at once), then refused unless fstat says
 * regular file. O_NOFOLLOW: the tree (the FUSE mount, a `sandbox render` directory, or a
 * real host's /proc and /sys) serves these files as files, never as links, and a link
 * could lead anywhere outside it; links in the directories above (sysfs'
 * bus/pci/devices/<bdf>) are still followed. O_NONBLOCK stays set: for a regular file it
 * changes nothing. The read is bounded by ``max``. */
static char *slurp(const char *path, size_t max, int *why) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY);
    struct stat st;
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT || e == ENOTDIR)
            *why = SL_MISSING;
        else /* ELOOP (a link), or a device or FIFO that would not open */
            *why = lstat(path, &st) == 0 && !S_ISREG(st.st_mode) ? SL_REFUSED : SL_FAILED;
        return NULL;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        *why = SL_REFUSED;
        close(fd);
        return NULL;
    }
    *why = SL_FAILED;
    /* room for up to max + 1 bytes (and the NUL): reading that many means too big */
    size_t cap = max + 2 < 4096 ? max + 2 : 4096, len = 0;
    char *buf = malloc(cap);
    if (!buf) {
        close(fd);
        return NULL;
    }
    for (;;) {
        if (len + 1 >= cap) {
            if (cap >= max + 2) { /* more than max bytes */
                free(buf);
                close(fd);
                return NULL;
            }
            size_t ncap = cap * 2 < max + 2 ? cap * 2 : max + 2;
            char *nb = realloc(buf, ncap);
            if (!nb) {
                free(buf);
                close(fd);
                return NULL;
            }
            buf = nb;
            cap = ncap;
        }
        ssize_t r = read(fd, buf + len, cap - 1 - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            free(buf);
            close(fd);
            return NULL;
        }
        if (r == 0)
            break;
        len += (size_t)r;
    }
    close(fd);
    buf[len] = 0;
    return buf;
}

static void trim(char *s) {
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1]))
        s[--n] = 0;
    size_t i = 0;
    while (s[i] && isspace((unsigned char)s[i]))
        i++;
    if (i)
        memmove(s, s + i, n - i + 1);
}

static int copy_str(char *dst, unsigned int len, const char *src) {
    if (!dst)
        return R_INVALID_ARGUMENT;
    size_t n = strlen(src);
    if ((size_t)len < n + 1)
        return R_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return R_SUCCESS;
}

static int read_hex(const char *dir, const char *attr, unsigned int *out) {
    char p[4096];
    if (snprintf(p, sizeof p, "%s/%s", dir, attr) >= (int)sizeof p)
        return -1;
    int why;
    char *s = slurp(p, 4096, &why);
    if (!s)
        return -1;
    char *end;
    unsigned long v = strtoul(s, &end, 0);
    int bad = end == s;
    free(s);
    if (bad)
        return -1;
    *out = (unsigned int)v;
    return 0;
}

static int parse_bdf(const char *s, unsigned int *dom, unsigned int *bus, unsigned int *dev,
                     unsigned int *fn) {
    char tail;
    if (sscanf(s, "%x:%x:%x.%x%c", dom, bus, dev, fn, &tail) == 4)
        return 0;
    *dom = 0;
    if (sscanf(s, "%x:%x.%x%c", bus, dev, fn, &tail) == 3)
        return 0;
    return -1;
}

/* ---- identity: /proc/driver/nvidia/gpus and the PCI device directory ------------------- */

static int load_identity(struct gpu *g, const char *bdf) {
    char p[4096];
    memset(g, 0, sizeof *g);
    snprintf(g->bdf, sizeof g->bdf, "%s", bdf);
    if (parse_bdf(bdf, &g->domain, &g->bus, &g->dev, &g->fn))
        return -1;
    if (path_of(p, sizeof p, "/proc/driver/nvidia/gpus/%s/information", bdf))
        return -1;
    int why;
    char *info = slurp(p, 65536, &why);
    if (!info) {
        logf_("init: %s: %s", p, slurp_why(why));
        return -1;
    }
    int have_uuid = 0, have_minor = 0;
    for (char *save = NULL, *line = strtok_r(info, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        char *colon = strchr(line, ':');
        if (!colon)
            continue;
        *colon = 0;
        char *key = line, *val = colon + 1;
        trim(key);
        trim(val);
        if (strcmp(key, "Model") == 0)
            snprintf(g->name, sizeof g->name, "%s", val);
        else if (strcmp(key, "GPU UUID") == 0) {
            snprintf(g->uuid, sizeof g->uuid, "%s", val);
            have_uuid = 1;
        } else if (strcmp(key, "Device Minor") == 0) {
            g->minor = (unsigned int)strtoul(val, NULL, 10);
            have_minor = 1;
        }
    }
    free(info);
    if (!have_uuid || !have_minor)
        return -1;
    if (path_of(p, sizeof p, "/sys/bus/pci/devices/%s", bdf))
        return -1;
    g->vendor = 0x10de;
    read_hex(p, "vendor", &g->vendor);
    read_hex(p, "device", &g->device);
    read_hex(p, "subsystem_vendor", &g->subvendor);
    read_hex(p, "subsystem_device", &g->subdevice);
    char np[4096];
    g->numa = -1;
    if (snprintf(np, sizeof np, "%s/numa_node", p) < (int)sizeof np) {
        char *s = slurp(np, 64, &why);
        if (s) {
            g->numa = atoi(s);
            free(s);
        }
    }
    return 0;
}

static int cmp_gpu(const void *a, const void *b) {
    const struct gpu *x = a, *y = b;
    if (x->domain != y->domain)
        return x->domain < y->domain ? -1 : 1;
    if (x->bus != y->bus)
        return x->bus < y->bus ? -1 : 1;
    if (x->dev != y->dev)
        return x->dev < y->dev ? -1 : 1;
    return x->fn < y->fn ? -1 : (x->fn > y->fn);
}

/* ---- the state file ------------------------------------------------------------------- */

static struct gpu *gpu_by_bdf(struct state *st, const char *bdf) {
    for (int i = 0; i < st->ngpus; i++)
        if (strcasecmp(st->gpus[i].bdf, bdf) == 0)
            return &st->gpus[i];
    return NULL;
}

/* "key=value" lookup in a tokenized record */
static const char *field(char **tok, int ntok, const char *key) {
    size_t k = strlen(key);
    for (int i = 2; i < ntok; i++)
        if (strncmp(tok[i], key, k) == 0 && tok[i][k] == '=')
            return tok[i] + k + 1;
    return NULL;
}

static int num(char **tok, int ntok, const char *key, u64 *out) {
    const char *v = field(tok, ntok, key);
    if (!v || !*v)
        return -1;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (*end || errno || v[0] == '-')
        return -1;
    *out = x;
    return 0;
}

static int num32(char **tok, int ntok, const char *key, unsigned int *out) {
    u64 v;
    if (num(tok, ntok, key, &v) || v > 0xFFFFFFFFull)
        return -1;
    *out = (unsigned int)v;
    return 0;
}

/* Parse ``text`` into ``st`` (whose identity part is filled): per-GPU dynamic fields.
 * Returns 0, or -1 for a malformed file (then ``st`` is unspecified). */
static int parse_state(char *text, struct state *st) {
    int have_format = 0;
    for (int i = 0; i < st->ngpus; i++) {
        struct gpu *g = &st->gpus[i];
        g->seen = 0;
        g->nmig = 0;
        g->nprof = 0;
    }
    st->driver[0] = 0;
    st->cuda = 0;
    int lineno = 0;
    for (char *save = NULL, *line = strtok_r(text, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash)
            *hash = 0;
        char *tok[32];
        int ntok = 0;
        for (char *s2 = NULL, *t = strtok_r(line, " \t\r", &s2); t && ntok < 32;
             t = strtok_r(NULL, " \t\r", &s2))
            tok[ntok++] = t;
        if (ntok == 0)
            continue;
        if (!have_format) {
            if (ntok != 2 || strcmp(tok[0], "format") != 0 || strcmp(tok[1], "1") != 0) {
                logf_("state file line %d: expected 'format 1'", lineno);
                return -1;
            }
            have_format = 1;
            continue;
        }
        if (strcmp(tok[0], "driver") == 0 && ntok == 2) {
            snprintf(st->driver, sizeof st->driver, "%s", tok[1]);
        } else if (strcmp(tok[0], "cuda") == 0 && ntok == 2) {
            char *end;
            long v = strtol(tok[1], &end, 10);
            if (*end || v <= 0 || v > 1000000)
                goto bad;
            st->cuda = (int)v;
        } else if (strcmp(tok[0], "gpu") == 0 || strcmp(tok[0], "profile") == 0 ||
                   strcmp(tok[0], "mig") == 0) {
            if (ntok < 2)
                goto bad;
            struct gpu *g = gpu_by_bdf(st, tok[1]);
            if (!g)
                continue; /* a GPU not enumerated at init (plugged later): ignored */
            if (tok[0][0] == 'g') {
                const char *cc = field(tok, ntok, "cc"), *state = field(tok, ntok, "state");
                unsigned int migcap, mig;
                if (num(tok, ntok, "memory", &g->memory) || !cc || !state ||
                    num32(tok, ntok, "arch", &g->arch) || num32(tok, ntok, "brand", &g->brand) ||
                    num32(tok, ntok, "sm", &g->sm) || num32(tok, ntok, "mig-capable", &migcap) ||
                    num32(tok, ntok, "mig", &mig) || num32(tok, ntok, "xid", &g->xid))
                    goto bad;
                char tail;
                if (sscanf(cc, "%d.%d%c", &g->cc_major, &g->cc_minor, &tail) != 2 ||
                    g->cc_major < 0 || g->cc_minor < 0)
                    goto bad;
                if (strcmp(state, "ok") == 0)
                    g->lost = 0;
                else if (strcmp(state, "lost") == 0)
                    g->lost = 1;
                else
                    goto bad;
                g->mig_capable = migcap != 0;
                g->mig_mode = mig != 0;
                g->seen = 1;
            } else if (tok[0][0] == 'p') {
                if (g->nprof >= MAX_PROFILES)
                    goto bad;
                struct profile *p = &g->profs[g->nprof];
                const char *name = field(tok, ntok, "name");
                if (num32(tok, ntok, "id", &p->giprof) || num32(tok, ntok, "slices", &p->cslices) ||
                    num32(tok, ntok, "memory-slices", &p->mslices) ||
                    num(tok, ntok, "memory-mb", &p->mem_mb) || num32(tok, ntok, "count", &p->count) ||
                    num32(tok, ntok, "sm", &p->sm) || !name || p->giprof >= 64 || p->cslices == 0)
                    goto bad;
                snprintf(p->pname, sizeof p->pname, "%s", name);
                g->nprof++;
            } else {
                if (g->nmig >= MAX_MIGS)
                    goto bad;
                struct mig *m = &g->migs[g->nmig];
                const char *uuid = field(tok, ntok, "uuid"), *name = field(tok, ntok, "name");
                if (num32(tok, ntok, "gi", &m->gi) || num32(tok, ntok, "ci", &m->ci) ||
                    num32(tok, ntok, "profile", &m->giprof) ||
                    num32(tok, ntok, "ci-profile", &m->ciprof) ||
                    num32(tok, ntok, "start", &m->start) || num32(tok, ntok, "size", &m->size) ||
                    num32(tok, ntok, "slices", &m->cslices) ||
                    num(tok, ntok, "memory-mb", &m->mem_mb) || num32(tok, ntok, "sm", &m->sm) ||
                    !uuid || !name)
                    goto bad;
                snprintf(m->uuid, sizeof m->uuid, "%s", uuid);
                snprintf(m->pname, sizeof m->pname, "%s", name);
                g->nmig++;
            }
        }
        /* any other record: a later format's addition, ignored */
        continue;
    bad:
        logf_("state file line %d: malformed '%s' record", lineno, tok[0]);
        return -1;
    }
    if (!have_format || !st->driver[0] || !st->cuda) {
        logf_("state file: 'format 1', 'driver' and 'cuda' are required");
        return -1;
    }
    /* a GPU the state file no longer lists is gone */
    for (int i = 0; i < st->ngpus; i++)
        if (!st->gpus[i].seen) {
            st->gpus[i].lost = 1;
            st->gpus[i].xid = XID_FALLEN_OFF_BUS;
        }
    return 0;
}

static char *read_state_text(int *why) {
    char p[4096];
    if (path_of(p, sizeof p, "/proc/driver/nvidia/hwsandbox/nvml")) {
        *why = SL_MISSING;
        return NULL;
    }
    return slurp(p, STATE_MAX, why);
}

/* Re-read the state file if the last read is older than the refresh interval (or
 * ``force``). A missing, malformed or refused (no regular file) one keeps the last good
 * state. Lock held: slurp never blocks. */
static struct state g_scratch;
static void refresh_locked(int force) {
    if (!force && g_refresh_ms > 0 && ms_since(&g_last_refresh) < g_refresh_ms)
        return;
    int why;
    char *text = read_state_text(&why);
    clock_gettime(CLOCK_MONOTONIC, &g_last_refresh);
    if (!text) {
        logf_("state file %s; keeping the last state", slurp_why(why));
        return;
    }
    memcpy(&g_scratch, &g_st, sizeof g_st);
    if (parse_state(text, &g_scratch) == 0)
        memcpy(&g_st, &g_scratch, sizeof g_st);
    free(text);
}

/* ---- init / shutdown ------------------------------------------------------------------ */

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static nvmlReturn_t do_init(void) {
    pthread_once(&g_log_once, log_init);
    pthread_mutex_lock(&g_lock);
    if (g_refs > 0) {
        g_refs++;
        pthread_mutex_unlock(&g_lock);
        return R_SUCCESS;
    }
    const char *root = getenv("HWSANDBOX_NVML_ROOT");
    snprintf(g_root, sizeof g_root, "%s", root && *root ? root : "/");
    const char *ms = getenv("HWSANDBOX_NVML_REFRESH_MS");
    g_refresh_ms = ms && *ms ? atol(ms) : DEFAULT_REFRESH_MS;
    if (g_refresh_ms < 0)
        g_refresh_ms = 0;

    char p[4096];
    nvmlReturn_t ret = R_SUCCESS;
    char *text = NULL;
    DIR *d = NULL;
    if (path_of(p, sizeof p, "/proc/driver/nvidia/gpus") || !(d = opendir(p))) {
        logf_("init: %s missing: no NVIDIA driver in this tree", p);
        ret = R_DRIVER_NOT_LOADED;
        goto out;
    }
    char *names[MAX_GPUS];
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.' || n >= MAX_GPUS)
            continue;
        names[n] = strdup(e->d_name);
        if (names[n])
            n++;
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof names[0], cmp_str);
    memset(&g_scratch, 0, sizeof g_scratch);
    for (int i = 0; i < n; i++) {
        if (load_identity(&g_scratch.gpus[g_scratch.ngpus], names[i]) == 0)
            g_scratch.ngpus++;
        else
            logf_("init: skipping %s: no readable information file", names[i]);
        free(names[i]);
    }
    qsort(g_scratch.gpus, (size_t)g_scratch.ngpus, sizeof g_scratch.gpus[0], cmp_gpu);
    int why;
    text = read_state_text(&why);
    if (!text) {
        /* missing (or unreadable): no driver; there but no regular file (a FIFO, a device,
         * a link): as a malformed one */
        logf_("init: state file %s/proc/driver/nvidia/hwsandbox/nvml: %s", g_root,
              slurp_why(why));
        ret = why == SL_REFUSED ? R_UNKNOWN : R_DRIVER_NOT_LOADED;
        goto out;
    }
    if (parse_state(text, &g_scratch) != 0) {
        ret = R_UNKNOWN;
        goto out;
    }
    memcpy(&g_st, &g_scratch, sizeof g_st);
    clock_gettime(CLOCK_MONOTONIC, &g_last_refresh);
    for (int i = 0; i < MAX_GPUS; i++)
        for (int j = 0; j < MAX_MIGS; j++) {
            g_gi[i][j] = (struct gi_handle){i, j};
            g_ci[i][j] = (struct ci_handle){i, j};
        }
    memset(g_sets, 0, sizeof g_sets);
    g_generation++;
    g_refs = 1;
out:
    free(text);
    pthread_mutex_unlock(&g_lock);
    return ret;
}

API nvmlReturn_t nvmlInit_v2(void) { return do_init(); }
API nvmlReturn_t nvmlInit(void) { return do_init(); }
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return do_init();
}

static void stop_poller_locked(void);

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

#define ENTER()                                                                          \
    pthread_mutex_lock(&g_lock);                                                         \
    if (g_refs == 0) {                                                                   \
        pthread_mutex_unlock(&g_lock);                                                   \
        return R_UNINITIALIZED;                                                          \
    }
#define LEAVE(r)                                                                         \
    do {                                                                                 \
        nvmlReturn_t r_ = (r);                                                           \
        pthread_mutex_unlock(&g_lock);                                                   \
        return r_;                                                                       \
    } while (0)

static int index_in(const void *h, const void *base, size_t size, int count) {
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
        int j = index_in(h, g->migs, sizeof g->migs[0], g->nmig);
        if (j >= 0) {
            *parent = g;
            return &g->migs[j];
        }
    }
    return NULL;
}

/* A full GPU or a MIG device; exactly one of *g (full) or *m (MIG, *g its parent). */
static nvmlReturn_t resolve(void *h, struct gpu **g, struct mig **m) {
    *m = NULL;
    *g = as_gpu(h);
    if (!*g)
        *m = as_mig(h, g);
    if (!*g)
        return R_INVALID_ARGUMENT;
    refresh_locked(0);
    return (*g)->lost ? R_GPU_IS_LOST : R_SUCCESS;
}

/* Like resolve, for identity read at init (UUID, name, PCI, minor, index): answered from
 * the cached identity even after the GPU is lost, so an Xid 79 event can be attributed. */
static nvmlReturn_t resolve_identity(void *h, struct gpu **g, struct mig **m) {
    nvmlReturn_t r = resolve(h, g, m);
    return r == R_GPU_IS_LOST ? R_SUCCESS : r;
}

static nvmlReturn_t full_gpu(void *h, struct gpu **g) {
    struct mig *m;
    nvmlReturn_t r = resolve(h, g, &m);
    if (r == R_SUCCESS && m)
        return R_NOT_SUPPORTED;
    return r;
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

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

/* ---- enumeration ---------------------------------------------------------------------- */

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER();
    if (!count)
        LEAVE(R_INVALID_ARGUMENT);
    *count = (unsigned int)g_st.ngpus;
    LEAVE(R_SUCCESS);
}
API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
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
API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, void **device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, void **device) {
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
        for (int j = 0; j < g->nmig; j++)
            if (strncmp(g->migs[j].uuid, uuid, UUID_LEN) == 0) {
                if (g->lost)
                    LEAVE(R_GPU_IS_LOST);
                *device = &g->migs[j];
                LEAVE(R_SUCCESS);
            }
    }
    LEAVE(R_NOT_FOUND);
}

API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *busid, void **device) {
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
API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *busid, void **device) {
    return nvmlDeviceGetHandleByPciBusId_v2(busid, device);
}

/* ---- identity ------------------------------------------------------------------------- */

API nvmlReturn_t nvmlDeviceGetUUID(void *device, char *uuid, unsigned int length) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve_identity(device, &g, &m);
    if (r)
        LEAVE(r);
    LEAVE(copy_str(uuid, length, m ? m->uuid : g->uuid));
}

API nvmlReturn_t nvmlDeviceGetName(void *device, char *name, unsigned int length) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve_identity(device, &g, &m);
    if (r)
        LEAVE(r);
    if (!m)
        LEAVE(copy_str(name, length, g->name));
    char full[NAME_LEN + 64];
    snprintf(full, sizeof full, "%s MIG %s", g->name, m->pname);
    LEAVE(copy_str(name, length, full));
}

API nvmlReturn_t nvmlDeviceGetBrand(void *device, int *brand) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve(device, &g, &m);
    if (r)
        LEAVE(r);
    if (!brand)
        LEAVE(R_INVALID_ARGUMENT);
    *brand = (int)g->brand;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetIndex(void *device, unsigned int *index) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve_identity(device, &g, &m);
    if (!r && m)
        r = R_NOT_SUPPORTED;
    if (r)
        LEAVE(r);
    if (!index)
        LEAVE(R_INVALID_ARGUMENT);
    *index = (unsigned int)(g - g_st.gpus);
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMinorNumber(void *device, unsigned int *minor) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve_identity(device, &g, &m);
    if (!r && m)
        r = R_NOT_SUPPORTED;
    if (r)
        LEAVE(r);
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

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(void *device, pci_info_t *pci) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve_identity(device, &g, &m);
    if (r)
        LEAVE(r);
    if (!pci)
        LEAVE(R_INVALID_ARGUMENT);
    fill_pci(g, pci);
    LEAVE(R_SUCCESS);
}
API nvmlReturn_t nvmlDeviceGetPciInfo_v2(void *device, pci_info_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

API nvmlReturn_t nvmlDeviceGetNumaNodeId(void *device, unsigned int *node) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve_identity(device, &g, &m);
    if (r)
        LEAVE(r);
    if (!node)
        LEAVE(R_INVALID_ARGUMENT);
    if (g->numa < 0)
        LEAVE(R_NOT_SUPPORTED);
    *node = (unsigned int)g->numa;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(void *d1, void *d2, int *level) {
    ENTER();
    struct gpu *a, *b;
    nvmlReturn_t r = full_gpu(d1, &a);
    if (!r)
        r = full_gpu(d2, &b);
    if (r)
        LEAVE(r);
    if (!level)
        LEAVE(R_INVALID_ARGUMENT);
    /* each GPU sits on its own root port: same GPU, same NUMA node, or across sockets */
    *level = a == b ? TOPO_INTERNAL : (a->numa == b->numa ? TOPO_NODE : TOPO_SYSTEM);
    LEAVE(R_SUCCESS);
}

/* No NVLink and no GPU fabric in the sandbox: what NVML says for PCIe GPUs. Explicit (not
 * stubs) so NVIDIA's plugin (NVLink state, for its preferred allocation) and
 * gpu-feature-discovery (fabric info, for IMEX labels) leave no "unimplemented" lines. */
API nvmlReturn_t nvmlDeviceGetNvLinkState(void *device, unsigned int link, int *active) {
    ENTER();
    struct gpu *g;
    nvmlReturn_t r = full_gpu(device, &g);
    (void)link;
    if (r)
        LEAVE(r);
    LEAVE(active ? R_NOT_SUPPORTED : R_INVALID_ARGUMENT);
}

API nvmlReturn_t nvmlDeviceGetGpuFabricInfo(void *device, void *info) {
    ENTER();
    struct gpu *g;
    nvmlReturn_t r = full_gpu(device, &g);
    if (r)
        LEAVE(r);
    LEAVE(info ? R_NOT_SUPPORTED : R_INVALID_ARGUMENT);
}

API nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(void *device, void *info) {
    return nvmlDeviceGetGpuFabricInfo(device, info);
}

/* ---- memory, compute ------------------------------------------------------------------ */

API nvmlReturn_t nvmlDeviceGetMemoryInfo(void *device, memory_t *mem) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve(device, &g, &m);
    if (r)
        LEAVE(r);
    if (!mem)
        LEAVE(R_INVALID_ARGUMENT);
    mem->total = m ? m->mem_mb << 20 : g->memory;
    mem->used = 0;
    mem->free = mem->total;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(void *device, memory_v2_t *mem) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve(device, &g, &m);
    if (r)
        LEAVE(r);
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

API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(void *device, int *major, int *minor) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve(device, &g, &m);
    if (r)
        LEAVE(r);
    if (!major || !minor)
        LEAVE(R_INVALID_ARGUMENT);
    *major = g->cc_major;
    *minor = g->cc_minor;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetArchitecture(void *device, unsigned int *arch) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve(device, &g, &m);
    if (r)
        LEAVE(r);
    if (!arch)
        LEAVE(R_INVALID_ARGUMENT);
    *arch = g->arch;
    LEAVE(R_SUCCESS);
}

/* ---- MIG ------------------------------------------------------------------------------ */

API nvmlReturn_t nvmlDeviceGetMigMode(void *device, unsigned int *current, unsigned int *pending) {
    ENTER();
    struct gpu *g;
    nvmlReturn_t r = full_gpu(device, &g);
    if (r)
        LEAVE(r);
    if (!current || !pending)
        LEAVE(R_INVALID_ARGUMENT);
    if (!g->mig_capable)
        LEAVE(R_NOT_SUPPORTED);
    *current = *pending = (unsigned int)g->mig_mode;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(void *device, unsigned int *is_mig) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve(device, &g, &m);
    if (r)
        LEAVE(r);
    if (!is_mig)
        LEAVE(R_INVALID_ARGUMENT);
    *is_mig = m != NULL;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(void *device, unsigned int *count) {
    ENTER();
    struct gpu *g;
    nvmlReturn_t r = full_gpu(device, &g);
    if (r)
        LEAVE(r);
    if (!count)
        LEAVE(R_INVALID_ARGUMENT);
    if (!g->mig_capable)
        LEAVE(R_NOT_SUPPORTED);
    *count = MAX_MIGS - 1; /* seven compute slices on every MIG-capable model */
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(void *device, unsigned int index, void **mig) {
    ENTER();
    struct gpu *g;
    nvmlReturn_t r = full_gpu(device, &g);
    if (r)
        LEAVE(r);
    if (!mig)
        LEAVE(R_INVALID_ARGUMENT);
    if (!g->mig_capable)
        LEAVE(R_NOT_SUPPORTED);
    if (!g->mig_mode || index >= (unsigned int)g->nmig)
        LEAVE(R_NOT_FOUND);
    *mig = &g->migs[index];
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(void *mig, void **device) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve(mig, &g, &m);
    if (r)
        LEAVE(r);
    if (!device || !m)
        LEAVE(R_INVALID_ARGUMENT);
    *device = g;
    LEAVE(R_SUCCESS);
}

static nvmlReturn_t mig_only(void *device, struct gpu **g, struct mig **m) {
    nvmlReturn_t r = resolve(device, g, m);
    if (r == R_SUCCESS && !*m)
        return R_INVALID_ARGUMENT;
    return r;
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceId(void *device, unsigned int *id) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = mig_only(device, &g, &m);
    if (r)
        LEAVE(r);
    if (!id)
        LEAVE(R_INVALID_ARGUMENT);
    *id = m->gi;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetComputeInstanceId(void *device, unsigned int *id) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = mig_only(device, &g, &m);
    if (r)
        LEAVE(r);
    if (!id)
        LEAVE(R_INVALID_ARGUMENT);
    *id = m->ci;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetAttributes_v2(void *device, attributes_t *a) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve(device, &g, &m);
    if (r)
        LEAVE(r);
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
API nvmlReturn_t nvmlDeviceGetAttributes(void *device, attributes_t *a) {
    return nvmlDeviceGetAttributes_v2(device, a);
}

static struct profile *find_profile(struct gpu *g, unsigned int id) {
    for (int i = 0; i < g->nprof; i++)
        if (g->profs[i].giprof == id)
            return &g->profs[i];
    return NULL;
}

static nvmlReturn_t gi_profile(void *device, unsigned int id, struct gpu **g, struct profile **p) {
    nvmlReturn_t r = full_gpu(device, g);
    if (r)
        return r;
    if (!(*g)->mig_capable)
        return R_NOT_SUPPORTED;
    if (id >= 18)
        return R_INVALID_ARGUMENT;
    *p = find_profile(*g, id);
    return *p ? R_SUCCESS : R_NOT_SUPPORTED;
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(void *device, unsigned int id,
                                                     gi_profile_v1_t *info) {
    ENTER();
    struct gpu *g;
    struct profile *p;
    nvmlReturn_t r = gi_profile(device, id, &g, &p);
    if (r)
        LEAVE(r);
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

API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(void *device, unsigned int id, void *info) {
    ENTER();
    struct gpu *g;
    struct profile *p;
    nvmlReturn_t r = gi_profile(device, id, &g, &p);
    if (r)
        LEAVE(r);
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

API nvmlReturn_t nvmlDeviceGetGpuInstanceById(void *device, unsigned int id, void **gi) {
    ENTER();
    struct gpu *g;
    nvmlReturn_t r = full_gpu(device, &g);
    if (r)
        LEAVE(r);
    if (!gi)
        LEAVE(R_INVALID_ARGUMENT);
    if (!g->mig_capable)
        LEAVE(R_NOT_SUPPORTED);
    for (int j = 0; j < g->nmig; j++)
        if (g->migs[j].gi == id) {
            *gi = &g_gi[g - g_st.gpus][j];
            LEAVE(R_SUCCESS);
        }
    LEAVE(R_NOT_FOUND);
}

API nvmlReturn_t nvmlDeviceGetGpuInstances(void *device, unsigned int profile, void **gis,
                                           unsigned int *count) {
    ENTER();
    struct gpu *g;
    nvmlReturn_t r = full_gpu(device, &g);
    if (r)
        LEAVE(r);
    if (!count)
        LEAVE(R_INVALID_ARGUMENT);
    if (!g->mig_capable)
        LEAVE(R_NOT_SUPPORTED);
    unsigned int n = 0;
    for (int j = 0; j < g->nmig; j++)
        if (g->migs[j].giprof == profile) {
            if (gis && n < *count)
                gis[n] = &g_gi[g - g_st.gpus][j];
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

/* a GPU instance handle -> (gpu, mig) */
static nvmlReturn_t as_gi(void *h, struct gpu **g, struct mig **m) {
    int k = index_in(h, g_gi, sizeof g_gi[0][0], MAX_GPUS * MAX_MIGS);
    if (k < 0)
        return R_INVALID_ARGUMENT;
    int i = k / MAX_MIGS, j = k % MAX_MIGS;
    if (i >= g_st.ngpus || j >= g_st.gpus[i].nmig)
        return R_INVALID_ARGUMENT;
    *g = &g_st.gpus[i];
    *m = &(*g)->migs[j];
    refresh_locked(0);
    return (*g)->lost ? R_GPU_IS_LOST : R_SUCCESS;
}

static nvmlReturn_t as_ci(void *h, struct gpu **g, struct mig **m) {
    int k = index_in(h, g_ci, sizeof g_ci[0][0], MAX_GPUS * MAX_MIGS);
    if (k < 0)
        return R_INVALID_ARGUMENT;
    int i = k / MAX_MIGS, j = k % MAX_MIGS;
    if (i >= g_st.ngpus || j >= g_st.gpus[i].nmig)
        return R_INVALID_ARGUMENT;
    *g = &g_st.gpus[i];
    *m = &(*g)->migs[j];
    refresh_locked(0);
    return (*g)->lost ? R_GPU_IS_LOST : R_SUCCESS;
}

API nvmlReturn_t nvmlGpuInstanceGetInfo(void *gi, gi_info_t *info) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = as_gi(gi, &g, &m);
    if (r)
        LEAVE(r);
    if (!info)
        LEAVE(R_INVALID_ARGUMENT);
    info->device = g;
    info->id = m->gi;
    info->profileId = m->giprof;
    info->placement.start = m->start;
    info->placement.size = m->size;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(void *gi, unsigned int id, void **ci) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = as_gi(gi, &g, &m);
    if (r)
        LEAVE(r);
    if (!ci)
        LEAVE(R_INVALID_ARGUMENT);
    if (m->ci != id)
        LEAVE(R_NOT_FOUND);
    *ci = &g_ci[g - g_st.gpus][m - g->migs];
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstances(void *gi, unsigned int profile, void **cis,
                                                    unsigned int *count) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = as_gi(gi, &g, &m);
    if (r)
        LEAVE(r);
    if (!count)
        LEAVE(R_INVALID_ARGUMENT);
    unsigned int n = m->ciprof == profile;
    if (n && cis && *count >= 1)
        cis[0] = &g_ci[g - g_st.gpus][m - g->migs];
    nvmlReturn_t out = n > *count ? R_INSUFFICIENT_SIZE : R_SUCCESS;
    *count = n;
    LEAVE(out);
}

static void fill_ci(struct gpu *g, struct mig *m, ci_info_t *info) {
    info->device = g;
    info->gpuInstance = &g_gi[g - g_st.gpus][m - g->migs];
    info->id = m->ci;
    info->profileId = m->ciprof;
    info->placement.start = 0;
    info->placement.size = m->cslices;
}

API nvmlReturn_t nvmlComputeInstanceGetInfo_v2(void *ci, ci_info_t *info) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = as_ci(ci, &g, &m);
    if (r)
        LEAVE(r);
    if (!info)
        LEAVE(R_INVALID_ARGUMENT);
    fill_ci(g, m, info);
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlComputeInstanceGetInfo(void *ci, ci_info_v1_t *info) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = as_ci(ci, &g, &m);
    if (r)
        LEAVE(r);
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

static nvmlReturn_t ci_profile(void *gi, unsigned int id, unsigned int eng, struct gpu **g,
                               struct mig **m) {
    nvmlReturn_t r = as_gi(gi, g, m);
    if (r)
        return r;
    if (id >= 9 || eng >= 1)
        return R_INVALID_ARGUMENT;
    /* each of our GPU instances holds one compute instance spanning all its slices */
    if (ci_profile_slices(id) != (int)(*m)->cslices)
        return R_NOT_SUPPORTED;
    return R_SUCCESS;
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(void *gi, unsigned int id,
                                                              unsigned int eng,
                                                              ci_profile_v1_t *info) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = ci_profile(gi, id, eng, &g, &m);
    if (r)
        LEAVE(r);
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

API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(void *gi, unsigned int id,
                                                               unsigned int eng, void *info) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = ci_profile(gi, id, eng, &g, &m);
    if (r)
        LEAVE(r);
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

/* ---- events ---------------------------------------------------------------------------
 *
 * A fault is a change of a GPU's Xid in the state file. While any event set has a GPU
 * registered, a poller thread re-reads the state every HWSANDBOX_NVML_REFRESH_MS (10 ms
 * when 0) and queues each change to a non-zero Xid in every set that registered that GPU,
 * so a fault is kept until waited for (like the driver's event queue) even if the GPU
 * recovers meanwhile. nvmlEventSetWait also polls itself. nvmlShutdown to zero stops and
 * joins the poller, so no thread runs in this library when a caller dlcloses it. */

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
static void stop_poller_locked(void) {
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

API nvmlReturn_t nvmlEventSetCreate(void **set) {
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

API nvmlReturn_t nvmlEventSetFree(void *set) {
    ENTER();
    struct event_set *s = as_set(set);
    if (!s)
        LEAVE(R_INVALID_ARGUMENT);
    s->used = 0;
    pthread_cond_broadcast(&g_cond); /* a waiter on it returns */
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(void *device, u64 *types) {
    ENTER();
    struct gpu *g;
    struct mig *m;
    nvmlReturn_t r = resolve(device, &g, &m);
    if (r)
        LEAVE(r);
    if (!types)
        LEAVE(R_INVALID_ARGUMENT);
    *types = EV_SUPPORTED;
    LEAVE(R_SUCCESS);
}

API nvmlReturn_t nvmlDeviceRegisterEvents(void *device, u64 types, void *set) {
    ENTER();
    struct gpu *g;
    nvmlReturn_t r = full_gpu(device, &g);
    if (r)
        LEAVE(r);
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

API nvmlReturn_t nvmlEventSetWait_v2(void *set, event_data_t *data, unsigned int timeout_ms) {
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

API nvmlReturn_t nvmlEventSetWait(void *set, event_data_v1_t *data, unsigned int timeout_ms) {
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
