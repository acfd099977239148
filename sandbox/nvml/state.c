/*
 * The contract with the tree: what this library reads from the files a sandbox node's tree
 * serves (docs/nvml.md, "What it reads"), into ``struct state``.
 *
 *   identity  <root>/proc/driver/nvidia/gpus/<bdf>/information (UUID, name, minor)
 *             <root>/sys/bus/pci/devices/<bdf>/{vendor,device,subsystem_*,numa_node}
 *   the rest  <root>/proc/driver/nvidia/hwsandbox/nvml (the state file, format 1)
 *
 * Every read is a slurp: regular files only, never waiting (the lock is held).
 */
#include "nvml_internal.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

long g_refresh_ms = DEFAULT_REFRESH_MS;
static char g_root[4096] = "/";
static struct timespec g_last_refresh;
static struct state g_scratch; /* a state being read: too big for the stack */

long ms_since(const struct timespec *t) {
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

int parse_bdf(const char *s, unsigned int *dom, unsigned int *bus, unsigned int *dev,
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
        memset(g->migs, 0, sizeof g->migs);
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
                   strcmp(tok[0], "mig") == 0 || strcmp(tok[0], "gpu-instance") == 0) {
            if (ntok < 2)
                goto bad;
            struct gpu *g = gpu_by_bdf(st, tok[1]);
            if (!g)
                continue; /* a GPU not enumerated at init (plugged later): ignored */
            if (strcmp(tok[0], "gpu") == 0) {
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
                snprintf(g->devid, sizeof g->devid, "%s", field(tok, ntok, "id") ?: "");
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
                /* "mig": a GPU instance with its compute instance (a MIG device);
                 * "gpu-instance": one without (docs/nvml.md). In the slot of its id. */
                int has_ci = tok[0][0] == 'm';
                unsigned int gi;
                if (num32(tok, ntok, "gi", &gi) || gi == 0 || gi >= MAX_GI ||
                    g->migs[gi].present || (has_ci && g->nmig >= MAX_MIGS))
                    goto bad;
                struct mig *m = &g->migs[gi];
                *m = (struct mig){.gi = gi};
                const char *uuid = field(tok, ntok, "uuid"), *name = field(tok, ntok, "name");
                if ((has_ci && num32(tok, ntok, "ci", &m->ci)) ||
                    num32(tok, ntok, "profile", &m->giprof) ||
                    num32(tok, ntok, "ci-profile", &m->ciprof) ||
                    num32(tok, ntok, "start", &m->start) || num32(tok, ntok, "size", &m->size) ||
                    num32(tok, ntok, "slices", &m->cslices) ||
                    num(tok, ntok, "memory-mb", &m->mem_mb) || num32(tok, ntok, "sm", &m->sm) ||
                    !uuid || !name)
                    goto bad;
                snprintf(m->uuid, sizeof m->uuid, "%s", uuid);
                snprintf(m->pname, sizeof m->pname, "%s", name);
                m->present = 1, m->has_ci = has_ci;
                if (has_ci)
                    g->order[g->nmig++] = (int)gi;
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
void refresh_locked(int force) {
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

/* ---- the first read ------------------------------------------------------------------- */

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The first nvmlInit's read of the whole tree: every GPU's identity, then the state file,
 * into g_st. R_DRIVER_NOT_LOADED without the driver's directory or the state file, R_UNKNOWN
 * for a malformed (or refused) state file; g_st is untouched then. */
nvmlReturn_t load_tree_locked(void) {
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
out:
    free(text);
    return ret;
}
