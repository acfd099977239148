/* Threaded stress driver for our NVML (sandbox/nvml), built by tests/test_nvml.py
 * together with the library under -fsanitize=address,undefined and -fsanitize=thread:
 * 8 threads x ROUNDS (argv[1], default 300) rounds of nested init, handle, UUID, memory, event registration, a
 * short wait, event set free and shutdown (which starts and joins the event poller). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

int nvmlInit_v2(void);
int nvmlShutdown(void);
int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device);
int nvmlDeviceGetUUID(void *device, char *uuid, unsigned int length);
int nvmlDeviceGetMemoryInfo(void *device, unsigned long long *memory);
int nvmlDeviceGetMigDeviceHandleByIndex(void *device, unsigned int index, void **mig);
int nvmlEventSetCreate(void **set);
int nvmlEventSetFree(void *set);
int nvmlDeviceRegisterEvents(void *device, unsigned long long types, void *set);
typedef struct {
    void *device;
    unsigned long long type, data;
    unsigned int gi, ci;
} event_t;
int nvmlEventSetWait_v2(void *set, event_t *event, unsigned int timeout_ms);

static int failures, rounds = 300;
static pthread_mutex_t failures_lock = PTHREAD_MUTEX_INITIALIZER;

static void fail(const char *what, int code) {
    pthread_mutex_lock(&failures_lock);
    failures++;
    fprintf(stderr, "%s: %d\n", what, code);
    pthread_mutex_unlock(&failures_lock);
}

static void *work(void *arg) {
    unsigned int seed = (unsigned int)(size_t)arg;
    for (int round = 0; round < rounds; round++) {
        int r = nvmlInit_v2();
        if (r) {
            fail("nvmlInit_v2", r);
            continue;
        }
        void *set, *dev, *mig;
        char uuid[96];
        unsigned long long memory[3];
        event_t event;
        if (nvmlEventSetCreate(&set) == 0) {
            for (unsigned int i = 0; i < rand_r(&seed) % 5; i++) {
                if (nvmlDeviceGetHandleByIndex_v2(i, &dev) != 0)
                    continue;
                if ((r = nvmlDeviceGetUUID(dev, uuid, sizeof uuid)) != 0)
                    fail("nvmlDeviceGetUUID", r);
                nvmlDeviceGetMemoryInfo(dev, memory);
                if (nvmlDeviceGetMigDeviceHandleByIndex(dev, rand_r(&seed) % 4, &mig) == 0)
                    nvmlDeviceGetMemoryInfo(mig, memory);
                nvmlDeviceRegisterEvents(dev, 8, set);
            }
            r = nvmlEventSetWait_v2(set, &event, rand_r(&seed) % 3);
            if (r != 0 && r != 10)
                fail("nvmlEventSetWait_v2", r);
            nvmlEventSetFree(set);
        }
        if ((r = nvmlShutdown()) != 0)
            fail("nvmlShutdown", r);
    }
    return NULL;
}

int main(int argc, char **argv) {
    pthread_t threads[8];
    if (argc > 1)
        rounds = atoi(argv[1]);
    for (size_t i = 0; i < 8; i++)
        pthread_create(&threads[i], NULL, work, (void *)i);
    for (int i = 0; i < 8; i++)
        pthread_join(threads[i], NULL);
    printf("failures %d\n", failures);
    return failures != 0;
}
