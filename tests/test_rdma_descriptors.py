"""SegmentDescriptor: the wire form round-trips, and a bad field fails the decode by name."""

from __future__ import annotations

import copy

import pytest

from rdma.config import TransferConfig
from rdma.descriptors import NicDescriptor, RdmaKey, RegionDescriptor, SegmentDescriptor
from rdma.engine import TransferEngine
from rdma.types import WRITE, TransferRequest

GOOD = {
    "name": "node-b",
    "transport": "rdma",
    "regions": [
        {"id": 0, "length": 4096, "location": "cpu:0",
         "rdma": {"mlx5_0": {"addr": 140000000, "rkey": 77}, "mlx5_1": {"addr": 140000000, "rkey": 78}}},
        {"id": 1, "length": 0, "location": "cuda:1", "rdma": {}},
    ],
    "nics": [{"name": "mlx5_0", "host": "10.0.0.2", "port": 7000},
             {"name": "mlx5_1", "host": "10.0.0.2", "port": 7000}],
    "topology": {"*": [["mlx5_0", "mlx5_1"], []], "cpu:0": [["mlx5_0"], ["mlx5_1"]]},
}


def test_decode_good_descriptor():
    d = SegmentDescriptor.from_wire(GOOD)
    assert d.name == "node-b" and d.transport == "rdma"
    assert d.nics[0] == NicDescriptor("mlx5_0", "10.0.0.2", 7000)
    assert d.region(0) == RegionDescriptor(0, 4096, "cpu:0", {"mlx5_0": RdmaKey(140000000, 77),
                                                              "mlx5_1": RdmaKey(140000000, 78)})
    assert d.region(1).rdma == {}
    assert d.region(2) is None
    assert d.nic("mlx5_1").port == 7000 and d.nic("eth0") is None
    assert d.topology["cpu:0"] == (("mlx5_0",), ("mlx5_1",))


def test_wire_round_trip():
    assert SegmentDescriptor.from_wire(GOOD).to_wire() == GOOD
    tcp = copy.deepcopy(GOOD)
    tcp["transport"] = "tcp"
    for r in tcp["regions"]:
        del r["rdma"]  # tcp regions carry no "rdma" key at all
    d = SegmentDescriptor.from_wire(tcp)
    assert all(r.rdma is None for r in d.regions)
    assert d.to_wire() == tcp


def test_unknown_keys_are_ignored():
    wire = copy.deepcopy(GOOD)
    wire["future_field"] = {"x": 1}
    wire["nics"][0]["speed_gbps"] = 400
    assert SegmentDescriptor.from_wire(wire) == SegmentDescriptor.from_wire(GOOD)


def test_frozen():
    d = SegmentDescriptor.from_wire(GOOD)
    with pytest.raises(AttributeError):
        d.name = "other"  # type: ignore[misc]


def _set(path, value):
    """A copy of GOOD with the field at ``path`` replaced (or deleted when value is ...)."""
    wire = copy.deepcopy(GOOD)
    obj = wire
    for k in path[:-1]:
        obj = obj[k]
    if value is ...:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    return wire


@pytest.mark.parametrize("wire, message", [
    ([1, 2], "segment: expected an object"),
    (_set(["name"], ...), "segment.name: missing"),
    (_set(["name"], ""), "segment.name: expected a non-empty string"),
    (_set(["name"], 5), "segment.name: expected a string"),
    (_set(["transport"], "udp"), "segment.transport: expected one of"),
    (_set(["transport"], ...), "segment.transport: missing"),
    (_set(["regions"], {"id": 0}), "segment.regions: expected a list"),
    (_set(["regions", 0], "r0"), "segment.regions[0]: expected an object"),
    (_set(["regions", 0, "id"], "0"), "segment.regions[0].id: expected an integer"),
    (_set(["regions", 0, "id"], True), "segment.regions[0].id: expected an integer"),
    (_set(["regions", 1, "length"], -1), "segment.regions[1].length: expected an integer >= 0"),
    (_set(["regions", 1, "length"], 1.5), "segment.regions[1].length: expected an integer"),
    (_set(["regions", 0, "location"], ...), "segment.regions[0].location: missing"),
    (_set(["regions", 1, "id"], 0), "segment.regions[1].id: duplicate 0"),
    (_set(["regions", 0, "rdma"], [1]), "segment.regions[0].rdma: expected an object"),
    (_set(["regions", 0, "rdma", "mlx5_1", "rkey"], "k"),
     "segment.regions[0].rdma['mlx5_1'].rkey: expected an integer"),
    (_set(["regions", 0, "rdma", "mlx5_0", "addr"], ...), "segment.regions[0].rdma['mlx5_0'].addr: missing"),
    (_set(["nics"], ...), "segment.nics: missing"),
    (_set(["nics", 0, "port"], "7000"), "segment.nics[0].port: expected an integer"),
    (_set(["nics", 1, "port"], 70000), "segment.nics[1].port: expected an integer in [1, 65535]"),
    (_set(["nics", 0, "port"], 0), "segment.nics[0].port: expected an integer in [1, 65535]"),
    (_set(["nics", 0, "host"], ""), "segment.nics[0].host: expected a non-empty string"),
    (_set(["nics", 1, "name"], None), "segment.nics[1].name: expected a string"),
    (_set(["nics", 1, "name"], "mlx5_0"), "segment.nics[1].name: duplicate 'mlx5_0'"),
    (_set(["topology"], ...), "segment.topology: missing"),
    (_set(["topology"], [["a"], []]), "segment.topology: expected an object"),
    (_set(["topology", "*"], [["mlx5_0"]]), "segment.topology['*']: expected [[preferred nics], [secondary nics]]"),
    (_set(["topology", "*"], ["mlx5_0", []]), "segment.topology['*'][0]: expected a list"),
    (_set(["topology", "cpu:0"], [["mlx5_0"], [3]]), "segment.topology['cpu:0'][1][0]: expected a string"),
])
def test_malformed_descriptor_names_the_field(wire, message):
    with pytest.raises(ValueError) as e:
        SegmentDescriptor.from_wire(wire)
    assert str(e.value).startswith(message), str(e.value)


async def test_engine_descriptor_is_the_wire_dict():
    async with TransferEngine(TransferConfig(transport="tcp"), "A") as eng:
        eng.register_local_memory(bytearray(100), "cpu:0")
        wire = eng.segment_descriptor()
        assert wire == eng.descriptor().to_wire()
        assert set(wire) == {"name", "transport", "regions", "nics", "topology"}
        assert wire["regions"] == [{"id": 0, "length": 100, "location": "cpu:0"}]
        assert SegmentDescriptor.from_wire(wire) == eng.descriptor()
        with pytest.raises(ValueError, match=r"segment\.nics\[0\]\.port: expected an integer"):
            eng.add_segment(_set(["nics", 0, "port"], "x"))


@pytest.mark.parametrize("typed", [False, True])
async def test_resolver_may_answer_dict_or_descriptor(typed):
    cfg = TransferConfig(transport="tcp")
    async with TransferEngine(cfg, "A") as a, TransferEngine(cfg, "B") as b:
        dst = bytearray(64)
        b.register_local_memory(dst)
        src = bytearray(range(64))
        r = a.register_local_memory(src)

        async def resolve(name):
            if name != "B":
                return None
            return b.descriptor() if typed else b.segment_descriptor()

        a.set_resolver(resolve)
        await a.transfer([TransferRequest(WRITE, r.id, 0, 64, "B", 0)])
        assert dst == src
