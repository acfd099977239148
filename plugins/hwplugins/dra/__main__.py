"""Command line: ``python -m hwplugins.dra --root DIR --node-name N --kubeconfig F ...``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import yaml

from hwplugins.dra.config import ConfigError, load_config
from hwplugins.dra.devtypes import TYPES
from hwplugins.dra.discovery import discover
from hwplugins.dra.driver import Driver, run
from hwplugins.dra.kubeletplugin import KubeletPlugin
from hwplugins.dra.publisher import Publisher, read_claim, write_device_status
from hwplugins.dra.slices import DRIVER, build_pool, resource_slices
from hwplugins.dra.state import Claims, PrepareError
from hwplugins.kubeletsock import ServeError
from hwplugins.watch import Rescans

log = logging.getLogger("hwplugins.dra")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hwplugins.dra",
        description="Reference DRA driver: GPUs, NICs and FPGAs under ROOT/sys and ROOT/dev "
        f"become ResourceSlices of driver {DRIVER} (one pool per node); a kubelet plugin "
        "prepares allocated claims as CDI spec files.",
    )
    p.add_argument("--root", type=Path, default=Path("/"), help="root with sys/, dev/, proc/")
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""),
                   help="this node's name (default: $NODE_NAME)")  # fmt: skip
    p.add_argument("--kubeconfig", type=Path,
                   help="kubeconfig (default: in-cluster service account)")  # fmt: skip
    p.add_argument("--config", type=Path, help="driver config (GPU memory, partition schemes)")
    p.add_argument("--plugins-dir", type=Path, default=Path("/var/lib/kubelet/plugins"),
                   help="the driver's socket goes to DIR/<driver>/dra.sock")  # fmt: skip
    p.add_argument("--registry-dir", type=Path,
                   default=Path("/var/lib/kubelet/plugins_registry"),
                   help="the kubelet's plugins_registry")  # fmt: skip
    p.add_argument("--cdi-dir", type=Path, default=Path("/var/run/cdi"))
    p.add_argument("--checkpoint", type=Path,
                   help="prepared claims (default: PLUGINS_DIR/<driver>/checkpoint.json)")
    p.add_argument("--host-dev-dir", type=Path,
                   help="CDI hostPath of /dev/X is DIR/X (where the node's real nodes are)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between rescans")
    p.add_argument("--watch", type=Path, metavar="SOCKET",
                   help="a live tree's control socket: rescan on its change events, and only "
                   "every --resync seconds otherwise (every --interval while unreachable)")
    p.add_argument("--resync", type=float, default=30.0,
                   help="seconds between full rescans while --watch is followed (default: 30)")
    p.add_argument("--compatibility-groups", action="store_true",
                   help="offer every partition mode with compatibility groups (alpha: needs "
                   "the DRADeviceCompatibilityGroups feature gate)")  # fmt: skip
    p.add_argument("--skip-node-operations", metavar="TYPES", default="",
                   help="comma-separated device types (gpu, gpu-partition, nic, vf, fpga) "
                   "published for the control plane only: slices with skipNodeOperations, "
                   "no NodePrepare/Unprepare (alpha: needs DRAOptionalNodeOperations)")
    p.add_argument("--no-kubelet-plugin", action="store_true",
                   help="only publish slices (no sockets)")  # fmt: skip
    p.add_argument("--print-slices", action="store_true",
                   help="print the slices as YAML and exit (no cluster needed)")  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)  # fmt: skip
    if args.interval <= 0 or args.resync <= 0:
        print("error: --interval and --resync must be positive", file=sys.stderr)
        return 2
    if not args.node_name:
        print("error: --node-name (or $NODE_NAME) is required", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    skip = [t for t in args.skip_node_operations.split(",") if t]
    unknown = sorted(set(skip) - set(TYPES))
    if unknown:
        print(f"error: --skip-node-operations: unknown type(s) {', '.join(unknown)} "
              f"(known: {', '.join(TYPES)})", file=sys.stderr)  # fmt: skip
        return 2
    if args.print_slices:
        pool = build_pool(discover(args.root), config, args.compatibility_groups, skip)
        yaml.safe_dump_all(resource_slices(pool, args.node_name), sys.stdout, sort_keys=False)
        return 0
    from kubernetes import client
    from kubernetes import config as kubeconfig

    if args.kubeconfig is not None:
        api = kubeconfig.new_client_from_config(config_file=str(args.kubeconfig))
    else:
        kubeconfig.load_incluster_config()
        api = client.ApiClient()
    checkpoint = args.checkpoint or args.plugins_dir / DRIVER / "checkpoint.json"
    try:
        claims = Claims(checkpoint, args.cdi_dir, args.host_dev_dir)
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    driver = Driver(args.root, args.node_name, config, claims,
                    lambda ns, name: read_claim(api, ns, name),
                    report=lambda claim, prepared, pool: write_device_status(
                        api, claim, prepared, pool),
                    compatibility_groups=args.compatibility_groups,
                    skip_node_operations=skip)  # fmt: skip
    plugin = None
    if not args.no_kubelet_plugin:
        plugin = KubeletPlugin(driver, args.plugins_dir, args.registry_dir)
    stop = threading.Event()
    signals: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Only set flags here: logging from a signal handler can re-enter the stderr
        # writer the main thread is in the middle of ("reentrant call").
        signals.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("node %s, root %s, %d prepared claim(s) in %s, rescan every %.2fs",
             args.node_name, args.root, len(claims.all()), checkpoint, args.interval)
    try:
        run(driver, Publisher(api, args.node_name), plugin, args.interval, stop,
            Rescans(args.interval, args.watch, args.resync))
    except ServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if signals:
        log.info("signal %d: stopped", signals[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
