"""Segment descriptors: the typed wire form of how peers reach a segment's regions.

A descriptor crosses process boundaries twice: the node sends
``to_wire()`` to the conductor at registration, and a peer's resolver
hands it back, where ``SegmentDescriptor.from_wire`` checks every field
before the engine trusts it. A bad field fails the decode with a
``ValueError`` naming it (``segment.nics[0].port: expected an integer, got
'x'``), never later as a ``KeyError`` deep in a transfer.

Wire shape (JSON-serialisable; unknown keys are ignored, so a newer peer
may add fields)::

    {"name": str, "transport": "tcp" | "rdma",
     "regions": [{"id": int, "length": int, "location": str,
                  "rdma": {device: {"addr": int, "rkey": int}}}],   # rdma only
     "nics": [{"name": str, "host": str, "port": int}],
     "topology": {location: [[preferred nics], [secondary nics]]}}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

WIRE_TRANSPORTS = ("tcp", "rdma")

# location -> (preferred nic names, secondary nic names); see topology.py.
TopologyMatrix = Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]


@dataclass(frozen=True)
class NicDescriptor:
    """One NIC of a segment and where to connect to reach it."""

    name: str  # the name its topology uses (tcp: the address; rdma: the device)
    host: str  # the listener to connect to (rdma: the control channel)
    port: int

    def to_wire(self) -> dict:
        return {"name": self.name, "host": self.host, "port": self.port}


@dataclass(frozen=True)
class RdmaKey:
    """Where one region sits in the memory registration of one device."""

    addr: int
    rkey: int

    def to_wire(self) -> dict:
        return {"addr": self.addr, "rkey": self.rkey}


@dataclass(frozen=True)
class RegionDescriptor:
    """One registered region as peers address it: ``(segment, id)``."""

    id: int
    length: int
    location: str
    # device -> registration; None on tcp, where the key is absent on the wire.
    rdma: Mapping[str, RdmaKey] | None = None

    def to_wire(self) -> dict:
        out: dict[str, Any] = {"id": self.id, "length": self.length, "location": self.location}
        if self.rdma is not None:
            out["rdma"] = {dev: key.to_wire() for dev, key in self.rdma.items()}
        return out


@dataclass(frozen=True)
class SegmentDescriptor:
    """Everything a peer needs to move bytes to and from a segment.

    Invariant (checked by ``from_wire``): region ids are unique, and so are
    nic names, so ``region()`` and ``nic()`` are unambiguous.
    """

    name: str
    transport: str
    regions: tuple[RegionDescriptor, ...]
    nics: tuple[NicDescriptor, ...]
    topology: TopologyMatrix

    def region(self, region_id: int) -> RegionDescriptor | None:
        return next((r for r in self.regions if r.id == region_id), None)

    def nic(self, name: str) -> NicDescriptor | None:
        return next((n for n in self.nics if n.name == name), None)

    def to_wire(self) -> dict:
        return {"name": self.name, "transport": self.transport,
                "regions": [r.to_wire() for r in self.regions],
                "nics": [n.to_wire() for n in self.nics],
                "topology": {loc: [list(pref), list(sec)] for loc, (pref, sec) in self.topology.items()}}

    @classmethod
    def from_wire(cls, obj: object) -> SegmentDescriptor:
        """Decode and validate a wire descriptor; ``ValueError`` names the bad field."""
        d = _object(obj, "segment")
        name = _name(_field(d, "name", "segment"), "segment.name")
        transport = _field(d, "transport", "segment")
        if transport not in WIRE_TRANSPORTS:
            raise ValueError(f"segment.transport: expected one of {WIRE_TRANSPORTS}, got {transport!r}")
        regions = tuple(_region(r, f"segment.regions[{i}]")
                        for i, r in enumerate(_list(_field(d, "regions", "segment"), "segment.regions")))
        _unique([r.id for r in regions], "segment.regions", "id")
        nics = tuple(_nic(n, f"segment.nics[{i}]")
                     for i, n in enumerate(_list(_field(d, "nics", "segment"), "segment.nics")))
        _unique([n.name for n in nics], "segment.nics", "name")
        topology = _topology(_field(d, "topology", "segment"), "segment.topology")
        return cls(name=name, transport=transport, regions=regions, nics=nics, topology=topology)


# -- field checks (``where`` is the dotted path used in error messages) ------

def _object(v: object, where: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(v).__name__}")
    return v


def _field(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ValueError(f"{where}.{key}: missing")
    return d[key]


def _list(v: object, where: str) -> list:
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"{where}: expected a list, got {type(v).__name__}")
    return list(v)


def _int(v: object, where: str, lo: int = 0, hi: int | None = None) -> int:
    # bool is an int subclass, but True is no region id or port.
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{where}: expected an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{where}: expected an integer {bound}, got {v}")
    return v


def _str(v: object, where: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{where}: expected a string, got {v!r}")
    return v


def _name(v: object, where: str) -> str:
    s = _str(v, where)
    if not s:
        raise ValueError(f"{where}: expected a non-empty string")
    return s


def _unique(values: list, where: str, key: str) -> None:
    seen = set()
    for i, v in enumerate(values):
        if v in seen:
            raise ValueError(f"{where}[{i}].{key}: duplicate {v!r}")
        seen.add(v)


def _nic(v: object, where: str) -> NicDescriptor:
    d = _object(v, where)
    return NicDescriptor(name=_name(_field(d, "name", where), f"{where}.name"),
                         host=_name(_field(d, "host", where), f"{where}.host"),
                         port=_int(_field(d, "port", where), f"{where}.port", 1, 65535))


def _region(v: object, where: str) -> RegionDescriptor:
    d = _object(v, where)
    rdma: dict[str, RdmaKey] | None = None
    if "rdma" in d:
        keys = _object(d["rdma"], f"{where}.rdma")
        rdma = {}
        for dev, key in keys.items():
            at = f"{where}.rdma[{dev!r}]"
            _str(dev, f"{where}.rdma: device name")
            k = _object(key, at)
            rdma[dev] = RdmaKey(addr=_int(_field(k, "addr", at), f"{at}.addr"),
                                rkey=_int(_field(k, "rkey", at), f"{at}.rkey"))
    return RegionDescriptor(id=_int(_field(d, "id", where), f"{where}.id"),
                            length=_int(_field(d, "length", where), f"{where}.length"),
                            location=_str(_field(d, "location", where), f"{where}.location"),
                            rdma=rdma)


def _topology(v: object, where: str) -> TopologyMatrix:
    out: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for loc, row in _object(v, where).items():
        _str(loc, f"{where}: location")
        at = f"{where}[{loc!r}]"
        lists = _list(row, at)
        if len(lists) != 2:
            raise ValueError(f"{at}: expected [[preferred nics], [secondary nics]], got {row!r}")
        pref, sec = (_names(x, f"{at}[{j}]") for j, x in enumerate(lists))
        out[loc] = (pref, sec)
    return out


def _names(v: object, where: str) -> tuple[str, ...]:
    return tuple(_str(n, f"{where}[{k}]") for k, n in enumerate(_list(v, where)))
