/*
 * hw-sandbox's nvidia-smi: the fields it can query (--query-gpu, --help-query-gpu) and the
 * -q report, from NVML only (smi.c has the rest).
 */
#include "smi.h"

/* ---- --query-gpu ------------------------------------------------------------------------- */


static const struct {
    const char *name, *alt, *unit, *help;
} FIELDS[F_NFIELDS] = {
    [F_INDEX] = {"index", NULL, NULL, "NVML index of the GPU"},
    [F_NAME] = {"name", "gpu_name", NULL, "product name"},
    [F_UUID] = {"uuid", "gpu_uuid", NULL, "GPU UUID"},
    [F_BUS] = {"pci.bus_id", "gpu_bus_id", NULL, "PCI bus id, domain:bus:device.function"},
    [F_DOMAIN] = {"pci.domain", NULL, NULL, "PCI domain (hex)"},
    [F_BUSNUM] = {"pci.bus", NULL, NULL, "PCI bus (hex)"},
    [F_DEVNUM] = {"pci.device", NULL, NULL, "PCI device (hex)"},
    [F_DEVICE_ID] = {"pci.device_id", NULL, NULL, "PCI device id and vendor id (hex)"},
    [F_SUB_ID] = {"pci.sub_device_id", NULL, NULL, "PCI subsystem id (hex)"},
    [F_MINOR] = {"minor_number", NULL, NULL, "N of /dev/nvidiaN"},
    [F_NUMA] = {"numa.node", NULL, NULL, "NUMA node of the GPU"},
    [F_MEM_TOTAL] = {"memory.total", NULL, "MiB", "frame buffer memory"},
    [F_MEM_USED] = {"memory.used", NULL, "MiB", "frame buffer memory in use"},
    [F_MEM_FREE] = {"memory.free", NULL, "MiB", "frame buffer memory free"},
    [F_DRIVER] = {"driver_version", NULL, NULL, "driver version"},
    [F_COUNT] = {"count", NULL, NULL, "number of GPUs"},
    [F_CC] = {"compute_cap", NULL, NULL, "CUDA compute capability, major.minor"},
    [F_MIG_CUR] = {"mig.mode.current", NULL, NULL, "MIG mode now"},
    [F_MIG_PEND] = {"mig.mode.pending", NULL, NULL, "MIG mode after the next reset"},
};

void list_fields(void) {
    for (int f = 0; f < F_NFIELDS; f++)
        printf("%-20s %s\n", FIELDS[f].name, FIELDS[f].help);
}

static int field_of(const char *s) {
    for (int f = 0; f < F_NFIELDS; f++)
        if (strcmp(s, FIELDS[f].name) == 0 || (FIELDS[f].alt && strcmp(s, FIELDS[f].alt) == 0))
            return f;
    return -1;
}

static const char *mig_word(unsigned int mode) { return mode ? "Enabled" : "Disabled"; }

/* one field's value for GPU g into out; "[N/A]" where NVML has none */
void field_value(int f, const struct gpu *g, unsigned int count, int units, char *out,
                        size_t n) {
    unsigned int u = 0, cur = 0, pend = 0;
    int major = 0, minor = 0;
    memory_t mem;
    const char *mib = units ? " MiB" : "";
    nvmlReturn_t r = R_SUCCESS;
    switch (f) {
    case F_INDEX: snprintf(out, n, "%u", g->index); return;
    case F_NAME: snprintf(out, n, "%s", g->name); return;
    case F_UUID: snprintf(out, n, "%s", g->uuid); return;
    case F_BUS: snprintf(out, n, "%s", g->pci.busId); return;
    case F_DOMAIN: snprintf(out, n, "0x%04X", g->pci.domain); return;
    case F_BUSNUM: snprintf(out, n, "0x%02X", g->pci.bus); return;
    case F_DEVNUM: snprintf(out, n, "0x%02X", g->pci.device); return;
    case F_DEVICE_ID: snprintf(out, n, "0x%08X", g->pci.pciDeviceId); return;
    case F_SUB_ID: snprintf(out, n, "0x%08X", g->pci.pciSubSystemId); return;
    case F_COUNT: snprintf(out, n, "%u", count); return;
    case F_DRIVER: r = nvmlSystemGetDriverVersion(out, (unsigned int)n); break;
    case F_MINOR: r = nvmlDeviceGetMinorNumber(g->h, &u); snprintf(out, n, "%u", u); break;
    case F_NUMA: r = nvmlDeviceGetNumaNodeId(g->h, &u); snprintf(out, n, "%u", u); break;
    case F_MEM_TOTAL: case F_MEM_USED: case F_MEM_FREE:
        r = nvmlDeviceGetMemoryInfo(g->h, &mem);
        snprintf(out, n, "%llu%s", (f == F_MEM_TOTAL ? mem.total : f == F_MEM_USED
                                    ? mem.used : mem.free) >> 20, mib);
        break;
    case F_CC:
        r = nvmlDeviceGetCudaComputeCapability(g->h, &major, &minor);
        snprintf(out, n, "%d.%d", major, minor);
        break;
    case F_MIG_CUR: case F_MIG_PEND:
        r = nvmlDeviceGetMigMode(g->h, &cur, &pend);
        snprintf(out, n, "%s", mig_word(f == F_MIG_CUR ? cur : pend));
        break;
    }
    if (r != R_SUCCESS)
        snprintf(out, n, r == R_NOT_SUPPORTED ? "[N/A]" : "[%s]", nvmlErrorString(r));
}

