/*
 * The HWSANDBOX_NVML_LOG log: one line per call this library does not implement (every
 * stub calls hwsandbox_nvml_unimplemented) and per state-file problem. Lines are logged
 * with the library's lock held, so none ever waits on the log's stream.
 */
#include "nvml_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

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

void logf_(const char *fmt, ...) {
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

void log_open(void) { pthread_once(&g_log_once, log_init); }

/* called by every stub (generated from entrypoints.txt) */
nvmlReturn_t hwsandbox_nvml_unimplemented(const char *name) {
    log_open();
    logf_("unimplemented: %s", name);
    return R_NOT_SUPPORTED;
}
