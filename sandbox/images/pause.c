/* The pod sandbox ("pause") process of the native runtime's local pause image.
 *
 * It holds the pod's namespaces open: sleep until SIGINT/SIGTERM, then exit 0; as PID 1 of
 * the pod's PID namespace it also reaps any child that gets reparented to it. Our own
 * program, compiled at run time (gcc -static) into the cache; nothing third-party.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
    (void)sig;
    _exit(0);
}

static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    struct sigaction sa;

    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        puts("hw-sandbox pause 1");
        return 0;
    }
    if (getpid() != 1) {
        fputs("pause: warning: not PID 1\n", stderr);
    }
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = on_child;
    sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigaction(SIGCHLD, &sa, NULL);
    for (;;) {
        pause();
    }
}
