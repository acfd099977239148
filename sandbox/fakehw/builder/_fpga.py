"""FPGAs on the DFL bus (Intel PAC): ``<BDF>/fpga_region/regionN`` holding ``dfl-fme.N``
and ``dfl-port.M``, the FME's nested PR region with ``compat_id``, ``class/fpga_region``
and ``/dev/dfl-{fme,port}.N`` (Documentation/ABI/testing/sysfs-platform-dfl-fme,
sysfs-platform-dfl-port, sysfs-class-fpga-region, Documentation/fpga/dfl.rst), with the
``/dev/char/MAJOR:MINOR`` links udev makes for them (Intel's FPGA plugin finds a port's FME
through the FME's ``dev`` attribute and ``/dev/char``)."""

from __future__ import annotations

import hashlib

from sandbox.fakehw.builder._common import RW, Ctx
from sandbox.profile.devnames import DFL_FME_MAJOR, DFL_PORT_MAJOR
from sandbox.profile.spec import DeviceSpec

# Both majors are allocated dynamically by drivers/fpga/dfl.c; these are typical values.


def compat_id(bitstream_id: str) -> str:
    """The PR region's interface id: 32 hex digits, stable per bitstream."""
    return hashlib.sha256(f"compat/{bitstream_id}".encode()).hexdigest()[:32]


def add_fpgas(ctx: Ctx, fpgas: list[DeviceSpec], pci: dict[str, str]) -> None:
    dfl = [d for d in fpgas if d.fpga is not None and d.fpga.flavor == "dfl"]
    # The FMEs' PR regions are numbered after every card's own region (the resolver
    # numbers the cards' regions 0.. over the DFL cards alone), in the same id space.
    nested_base = max((d.fpga.region for d in dfl if d.fpga is not None), default=-1) + 1
    for d in dfl:
        fpga = d.fpga
        assert fpga is not None
        fn = pci.get(d.address)
        if fn is None or not ctx.emits(d.id):
            continue
        r = fpga.region
        region = f"{fn}/fpga_region/region{r}"
        ctx.files(region, {"uevent": ""})
        ctx.link(f"{region}/device", fn)
        ctx.link(f"{region}/subsystem", "sys/class/fpga_region")
        ctx.link(f"sys/class/fpga_region/region{r}", region)
        fme = f"{region}/dfl-fme.{r}"
        ctx.chardev(f"dfl-fme.{r}", DFL_FME_MAJOR, r, fme, "DRIVER=dfl-fme\n")
        ctx.link(f"dev/char/{DFL_FME_MAJOR}:{r}", f"dev/dfl-fme.{r}")
        ctx.files(
            fme,
            {
                "ports_num": f"{fpga.ports}\n",
                "bitstream_id": f"{fpga.bitstream_id}\n",
                "bitstream_metadata": "0x0\n",
                "cache_size": "0\n",
                "fabric_version": "0\n",
                "socket_id": f"{max(d.numa_node, 0)}\n",
            },
        )
        ctx.link(f"{fme}/subsystem", "sys/bus/platform")
        ctx.link(f"sys/bus/platform/devices/dfl-fme.{r}", fme)
        nested = nested_base + r
        pr = f"{fme}/dfl-fme-region.{r}/fpga_region/region{nested}"
        ctx.file(f"{pr}/compat_id", f"{compat_id(fpga.bitstream_id)}\n")
        ctx.link(f"{pr}/subsystem", "sys/class/fpga_region")
        ctx.link(f"sys/class/fpga_region/region{nested}", pr)
        for k in range(fpga.ports):
            n = fpga.first_port + k
            port = f"{region}/dfl-port.{n}"
            ctx.chardev(f"dfl-port.{n}", DFL_PORT_MAJOR, n, port, "DRIVER=dfl-port\n")
            ctx.link(f"dev/char/{DFL_PORT_MAJOR}:{n}", f"dev/dfl-port.{n}")
            afu = fpga.afu_ids[k] if k < len(fpga.afu_ids) else ""
            ctx.files(
                port,
                {
                    "id": f"{k}\n",
                    "afu_id": f"{afu}\n",
                    "ap1_event": "0\n",
                    "ap2_event": "0\n",
                    "ltr": "0\n",
                },
            )
            ctx.file(f"{port}/power_state", "0\n", RW)
            ctx.link(f"{port}/subsystem", "sys/bus/platform")
            ctx.link(f"sys/bus/platform/devices/dfl-port.{n}", port)
