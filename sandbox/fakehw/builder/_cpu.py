"""CPUs, NUMA nodes and memory: ``sys/devices/system/{cpu,node}``, ``proc/cpuinfo``,
``proc/meminfo`` — what hwloc, lscpu and numactl read (Documentation/ABI/stable/
sysfs-devices-node, Documentation/ABI/testing/sysfs-devices-system-cpu,
Documentation/admin-guide/cputopology.rst)."""

from __future__ import annotations

from sandbox.fakehw.builder._common import RW, Ctx, kernel_mask, make_file
from sandbox.profile import catalogue
from sandbox.profile.cpulist import format_cpulist
from sandbox.profile.spec import LogicalCpu, NodeSpec

CPU = "sys/devices/system/cpu"
NODE = "sys/devices/system/node"
KiB = 1024
# Hugepage sizes an x86-64 kernel always lists, whether or not the profile reserves any.
DEFAULT_HUGEPAGE_KB = (2048, 1048576)

_INTEL_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts "
    "acpi mmx fxsr sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art "
    "arch_perfmon pebs bts rep_good nopl xtopology nonstop_tsc cpuid aperfmperf pni "
    "pclmulqdq dtes64 monitor ds_cpl vmx smx est tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid dca "
    "sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm "
    "abm 3dnowprefetch cpuid_fault epb cat_l3 cat_l2 cdp_l3 ssbd mba ibrs ibpb stibp "
    "ibrs_enhanced fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm cqm rdt_a "
    "avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb intel_pt avx512cd sha_ni "
    "avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd dtherm "
    "ida arat pln pts avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq "
    "avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 rdpid bus_lock_detect cldemote "
    "movdiri movdir64b enqcmd fsrm md_clear serialize tsxldtrk pconfig arch_lbr amx_bf16 "
    "avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities"
)
_AMD_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl "
    "nonstop_tsc cpuid extd_apicid aperfmperf rapl pni pclmulqdq monitor ssse3 fma cx16 pcid "
    "sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand lahf_lm cmp_legacy svm "
    "extapic cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw ibs skinit wdt tce topoext "
    "perfctr_core perfctr_nb bpext perfctr_llc mwaitx cpb cat_l3 cdp_l3 invpcid_single hw_pstate "
    "ssbd mba ibrs ibpb stibp vmmcall fsgsbase bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a "
    "avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw "
    "avx512vl xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total "
    "cqm_mbm_local avx512_bf16 clzero irperf xsaveerptr rdpru wbnoinvd amd_ppin cppc arat npt "
    "lbrv svm_lock nrip_save tsc_scale vmcb_clean flushbyasid decodeassists pausefilter "
    "pfthreshold avic v_vmsave_vmload vgif x2avic v_spec_ctrl vnmi avx512vbmi umip pku ospke "
    "avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq la57 rdpid "
    "overflow_recov succor smca fsrm flush_l1d"
)


def _bits(n: int) -> int:
    return max(0, (n - 1).bit_length())


def _caches(node: NodeSpec) -> list[tuple[int, str, int, int, str]]:
    """(level, type, size KiB, ways, sharing) per cache index, sharing 'core', 'ccx' (the
    cores of one AMD core complex) or 'package': the CPU model's layout (catalogue)."""
    spec = node.cpu
    layout = catalogue.cache_layout(spec.vendor, spec.family, spec.model_number)
    cores = max(1, spec.cores_per_socket)
    out = []
    for c in layout.levels:
        size = c.size_kb or cores * layout.l3_kb_per_core
        out.append((c.level, c.type, size, c.ways, c.scope))
    return out


def _ccx_size(node: NodeSpec) -> int:
    spec = node.cpu
    per = catalogue.cache_layout(spec.vendor, spec.family, spec.model_number).cores_per_ccx
    return max(1, min(per or spec.cores_per_socket, spec.cores_per_socket))


