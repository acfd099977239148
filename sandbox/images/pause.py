"""The two images the native runtime imports into its containerd (no registry): the pod
sandbox image, our own pause program (``pause.c``, compiled here with ``gcc -static``),
and a workload image, Debian's static busybox with one symlink per applet. Each is an OCI
archive cached by its inputs (``oci.write_archive``)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from sandbox.commands import run
from sandbox.errors import RuntimeBackendError
from sandbox.images.oci import PATH, write_archive
from sandbox.images.tarfiles import layer_tar

PAUSE_SOURCE = Path(__file__).with_name("pause.c")
BUSYBOX = Path("/bin/busybox")


def compile_pause(cache: Path) -> Path:
    """Our pause program, compiled once per source version into ``cache``."""
    source = PAUSE_SOURCE.read_bytes()
    out = cache / f"pause-{hashlib.sha256(source).hexdigest()[:16]}"
    if out.is_file():
        return out
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeBackendError(
            "pause image", "gcc not found (run scripts/build-k8s to install gcc and libc6-dev)"
        )
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    run([gcc, "-static", "-Os", "-s", "-o", str(tmp), str(PAUSE_SOURCE)], timeout=None)
    tmp.replace(out)
    return out


def pause_image(cache: Path, ref: str) -> Path:
    """The pod sandbox image: just ``/pause``."""
    binary = compile_pause(cache)
    dest = cache / f"{binary.name}-{hashlib.sha256(ref.encode()).hexdigest()[:8]}.oci.tar"
    if not dest.is_file():
        layer = layer_tar({"/pause": binary}, {"/pause"})
        write_archive(dest, ref, [layer], {"Env": [PATH], "Entrypoint": ["/pause"]})
    return dest


def busybox_image(cache: Path, ref: str) -> Path:
    """A workload image: Debian's static busybox, ``/bin/<applet>`` -> busybox."""
    if not BUSYBOX.is_file():
        raise RuntimeBackendError(
            "busybox image", f"{BUSYBOX} not found (run scripts/build-k8s: busybox-static)"
        )
    data = BUSYBOX.read_bytes()
    dest = cache / f"busybox-{hashlib.sha256(data + ref.encode()).hexdigest()[:16]}.oci.tar"
    if dest.is_file():
        return dest
    listing = run([str(BUSYBOX), "--list"], timeout=None).stdout.split()
    layer = layer_tar(
        {"/bin/busybox": data,
         "/etc/passwd": b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n",
         "/etc/group": b"root:x:0:\nnogroup:x:65534:\n"},
        {"/bin/busybox"},
        symlinks={f"/bin/{applet}": "busybox" for applet in listing if applet != "busybox"},
        dirs={"/tmp", "/root", "/dev", "/proc", "/sys", "/etc", "/var"})
    write_archive(dest, ref, [layer], {"Env": [PATH], "Cmd": ["sh"]})
    return dest