int query_gpu(const char *spec, const char *format, const unsigned int *sel, int n,
                     unsigned int count) {
    int fields[32], nf = 0, header = 1, units = 1;
    char buf[1024];
    if (!format) {
        fputs("nvidia-smi: --query-gpu needs --format=csv\n", stderr);
        return 2;
    }
    snprintf(buf, sizeof buf, "%s", format);
    for (char *save = NULL, *w = strtok_r(buf, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
        if (strcmp(w, "noheader") == 0)
            header = 0;
        else if (strcmp(w, "nounits") == 0)
            units = 0;
        else if (strcmp(w, "csv") != 0) {
            fprintf(stderr, "nvidia-smi: unknown --format option \"%s\" (csv, noheader, "
                            "nounits)\n", w);
            return 2;
        }
    }
    snprintf(buf, sizeof buf, "%s", spec);
    for (char *save = NULL, *w = strtok_r(buf, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
        while (*w == ' ')
            w++;
        int f = field_of(w);
        if (f < 0) {
            fprintf(stderr, "nvidia-smi: \"%s\" is not a field this nvidia-smi can query "
                            "(--help-query-gpu lists them)\n", w);
            return 2;
        }
        if (nf < 32)
            fields[nf++] = f;
    }
    if (header) {
        for (int k = 0; k < nf; k++) {
            const char *unit = units ? FIELDS[fields[k]].unit : NULL;
            printf("%s%s%s%s%s", k ? ", " : "", FIELDS[fields[k]].name, unit ? " [" : "",
                   unit ? unit : "", unit ? "]" : "");
        }
        putchar('\n');
    }
    for (int k = 0; k < n; k++) {
        struct gpu g;
        if (!gpu_get(sel[k], &g))
            continue;
        for (int j = 0; j < nf; j++) {
            char value[128];
            field_value(fields[j], &g, count, units, value, sizeof value);
            printf("%s%s", j ? ", " : "", value);
        }
        putchar('\n');
    }
    return g_status;
}

/* ---- -q ---------------------------------------------------------------------------------- */

struct row {
    const char *label;
    int field;
};

/* "<indent><label padded to width>: <value>" for each row, as -q lays out a section */
static void print_rows(const struct row *rows, size_t n, int indent, int width,
                       const struct gpu *g, unsigned int count) {
    char v[128];
    for (size_t j = 0; j < n; j++) {
        field_value(rows[j].field, g, count, 1, v, sizeof v);
        printf("%*s%-*s: %s\n", indent, "", width, rows[j].label, v);
    }
}

void report(const unsigned int *sel, int n, unsigned int count) {
    char driver[80] = "";
    int cuda = 0;
    nvmlSystemGetDriverVersion(driver, sizeof driver);
    nvmlSystemGetCudaDriverVersion(&cuda);
    printf("%-36s: %s\n", "Driver Version", driver);
    printf("%-36s: %d.%d\n", "CUDA Version", cuda / 1000, cuda % 1000 / 10);
    printf("%-36s: %u\n", "Attached GPUs", count);
    for (int k = 0; k < n; k++) {
        struct gpu g;
        if (!gpu_get(sel[k], &g))
            continue;
        printf("\nGPU %s\n", g.pci.busId);
        static const struct row top[] = {
            {"Index", F_INDEX}, {"Product Name", F_NAME}, {"GPU UUID", F_UUID},
            {"Minor Number", F_MINOR}, {"NUMA Node", F_NUMA}, {"Compute Capability", F_CC},
            {"MIG Mode Current", F_MIG_CUR}, {"MIG Mode Pending", F_MIG_PEND},
        };
        static const struct row pci[] = {
            {"Bus Id", F_BUS}, {"Domain", F_DOMAIN}, {"Bus", F_BUSNUM},
            {"Device", F_DEVNUM}, {"Device Id", F_DEVICE_ID}, {"Sub System Id", F_SUB_ID}};
        static const struct row mem[] = {
            {"Total", F_MEM_TOTAL}, {"Used", F_MEM_USED}, {"Free", F_MEM_FREE}};
        print_rows(top, sizeof top / sizeof top[0], 4, 32, &g, count);
        printf("    PCI\n");
        print_rows(pci, sizeof pci / sizeof pci[0], 8, 28, &g, count);
        printf("    FB Memory Usage\n");
        print_rows(mem, sizeof mem / sizeof mem[0], 8, 28, &g, count);
        unsigned int max = 0, cur = 0, pend = 0;
        if (nvmlDeviceGetMigMode(g.h, &cur, &pend) != R_SUCCESS || !cur ||
            nvmlDeviceGetMaxMigDeviceCount(g.h, &max) != R_SUCCESS)
            continue;
        printf("    MIG Devices\n");
        for (unsigned int j = 0; j < max; j++) {
            nvml_device_t m;
            char uuid[96];
            unsigned int gi = 0, ci = 0;
            attributes_t a;
            if (nvmlDeviceGetMigDeviceHandleByIndex(g.h, j, &m) != R_SUCCESS)
                break;
            if (nvmlDeviceGetUUID(m, uuid, sizeof uuid) != R_SUCCESS ||
                nvmlDeviceGetGpuInstanceId(m, &gi) != R_SUCCESS ||
                nvmlDeviceGetComputeInstanceId(m, &ci) != R_SUCCESS ||
                nvmlDeviceGetAttributes_v2(m, &a) != R_SUCCESS)
                continue;
            printf("        MIG Device %u\n", j);
            printf("            %-24s: %s\n", "UUID", uuid);
            printf("            %-24s: %u\n", "GPU Instance ID", gi);
            printf("            %-24s: %u\n", "Compute Instance ID", ci);
            printf("            %-24s: %u\n", "Multiprocessors", a.multiprocessorCount);
            printf("            %-24s: %llu MiB\n", "Memory", a.memorySizeMB);
        }
    }
}

