"""The driver's device types (``slices.TYPES``), in a module of their own: a command line
that only names them (``--skip-node-operations``, `sandbox up --dra-node-ops`) imports
nothing else of the driver."""

TYPES = ("gpu", "gpu-partition", "nic", "vf", "fpga")
