"""What one resolved node and one profile may hold.

Enough for the largest real machines a plugin targets, small enough that a node's tree
builds and renders in seconds on a laptop (benchmarks/bench_limits.py measures it; it
raises ``MAX_CPUS`` here to measure past the limit, so read these as ``limits.X``).
"""

MAX_CPUS = 1024  # logical CPUs: sockets x coresPerSocket x threadsPerCore
MAX_DEVICES = 1024  # devices on a node (the sum of every entry's count)
MAX_FUNCTIONS = 2048  # PCI functions on a node, every possible SR-IOV VF included
MAX_NODES = 64  # nodes of a profile, replicas included
