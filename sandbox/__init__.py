"""hw-sandbox: a declarative hardware-emulation sandbox for local Kubernetes clusters.

The flow, one package each:
    profile (YAML -> validated model) -> fakehw (model -> tree; tree served by FUSE or
    written to a directory; live changes through the control API) -> runtimes.
"""

__version__ = "0.1.0"
