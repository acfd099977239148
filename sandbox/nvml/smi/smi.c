/*
 * nvidia-smi for hw-sandbox: the subset of NVIDIA's command-line tool that programs run and
 * people type (docs/nvml.md, "nvidia-smi"), answering from NVML only, so from whatever
 * libnvidia-ml.so.1 is loaded (ours: the node's live tree). Written for hw-sandbox; no
 * NVIDIA code or text is used. The output shapes of -L and --query-gpu CSV are the ones
 * scripts parse; -q and the MIG tables are our own layout.
 *
 *   nvidia-smi -L                           every GPU (and its MIG devices) with its UUID
 *   nvidia-smi -q                           a report per GPU
 *   nvidia-smi --query-gpu=F,F --format=csv[,noheader][,nounits]
 *   nvidia-smi -i ID ...                    only these GPUs (index, UUID or PCI bus id; a,b)
 *   nvidia-smi mig -lgi | -lci              GPU / compute instances
 *
 * Exit status: 0; 2 bad arguments; otherwise the NVML error code that stopped it (9: no
 * driver, 15: a GPU is lost), as NVIDIA's tool does.
 */
#include "smi.h"

int g_status;

void fail(const char *what, nvmlReturn_t r) {
    fprintf(stderr, "nvidia-smi: %s: %s\n", what, nvmlErrorString(r));
    g_status = r;
}

static void usage(FILE *f) {
    fputs("usage: nvidia-smi [-i ID[,ID...]] [-L | -q | --query-gpu=FIELD[,FIELD...] "
          "--format=csv[,noheader][,nounits]]\n"
          "       (no option: a table of the GPUs)\n"
          "       nvidia-smi [-i ID] mig -lgi | -lci\n"
          "hw-sandbox's nvidia-smi: answers from NVML (the node's fake tree).\n"
          "  -L, --list-gpus      one line per GPU and MIG device, with UUIDs\n"
          "  -q, --query          a report per GPU\n"
          "  --query-gpu=FIELDS   CSV of FIELDS (--help-query-gpu lists them)\n"
          "  -i, --id=ID          only GPU ID: its index, UUID or PCI bus id\n"
          "  mig -lgi / -lci      list GPU instances / compute instances\n", f);
}

/* ---- one GPU ------------------------------------------------------------------------- */


nvmlReturn_t gpu_load(unsigned int index, struct gpu *g) {
    memset(g, 0, sizeof *g);
    g->index = index;
    nvmlReturn_t r = nvmlDeviceGetHandleByIndex_v2(index, &g->h);
    if (r == R_SUCCESS)
        r = nvmlDeviceGetName(g->h, g->name, sizeof g->name);
    if (r == R_SUCCESS)
        r = nvmlDeviceGetUUID(g->h, g->uuid, sizeof g->uuid);
    if (r == R_SUCCESS)
        r = nvmlDeviceGetPciInfo_v3(g->h, &g->pci);
    return r;
}

/* GPU ``index`` into g; 0 (said on stderr, kept for the exit status) if NVML cannot */
int gpu_get(unsigned int index, struct gpu *g) {
    nvmlReturn_t r = gpu_load(index, g);
    if (r == R_SUCCESS)
        return 1;
    char what[64];
    snprintf(what, sizeof what, "GPU %u", index);
    fail(what, r);
    return 0;
}

/* the indices -i selects (all when ids is NULL); returns their number or -1 */
static int select_gpus(const char *ids, unsigned int count, unsigned int *out) {
    if (!ids) {
        for (unsigned int i = 0; i < count && i < MAX_SELECTED; i++)
            out[i] = i;
        return count < MAX_SELECTED ? (int)count : MAX_SELECTED;
    }
    int n = 0;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", ids);
    for (char *save = NULL, *id = strtok_r(buf, ",", &save); id; id = strtok_r(NULL, ",", &save)) {
        char *end;
        unsigned long i = strtoul(id, &end, 10);
        nvml_device_t h;
        nvmlReturn_t r;
        if (*id && !*end) {
            if (i >= count) {
                fprintf(stderr, "nvidia-smi: no GPU with index %s (%u GPUs)\n", id, count);
                return -1;
            }
        } else {
            r = strncmp(id, "GPU-", 4) == 0 || strncmp(id, "MIG-", 4) == 0
                    ? nvmlDeviceGetHandleByUUID(id, &h)
                    : nvmlDeviceGetHandleByPciBusId_v2(id, &h);
            unsigned int idx;
            if (r == R_SUCCESS)
                r = nvmlDeviceGetIndex(h, &idx);
            if (r != R_SUCCESS) {
                fprintf(stderr, "nvidia-smi: no GPU %s: %s\n", id, nvmlErrorString(r));
                g_status = r == R_NOT_FOUND || r == R_INVALID_ARGUMENT ? 6 : r;
                return -1;
            }
            i = idx;
        }
        if (n < MAX_SELECTED)
            out[n++] = (unsigned int)i;
    }
    return n;
}

