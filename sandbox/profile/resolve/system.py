"""The machine's identity (DMI) and swap: the profile's ``system`` and ``swap`` over
defaults per CPU vendor.

The defaults are real, current server models for each vendor's CPUs (a Supermicro X13
Hyper for Sapphire Rapids, an H13 Hyper for Genoa), with AMI firmware as those ship;
serials and the product UUID are seeded per replica like the devices' identities.
"""

from __future__ import annotations

import uuid as uuidlib

from sandbox.profile import model
from sandbox.profile.spec import Loc, SystemSpec

Problems = list[tuple[Loc, str]]

PAGE = 4096
MIN_SWAP = 10 * PAGE  # mkswap refuses fewer than 10 pages
CHASSIS_MAIN_SERVER = 17

_AMI = "American Megatrends International, LLC."
# CPU vendor -> (sys_vendor, product, product version, board, board version, bios version,
# bios date)
_DEFAULTS = {
    "GenuineIntel": ("Supermicro", "SYS-221H-TNR", "0123456789", "X13DEM", "1.10", "2.1",
                     "03/28/2024"),
    "AuthenticAMD": ("Supermicro", "AS -2025HS-TNR", "0123456789", "H13DSH", "1.01", "1.5",
                     "10/03/2023"),
}


def system_spec(node: model.Node, seed: bytes, seed2: bytes) -> SystemSpec:
    """The DMI identity of one replica; ``seed``/``seed2`` are its seeded bytes (UUID,
    serials)."""
    vendor, product, version, board, board_version, bios_version, bios_date = _DEFAULTS.get(
        node.cpu.vendor, _DEFAULTS["GenuineIntel"])
    given = node.system
    bios_vendor = _AMI
    board_vendor = vendor
    chassis = CHASSIS_MAIN_SERVER
    if given is not None:
        vendor = given.vendor if given.vendor is not None else vendor
        product = given.product if given.product is not None else product
        version = given.version if given.version is not None else version
        board_vendor = vendor
        if given.board is not None:
            board_vendor = given.board.vendor if given.board.vendor is not None else vendor
            board = given.board.name if given.board.name is not None else board
            board_version = (given.board.version if given.board.version is not None
                             else board_version)
        if given.bios is not None:
            bios_vendor = given.bios.vendor if given.bios.vendor is not None else bios_vendor
            bios_version = (given.bios.version if given.bios.version is not None
                            else bios_version)
            bios_date = given.bios.date if given.bios.date is not None else bios_date
        if given.chassis_type is not None:
            chassis = given.chassis_type
    product_uuid = str(uuidlib.UUID(bytes=seed[:16], version=4))
    digits = int.from_bytes(seed2[:8], "big")
    return SystemSpec(
        sys_vendor=vendor, product_name=product, product_version=version,
        product_serial=f"S{digits % 10**12:012d}", product_uuid=product_uuid,
        board_vendor=board_vendor, board_name=board, board_version=board_version,
        board_serial=f"OM{(digits >> 40) % 10**10:010d}", bios_vendor=bios_vendor,
        bios_version=bios_version, bios_date=bios_date, chassis_type=chassis,
    )


def swap_bytes(node: model.Node, loc: Loc, problems: Problems) -> int:
    """The node's swap in bytes, whole pages; 0 for none."""
    if node.swap is None or node.swap == 0:
        return 0
    if node.swap < MIN_SWAP:
        problems.append(((*loc, "swap"), f"swap of {node.swap} bytes is less than 10 pages "
                         f"({MIN_SWAP} bytes, what mkswap needs); use 0 for none"))
        return 0
    return node.swap - node.swap % PAGE