def add_cpus(ctx: Ctx) -> None:
    node = ctx.node
    n = ctx.ncpus
    spec = node.cpu
    all_list = format_cpulist(range(n))
    ctx.files(
        CPU,
        {
            "possible": f"{all_list}\n",
            "present": f"{all_list}\n",
            "online": f"{all_list}\n",
            "offline": "\n",
            "isolated": "\n",
            "kernel_max": "8191\n",
            "modalias": "cpu:type:x86,ven0000fam0006mod008F:feature:\n",
        },
    )
    smt = "1" if spec.threads_per_core > 1 else "0"
    ctx.files(
        f"{CPU}/smt", {"active": f"{smt}\n", "control": "on\n" if smt == "1" else "notsupported\n"}
    )
    by_core: dict[tuple[int, int], list[int]] = {}
    by_socket: dict[int, list[int]] = {}
    by_ccx: dict[tuple[int, int], list[int]] = {}
    ccx = _ccx_size(node)
    for c in node.cpus:
        by_core.setdefault((c.socket, c.core), []).append(c.id)
        by_socket.setdefault(c.socket, []).append(c.id)
        by_ccx.setdefault((c.socket, c.core // ccx), []).append(c.id)
    # Per-sibling-set files, formatted once and shared by every CPU (and cache) in the set:
    # a mask is ncpus/4 bytes, so a copy per CPU would make the tree quadratic in CPUs.
    core_fmt = {k: (make_file(f"{kernel_mask(v, n)}\n"), make_file(f"{format_cpulist(v)}\n"))
                for k, v in by_core.items()}
    pkg_fmt = {k: (make_file(f"{kernel_mask(v, n)}\n"), make_file(f"{format_cpulist(v)}\n"))
               for k, v in by_socket.items()}
    ccx_fmt = {k: (make_file(f"{kernel_mask(v, n)}\n"), make_file(f"{format_cpulist(v)}\n"))
               for k, v in by_ccx.items()}
    ccx_per_socket = -(-spec.cores_per_socket // ccx)
    caches = _caches(node)
    cores = spec.cores_per_socket
    freq = _freq_policy(node)
    idle_driver, idle_states = _idle(node)
    ctx.files(f"{CPU}/cpuidle", {
        "current_driver": f"{idle_driver}\n",
        "current_governor_ro": "menu\n",
        "available_governors": "ladder menu teo \n",
    })
    ctx.file(f"{CPU}/cpuidle/current_governor", "menu\n", RW)
    _idle_parameters(ctx, idle_driver)
    _pstate(ctx, node)
    for c in node.cpus:
        base = f"{CPU}/cpu{c.id}"
        tmask, tlist = core_fmt[(c.socket, c.core)]
        pmask, plist = pkg_fmt[c.socket]
        ctx.files(
            f"{base}/topology",
            {
                "physical_package_id": f"{c.socket}\n",
                "die_id": "0\n",
                "cluster_id": f"{c.socket * cores + c.core}\n",
                "core_id": f"{c.core}\n",
                "thread_siblings": tmask,
                "thread_siblings_list": tlist,
                "core_cpus": tmask,
                "core_cpus_list": tlist,
                "cluster_cpus": tmask,
                "cluster_cpus_list": tlist,
                "core_siblings": pmask,
                "core_siblings_list": plist,
                "die_cpus": pmask,
                "die_cpus_list": plist,
                "package_cpus": pmask,
                "package_cpus_list": plist,
            },
        )
        for i, (level, ctype, size, ways, scope) in enumerate(caches):
            if scope == "core":
                smask, slist = tmask, tlist
                cid = c.socket * cores + c.core
            elif scope == "ccx":
                smask, slist = ccx_fmt[(c.socket, c.core // ccx)]
                cid = c.socket * ccx_per_socket + c.core // ccx
            else:
                smask, slist = pmask, plist
                cid = c.socket
            ctx.files(
                f"{base}/cache/index{i}",
                {
                    "level": f"{level}\n",
                    "type": f"{ctype}\n",
                    "size": f"{size}K\n",
                    "ways_of_associativity": f"{ways}\n",
                    "number_of_sets": f"{size * 1024 // (ways * 64)}\n",
                    "coherency_line_size": "64\n",
                    "physical_line_partition": "1\n",
                    "shared_cpu_map": smask,
                    "shared_cpu_list": slist,
                    "id": f"{cid}\n",
                },
            )
        if c.id:
            ctx.file(f"{base}/online", "1\n", RW)
        _cpufreq(ctx, c.id, freq)
        _cpuidle(ctx, c.id, idle_states)
        ctx.link(f"{base}/node{c.numa_node}", f"{NODE}/node{c.numa_node}")
    # /proc/cpuinfo's "cache size" is the L3 on Intel, the (per-core) L2 on AMD.
    shown = caches[2][2] if "AMD" in spec.vendor else caches[3][2]
    ctx.file("proc/cpuinfo", _cpuinfo(node, shown))


# cpuidle states (name, desc, exit latency us, target residency us): intel_idle's table for
# Sapphire Rapids (drivers/idle/intel_idle.c spr_cstates); acpi_idle's _CST states on AMD
# EPYC servers. State 0 is the kernel's polling state on both.
_POLL = ("POLL", "CPUIDLE CORE POLL IDLE", 0, 0)
_INTEL_IDLE = (_POLL, ("C1", "MWAIT 0x00", 1, 1), ("C1E", "MWAIT 0x01", 2, 4),
               ("C6", "MWAIT 0x20", 290, 800))
_ACPI_IDLE = (_POLL, ("C1", "ACPI FFH MWAIT 0x0", 1, 2), ("C2", "ACPI IOPORT 0x814", 18, 36))


def _amd(node: NodeSpec) -> bool:
    return node.cpu.vendor == "AuthenticAMD"


def _idle(node: NodeSpec) -> tuple[str, tuple[tuple[str, str, int, int], ...]]:
    return ("acpi_idle", _ACPI_IDLE) if _amd(node) else ("intel_idle", _INTEL_IDLE)


# Built-in modules' parameters (module_param in drivers/idle/intel_idle.c and
# drivers/acpi/processor_{idle,perflib,thermal}.c), at their defaults: (name, value, mode).
# ACPI's processor module is there on every x86 machine, whichever cpuidle driver runs.
_INTEL_IDLE_PARAMETERS = (("force_irq_on", "N", 0o444), ("ibrs_off", "N", 0o444),
                          ("max_cstate", "9", 0o444), ("no_acpi", "N", 0o444),
                          ("no_native", "N", 0o444), ("preferred_cstates", "0", 0o444),
                          ("states_off", "0", 0o444), ("use_acpi", "N", 0o444))
_PROCESSOR_PARAMETERS = (("bm_check_disable", "N", 0o400), ("ignore_ppc", "0", 0o644),
                         ("ignore_tpc", "0", 0o644), ("latency_factor", "2", 0o644),
                         ("max_cstate", "8", 0o400), ("nocst", "N", 0o400))


def _idle_parameters(ctx: Ctx, driver: str) -> None:
    """``sys/module/<module>/parameters``: intel_idle's where it is the cpuidle driver, and
    the ACPI processor module's (home of acpi_idle) always; both are built in, so neither
    has ``initstate`` or ``refcnt``."""
    tables: list[tuple[str, tuple[tuple[str, str, int], ...]]] = [
        ("processor", _PROCESSOR_PARAMETERS)]
    if driver == "intel_idle":
        tables.append(("intel_idle", _INTEL_IDLE_PARAMETERS))
    for module, params in tables:
        for name, value, mode in params:
            ctx.file(f"sys/module/{module}/parameters/{name}", f"{value}\n", mode)


def _cpuidle(ctx: Ctx, cpu: int, states: tuple[tuple[str, str, int, int], ...]) -> None:
    """``cpuN/cpuidle/stateK/*`` (ABI/testing/sysfs-devices-system-cpu): never entered yet."""
    for k, (name, desc, latency, residency) in enumerate(states):
        base = f"{CPU}/cpu{cpu}/cpuidle/state{k}"
        ctx.files(base, {
            "name": f"{name}\n", "desc": f"{desc}\n", "latency": f"{latency}\n",
            "residency": f"{residency}\n",
            "power": "4294967295\n" if k == 0 else "0\n",
            "usage": "0\n", "time": "0\n", "rejected": "0\n", "above": "0\n",
            "below": "0\n", "default_status": "enabled\n",
        })
        ctx.file(f"{base}/disable", "0\n", RW)


def _freq_policy(node: NodeSpec) -> dict[str, str]:
    """One cpufreq policy's attributes (kHz): base ``cpu.mhz``; the most a core turbos to
    is 1.9x base on Intel (8480+: 2.0 -> 3.8 GHz), 1.4x on AMD (9454: 2.75 -> 3.8 GHz)."""
    base = node.cpu.mhz * 1000
    amd = _amd(node)
    top = base * (14 if amd else 19) // 10
    low = 400_000 if amd else 800_000
    low = min(low, base)
    out = {
        "cpuinfo_max_freq": f"{top}\n",
        "cpuinfo_min_freq": f"{low}\n",
        "cpuinfo_transition_latency": "0\n",
        "scaling_cur_freq": f"{base}\n",
        "scaling_driver": "amd-pstate-epp\n" if amd else "intel_pstate\n",
        "scaling_available_governors": "performance powersave\n",
        "scaling_setspeed": "<unsupported>\n",
        "energy_performance_available_preferences":
            "default performance balance_performance balance_power power \n",
    }
    if amd:
        out.update({"amd_pstate_max_freq": f"{top}\n",
                    "amd_pstate_lowest_nonlinear_freq": f"{min(base, low * 4)}\n",
                    "amd_pstate_highest_perf": "196\n"})
    else:
        out["base_frequency"] = f"{base}\n"
    return out


def _cpufreq(ctx: Ctx, cpu: int, attrs: dict[str, str]) -> None:
    """``cpufreq/policyN`` (one CPU per policy, as the pstate drivers make them) and the
    ``cpuN/cpufreq`` link to it (admin-guide/pm/cpufreq.rst)."""
    base = f"{CPU}/cpufreq/policy{cpu}"
    ctx.files(base, attrs)
    ctx.files(base, {"affected_cpus": f"{cpu}\n", "related_cpus": f"{cpu}\n"})
    ctx.files(base, {
        "scaling_governor": "powersave\n",
        "scaling_max_freq": attrs["cpuinfo_max_freq"],
        "scaling_min_freq": attrs["cpuinfo_min_freq"],
        "energy_performance_preference": "balance_performance\n",
    }, RW)
    ctx.link(f"{CPU}/cpu{cpu}/cpufreq", base)


def _pstate(ctx: Ctx, node: NodeSpec) -> None:
    """The pstate driver's global switches: ``cpu/intel_pstate/`` (admin-guide/pm/
    intel_pstate.rst) or ``cpu/amd_pstate/`` (admin-guide/pm/amd-pstate.rst)."""
    if _amd(node):
        ctx.files(f"{CPU}/amd_pstate", {"prefcore": "enabled\n"})
        ctx.file(f"{CPU}/amd_pstate/status", "active\n", RW)
        return
    ctx.files(f"{CPU}/intel_pstate", {"num_pstates": "31\n", "turbo_pct": "47\n"})
    ctx.files(f"{CPU}/intel_pstate", {
        "status": "active\n", "max_perf_pct": "100\n", "min_perf_pct": "21\n",
        "no_turbo": "0\n", "hwp_dynamic_boost": "0\n",
    }, RW)


def _apic(c: LogicalCpu, node: NodeSpec) -> int:
    tbits = _bits(node.cpu.threads_per_core)
    cbits = _bits(node.cpu.cores_per_socket)
    return (c.socket << (tbits + cbits)) | (c.core << tbits) | c.thread


def _cpuinfo(node: NodeSpec, l3_kb: int) -> str:
    spec = node.cpu
    amd = "AMD" in spec.vendor
    flags = _AMD_FLAGS if amd else _INTEL_FLAGS
    siblings = spec.cores_per_socket * spec.threads_per_core
    head = (
        f"vendor_id\t: {spec.vendor}\n"
        f"cpu family\t: {spec.family}\n"
        f"model\t\t: {spec.model_number}\n"
        f"model name\t: {spec.model}\n"
        "stepping\t: 8\n"
        "microcode\t: 0x2b000571\n"
        f"cpu MHz\t\t: {spec.mhz}.000\n"
        f"cache size\t: {l3_kb} KB\n"
    )
    tail = (
        "fpu\t\t: yes\nfpu_exception\t: yes\ncpuid level\t: 32\nwp\t\t: yes\n"
        f"flags\t\t: {flags}\n"
        "bugs\t\t: spectre_v1 spectre_v2 spec_store_bypass swapgs\n"
        f"bogomips\t: {spec.mhz * 2}.00\n"
        "clflush size\t: 64\ncache_alignment\t: 64\n"
        "address sizes\t: 46 bits physical, 57 bits virtual\npower management:\n\n"
    )
    out: list[str] = []
    for c in sorted(node.cpus, key=lambda x: x.id):
        apic = _apic(c, node)
        out.append(
            f"processor\t: {c.id}\n{head}"
            f"physical id\t: {c.socket}\nsiblings\t: {siblings}\ncore id\t\t: {c.core}\n"
            f"cpu cores\t: {spec.cores_per_socket}\napicid\t\t: {apic}\n"
            f"initial apicid\t: {apic}\n{tail}"
        )
    return "".join(out)


def _hugepages(pages: tuple[tuple[int, int], ...]) -> dict[int, int]:
    out = dict.fromkeys(DEFAULT_HUGEPAGE_KB, 0)
    out.update(dict(pages))
    return out


def swap_kb(node: NodeSpec) -> int:
    """KiB of usable swap, as SwapTotal and /proc/swaps count it (the header page not)."""
    return max(0, node.swap // KiB - 4) if node.swap else 0


def _kb_line(label: str, kb: int) -> str:
    return f"{label + ':':<16}{kb:>8} kB\n"


def add_numa(ctx: Ctx) -> None:
    node = ctx.node
    ids = [n.id for n in node.numa]
    all_nodes = format_cpulist(ids)
    with_cpus = format_cpulist([n.id for n in node.numa if n.cpus])
    ctx.files(
        NODE,
        {
            "possible": f"{all_nodes}\n",
            "online": f"{all_nodes}\n",
            "has_cpu": f"{with_cpus}\n",
            "has_normal_memory": f"{all_nodes}\n",
            "has_memory": f"{all_nodes}\n",
            "has_generic_initiator": "\n",
        },
    )
    total_kb = free_kb = 0
    huge_total: dict[int, int] = {}
    for n in node.numa:
        base = f"{NODE}/node{n.id}"
        mem_kb = n.memory // KiB
        pages = _hugepages(n.hugepages)
        huge_kb = sum(kb * count for kb, count in pages.items())
        used_kb = min(mem_kb // 64, 4 * 1024 * 1024)
        free = max(0, mem_kb - huge_kb - used_kb)
        total_kb += mem_kb
        free_kb += free
        for kb, count in pages.items():
            huge_total[kb] = huge_total.get(kb, 0) + count
        mask = kernel_mask(n.cpus, ctx.ncpus)
        default_pages = pages.get(2048, 0)
        p = f"Node {n.id} "
        meminfo = (
            f"{p}MemTotal:       {mem_kb:8d} kB\n"
            f"{p}MemFree:        {free:8d} kB\n"
            f"{p}MemUsed:        {mem_kb - free:8d} kB\n"
            f"{p}Active:         {used_kb // 2:8d} kB\n"
            f"{p}Inactive:       {used_kb // 4:8d} kB\n"
            f"{p}Dirty:          {0:8d} kB\n"
            f"{p}FilePages:      {used_kb // 2:8d} kB\n"
            f"{p}AnonPages:      {used_kb // 4:8d} kB\n"
            f"{p}Slab:           {used_kb // 8:8d} kB\n"
            f"{p}HugePages_Total: {default_pages:5d}\n"
            f"{p}HugePages_Free:  {default_pages:5d}\n"
            f"{p}HugePages_Surp:  {0:5d}\n"
        )
        ctx.files(
            base,
            {
                "cpumap": f"{mask}\n",
                "cpulist": f"{format_cpulist(n.cpus)}\n",
                "meminfo": meminfo,
                "distance": " ".join(str(d) for d in n.distances) + "\n",
                "numastat": "numa_hit 0\nnuma_miss 0\nnuma_foreign 0\ninterleave_hit 0\n"
                "local_node 0\nother_node 0\n",
            },
        )
        for kb, count in sorted(pages.items()):
            ctx.files(
                f"{base}/hugepages/hugepages-{kb}kB",
                {
                    "free_hugepages": f"{count}\n",
                    "surplus_hugepages": "0\n",
                },
            )
            ctx.file(f"{base}/hugepages/hugepages-{kb}kB/nr_hugepages", f"{count}\n", RW)
        for cpu in n.cpus:
            ctx.link(f"{base}/cpu{cpu}", f"{CPU}/cpu{cpu}")
    huge_tlb_kb = sum(kb * c for kb, c in huge_total.items())
    default = huge_total.get(2048, 0)
    cached = min(total_kb // 32, 8 * 1024 * 1024)
    lines = [
        _kb_line("MemTotal", total_kb),
        _kb_line("MemFree", free_kb),
        _kb_line("MemAvailable", free_kb + cached),
        _kb_line("Buffers", cached // 8),
        _kb_line("Cached", cached),
        _kb_line("SwapCached", 0),
        _kb_line("Active", cached // 2),
        _kb_line("Inactive", cached // 4),
        _kb_line("SwapTotal", swap_kb(node)),
        _kb_line("SwapFree", swap_kb(node)),
        _kb_line("Dirty", 0),
        _kb_line("AnonPages", cached // 4),
        _kb_line("Shmem", 0),
        _kb_line("Slab", cached // 8),
        _kb_line("CommitLimit", (total_kb - huge_tlb_kb) // 2 + swap_kb(node)),
        _kb_line("AnonHugePages", 0),
        f"{'HugePages_Total:':<16}{default:>8}\n",
        f"{'HugePages_Free:':<16}{default:>8}\n",
        f"{'HugePages_Rsvd:':<16}{0:>8}\n",
        f"{'HugePages_Surp:':<16}{0:>8}\n",
        _kb_line("Hugepagesize", 2048),
        _kb_line("Hugetlb", huge_tlb_kb),
    ]
    ctx.file("proc/meminfo", "".join(lines))
    for kb, count in sorted(huge_total.items()):
        ctx.files(
            f"sys/kernel/mm/hugepages/hugepages-{kb}kB",
            {
                "nr_hugepages": f"{count}\n",
                "free_hugepages": f"{count}\n",
                "resv_hugepages": "0\n",
                "surplus_hugepages": "0\n",
                "nr_overcommit_hugepages": "0\n",
            },
        )
