"""What every node's HTTP handlers share: config, lifecycle flags, metrics."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Info
from prometheus_client import ProcessCollector, PlatformCollector

from mooncaked import __version__
from mooncaked.node.config import NodeConfig
from mooncaked.node.membership import ConductorLocator
from mooncaked.node.messages import NodeCapacity, NodeLoad, NodeRegistration


@dataclass
class NodeContext:
    config: NodeConfig
    # Base URL other nodes use to reach this one ("http://host:port"); set
    # once the listening socket is bound, before any role starts.
    url: str = ""
    started_at: float = field(default_factory=time.time)
    started_monotonic: float = field(default_factory=time.monotonic)
    # ready: resources are up and the node takes new work.
    # draining: an operator or a shutdown asked it to stop taking new work.
    ready: bool = False
    draining: bool = False
    metrics: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))
    # Sections that roles add to /admin/status: name -> () -> JSON-able.
    status_providers: dict[str, Callable[[], Any]] = field(default_factory=dict)
    # Sizes of the daemon's long-lived collections for /admin/status
    # "collections" (the soak benchmark watches them): () -> {name: count}.
    # Keep each cheap: it runs on every status request.
    collection_sizes: list[Callable[[], dict[str, int]]] = field(default_factory=list)
    # What this node reports in heartbeats: each role's part of the report,
    # () -> NodeLoad with that role's fields (``load`` merges them).
    load_providers: list[Callable[[], NodeLoad]] = field(default_factory=list)
    # Capacity announced at registration (each role sets its own fields).
    capacity: NodeCapacity = field(default_factory=NodeCapacity)
    # Transfer-engine segment descriptor announced at registration.
    transfer_descriptor: dict[str, Any] = field(default_factory=dict)
    # The conductor a worker talks to: node.conductor_url, or with etcd the
    # current leader (moved by the membership client).  Read it per call.
    conductor: ConductorLocator = field(init=False)

    def __post_init__(self) -> None:
        # With etcd the leader is not known until etcd names it: "" until then
        # (nothing is sent to node.conductor_url, which may be no conductor).
        self.conductor = ConductorLocator("" if self.config.etcd.enabled
                                          else self.config.node.conductor_url)
        ProcessCollector(registry=self.metrics)
        PlatformCollector(registry=self.metrics)
        Info("mooncaked_node", "Node identity", registry=self.metrics).info(
            {"role": self.config.node.role, "version": __version__})
        up = Gauge("mooncaked_node_ready", "1 when the node takes new work", registry=self.metrics)
        up.set_function(lambda: 1.0 if self.taking_work else 0.0)

    @property
    def role(self) -> str:
        return self.config.node.role

    @property
    def node_id(self) -> str:
        return self.config.node.node_id or f"{self.role}-{self.url.removeprefix('http://')}"

    @property
    def taking_work(self) -> bool:
        return self.ready and not self.draining

    def uptime_s(self) -> float:
        return time.monotonic() - self.started_monotonic

    def load(self) -> NodeLoad:
        """The load report: every role's part, and whether the node drains."""
        parts = (provider() for provider in self.load_providers)
        return functools.reduce(NodeLoad.merged, parts, NodeLoad(draining=self.draining))

    def registration(self) -> NodeRegistration:
        """What this node registers with (the conductor, and etcd), checked as
        the conductor decodes it: a bad field fails at start, named."""
        info = NodeRegistration(node_id=self.node_id, role=self.role, url=self.url,
                                capacity=self.capacity, transfer=self.transfer_descriptor,
                                load=self.load())
        return NodeRegistration.from_wire(info.to_wire())


CTX = web.AppKey("ctx", NodeContext)
