"""Topology matrix: which NICs are preferred / secondary for a memory location.

The matrix is ``{location: [[preferred nics], [secondary nics]]}`` and is
published inside the segment descriptor, so the initiator can pick the
remote NIC from the *target's* preferred list for the target region.

Locations are strings such as ``"cpu:0"`` (NUMA node 0) or ``"cuda:1"``;
``"*"`` is the catch-all row. Discovery reads sysfs:
``/sys/class/infiniband/<dev>/device/numa_node`` for RDMA devices and
``/sys/class/net/<if>/device/numa_node`` for interfaces; a NIC on the same
NUMA node as the memory is preferred, the others are secondary.
"""

from __future__ import annotations

import os
import socket

SYS = "/sys"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def numa_of_pci(devdir: str) -> int:
    """NUMA node of a PCI device dir (-1 = unknown / single node)."""
    v = _read(os.path.join(devdir, "numa_node"))
    try:
        return int(v) if v is not None else -1
    except ValueError:
        return -1


def discover_rdma_devices(sys_root: str = SYS) -> list[dict]:
    """RDMA devices with NUMA node, PCI address and attached netdevs."""
    base = os.path.join(sys_root, "class", "infiniband")
    out = []
    for dev in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        devdir = os.path.join(base, dev, "device")
        pci = os.path.basename(os.path.realpath(devdir)) if os.path.exists(devdir) else ""
        netdir = os.path.join(devdir, "net")
        nets = sorted(os.listdir(netdir)) if os.path.isdir(netdir) else []
        out.append({"name": dev, "numa": numa_of_pci(devdir), "pci": pci, "netdevs": nets})
    return out


def _interface_of_address(addr: str) -> str | None:
    """The interface holding a local IPv4 address (SIOCGIFADDR per interface)."""
    import fcntl
    import struct
    try:
        want = socket.inet_aton(addr)
    except OSError:
        return None
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if res[20:24] == want:
                return name
    finally:
        s.close()
    return None


def nic_numa(nic: str, sys_root: str = SYS) -> int:
    """NUMA node of a tcp "NIC" (an address or interface name) or RDMA device."""
    for cls in ("infiniband", "net"):
        d = os.path.join(sys_root, "class", cls, nic, "device")
        if os.path.exists(d):
            return numa_of_pci(d)
    ifname = _interface_of_address(nic)
    if ifname:
        return numa_of_pci(os.path.join(sys_root, "class", "net", ifname, "device"))
    return -1


def build_matrix(nics: list[str], numa: dict[str, int]) -> dict[str, list[list[str]]]:
    """Per NUMA node: NICs on that node preferred, the rest secondary; plus
    a ``"*"`` row with every NIC preferred (unknown locations, virtual NICs)."""
    matrix: dict[str, list[list[str]]] = {"*": [list(nics), []]}
    nodes = sorted({n for n in numa.values() if n >= 0})
    for node in nodes:
        pref = [n for n in nics if numa.get(n, -1) == node]
        if pref:
            matrix[f"cpu:{node}"] = [pref, [n for n in nics if n not in pref]]
    return matrix


def discover_matrix(nics: list[str], sys_root: str = SYS) -> dict[str, list[list[str]]]:
    return build_matrix(nics, {n: nic_numa(n, sys_root) for n in nics})


class Topology:
    def __init__(self, matrix: dict[str, list[list[str]]]) -> None:
        self.matrix = matrix

    def lists(self, location: str) -> tuple[list[str], list[str]]:
        """(preferred, secondary) NICs for ``location``: exact row, then the
        device-kind row (``cpu``/``cuda``), then ``*``."""
        for key in (location, location.split(":", 1)[0], "*"):
            row = self.matrix.get(key)
            if row:
                return list(row[0]), list(row[1])
        all_nics: list[str] = []
        for pref, sec in self.matrix.values():
            for n in pref + sec:
                if n not in all_nics:
                    all_nics.append(n)
        return all_nics, []

    def to_dict(self) -> dict[str, list[list[str]]]:
        return {k: [list(v[0]), list(v[1])] for k, v in self.matrix.items()}