/* ---- -L ---------------------------------------------------------------------------------- */

static void list_gpus(const unsigned int *sel, int n) {
    for (int k = 0; k < n; k++) {
        struct gpu g;
        if (!gpu_get(sel[k], &g))
            continue;
        printf("GPU %u: %s (UUID: %s)\n", g.index, g.name, g.uuid);
        unsigned int max = 0;
        if (nvmlDeviceGetMaxMigDeviceCount(g.h, &max) != R_SUCCESS)
            continue;
        for (unsigned int j = 0; j < max; j++) {
            nvml_device_t m;
            char name[96], uuid[96];
            if (nvmlDeviceGetMigDeviceHandleByIndex(g.h, j, &m) != R_SUCCESS)
                break;
            if (nvmlDeviceGetName(m, name, sizeof name) != R_SUCCESS ||
                nvmlDeviceGetUUID(m, uuid, sizeof uuid) != R_SUCCESS)
                continue;
            const char *profile = strstr(name, " MIG ");
            printf("  MIG %-12s Device %2u: (UUID: %s)\n", profile ? profile + 5 : name, j, uuid);
        }
    }
}

/* ---- no arguments: a table ----------------------------------------------------------------- */

static void rule(void) {
    puts("+-----+-----------------------------------+------------------+----------------------+"
         "------+----------+");
}

static void summary(const unsigned int *sel, int n) {
    char driver[80] = "";
    int cuda = 0;
    nvmlSystemGetDriverVersion(driver, sizeof driver);
    nvmlSystemGetCudaDriverVersion(&cuda);
    printf("hw-sandbox nvidia-smi (answers from NVML)   Driver Version: %s   CUDA Version: %d.%d\n",
           driver, cuda / 1000, cuda % 1000 / 10);
    rule();
    printf("| %3s | %-33s | %-16s | %20s | %4s | %-8s |\n", "GPU", "Name", "Bus Id",
           "Memory used / total", "NUMA", "MIG");
    rule();
    int migs = 0;
    for (int k = 0; k < n; k++) {
        struct gpu g;
        if (!gpu_get(sel[k], &g))
            continue;
        char used[32], total[32], numa[16], mode[16];
        field_value(F_MEM_USED, &g, 0, 0, used, sizeof used);
        field_value(F_MEM_TOTAL, &g, 0, 0, total, sizeof total);
        field_value(F_NUMA, &g, 0, 0, numa, sizeof numa);
        field_value(F_MIG_CUR, &g, 0, 0, mode, sizeof mode);
        char memory[80];
        snprintf(memory, sizeof memory, "%s / %s MiB", used, total);
        printf("| %3u | %-33.33s | %-16s | %20s | %4s | %-8s |\n", g.index, g.name, g.pci.busId,
               memory, numa, mode);
        unsigned int cur = 0, pend = 0, max = 0;
        if (nvmlDeviceGetMigMode(g.h, &cur, &pend) == R_SUCCESS && cur &&
            nvmlDeviceGetMaxMigDeviceCount(g.h, &max) == R_SUCCESS)
            for (unsigned int j = 0; j < max; j++) {
                nvml_device_t m;
                if (nvmlDeviceGetMigDeviceHandleByIndex(g.h, j, &m) != R_SUCCESS)
                    break;
                migs++;
            }
    }
    rule();
    if (migs)
        printf("%d MIG devices: nvidia-smi -L lists them, nvidia-smi mig -lgi their instances\n",
               migs);
}

/* ---- mig -lgi / -lci ----------------------------------------------------------------------- */

