"""``python -m sandbox.nvml``: build our NVML (if not cached) and print its path."""

import sys

from sandbox.nvml.build import main

sys.exit(main())
