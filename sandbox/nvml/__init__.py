"""hw-sandbox's own NVML (``libnvidia-ml.so.1``), written in C from NVML's published API
facts, so NVIDIA's unmodified device plugin and gpu-feature-discovery run on fake GPUs.

``build()`` compiles the C sources here (``nvml_abi.h`` is NVML's ABI, ``state.c`` reads
the tree, the other ``.c`` files are the entry points by area), plus a NOT_SUPPORTED stub
for every other entry point in ``entrypoints.txt``, with gcc into the cache, keyed by the
hash of the sources and headers; the state file the library reads is written by
``sandbox.fakehw.builder._nvidia_proc``. See docs/nvml.md.
"""

from sandbox.errors import NvmlBuildError
from sandbox.nvml.build import (
    LIBRARY_NAME,
    build,
    driver_root,
    library_dir,
    node_driver_root,
    smi,
)

__all__ = ["LIBRARY_NAME", "NvmlBuildError", "build", "driver_root", "library_dir",
           "node_driver_root", "smi"]