static int mig_list(const char *what, const unsigned int *sel, int n) {
    int ci_table = strcmp(what, "-lci") == 0;
    if (!ci_table && strcmp(what, "-lgi") != 0) {
        fprintf(stderr, "nvidia-smi mig: this nvidia-smi lists only (-lgi, -lci), not %s\n",
                what);
        return 2;
    }
    if (ci_table)
        printf("%-5s %-6s %-12s %-8s %-6s %s\n", "GPU", "GI ID", "Name", "Profile", "CI ID",
               "Placement");
    else
        printf("%-5s %-12s %-8s %-6s %s\n", "GPU", "Name", "Profile", "GI ID",
               "Placement");
    int rows = 0;
    for (int k = 0; k < n; k++) {
        struct gpu g;
        nvmlReturn_t r = gpu_load(sel[k], &g);
        unsigned int cur = 0, pend = 0;
        if (r == R_SUCCESS)
            r = nvmlDeviceGetMigMode(g.h, &cur, &pend);
        if (r != R_SUCCESS || !cur) {
            if (r != R_SUCCESS && r != R_NOT_SUPPORTED) {
                char w[64];
                snprintf(w, sizeof w, "GPU %u", sel[k]);
                fail(w, r);
            }
            continue;
        }
        for (unsigned int p = 0; p < GI_PROFILES; p++) {
            gi_profile_v2_t info = {.version = STRUCT_VERSION(gi_profile_v2_t, 2)};
            if (nvmlDeviceGetGpuInstanceProfileInfoV(g.h, p, &info) != R_SUCCESS)
                continue;
            nvml_gpu_instance_t gis[8];
            unsigned int ngi = 8;
            if (nvmlDeviceGetGpuInstances(g.h, info.id, gis, &ngi) != R_SUCCESS)
                continue;
            const char *pname = strncmp(info.name, "MIG ", 4) == 0 ? info.name + 4 : info.name;
            for (unsigned int i = 0; i < ngi; i++) {
                gi_info_t gi;
                if (nvmlGpuInstanceGetInfo(gis[i], &gi) != R_SUCCESS)
                    continue;
                if (!ci_table) {
                    printf("%-5u %-12s %-8u %-6u %u:%u\n", g.index, pname, info.id, gi.id,
                           gi.placement.start, gi.placement.size);
                    rows++;
                    continue;
                }
                for (unsigned int c = 0; c < CI_PROFILES; c++) {
                    ci_profile_v2_t cp = {.version = STRUCT_VERSION(ci_profile_v2_t, 2)};
                    if (nvmlGpuInstanceGetComputeInstanceProfileInfoV(gis[i], c, 0, &cp) !=
                        R_SUCCESS)
                        continue;
                    nvml_compute_instance_t cis[8];
                    unsigned int nci = 8;
                    if (nvmlGpuInstanceGetComputeInstances(gis[i], cp.id, cis, &nci) != R_SUCCESS)
                        continue;
                    const char *cname = strncmp(cp.name, "MIG ", 4) == 0 ? cp.name + 4 : cp.name;
                    for (unsigned int j = 0; j < nci; j++) {
                        ci_info_t ci;
                        if (nvmlComputeInstanceGetInfo_v2(cis[j], &ci) != R_SUCCESS)
                            continue;
                        printf("%-5u %-6u %-12s %-8u %-6u %u:%u\n", g.index, gi.id, cname,
                               cp.id, ci.id, ci.placement.start, ci.placement.size);
                        rows++;
                    }
                }
            }
        }
    }
    if (rows == 0)
        fputs(ci_table ? "No compute instances found.\n" : "No GPU instances found.\n", stderr);
    return g_status;
}

/* ---- main ------------------------------------------------------------------------------ */

int main(int argc, char **argv) {
    const char *ids = NULL, *query = NULL, *format = NULL, *mig = NULL;
    int list = 0, full = 0;
    for (int k = 1; k < argc; k++) {
        const char *a = argv[k];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(a, "--help-query-gpu") == 0) {
            list_fields();
            return 0;
        } else if (strcmp(a, "-L") == 0 || strcmp(a, "--list-gpus") == 0) {
            list = 1;
        } else if (strcmp(a, "-q") == 0 || strcmp(a, "--query") == 0) {
            full = 1;
        } else if (strncmp(a, "--query-gpu=", 12) == 0) {
            query = a + 12;
        } else if (strncmp(a, "--format=", 9) == 0) {
            format = a + 9;
        } else if (strncmp(a, "--id=", 5) == 0) {
            ids = a + 5;
        } else if (strcmp(a, "-i") == 0 || strcmp(a, "--id") == 0) {
            if (++k == argc) {
                fputs("nvidia-smi: -i needs an index, UUID or PCI bus id\n", stderr);
                return 2;
            }
            ids = argv[k];
        } else if (strcmp(a, "mig") == 0 && k + 1 < argc) {
            mig = argv[++k];
        } else {
            fprintf(stderr, "nvidia-smi: unknown argument %s\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (list + full + (query != NULL) + (mig != NULL) > 1) {
        usage(stderr);
        return 2;
    }
    nvmlReturn_t r = nvmlInit_v2();
    if (r != R_SUCCESS) {
        fprintf(stderr, "nvidia-smi: NVML could not start: %s\n", nvmlErrorString(r));
        return r;
    }
    unsigned int count = 0, sel[MAX_SELECTED];
    r = nvmlDeviceGetCount_v2(&count);
    int n = r == R_SUCCESS ? select_gpus(ids, count, sel) : -1;
    int status;
    if (r != R_SUCCESS) {
        fail("counting GPUs", r);
        status = g_status;
    } else if (n < 0) {
        status = g_status ? g_status : 6;
    } else if (list) {
        list_gpus(sel, n);
        status = g_status;
    } else if (full) {
        report(sel, n, count);
        status = g_status;
    } else if (query) {
        status = query_gpu(query, format, sel, n, count);
    } else if (mig) {
        status = mig_list(mig, sel, n);
    } else {
        summary(sel, n);
        status = g_status;
    }
    nvmlShutdown();
    return status;
}
