"""The cluster's metadata in etcd: a small typed wrapper over the v3 API.

Keys, all under ``<etcd.key_prefix>/<etcd.cluster>/`` (docs/etcd.md):

  nodes/<node_id>        NodeRegistration (JSON) under the node's own lease:
                         address, role, capacity, transfer segment and NIC
                         descriptor.  A node that stops renewing disappears
                         when its lease expires.
  conductors/<id>        ConductorRecord under that conductor's lease: every
                         conductor that runs, leader or standby.
  conductor/leader       ConductorRecord of the leader, created only when
                         absent (a transaction) under the leader's lease.

Every call is bounded by ``etcd.request_timeout_s`` and any failure to talk
to etcd raises ``EtcdUnavailable`` (the next call tries the next endpoint), so
callers see one error type whatever the client library raises.  The client
(``aetcd``, gRPC v3 API, checked against etcd 3.4) is imported on first use:
without etcd configured it is never loaded.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

import orjson

from mooncaked.node.messages import Message, MessageError, NodeRegistration, name, wire
from mooncaked.node.sections import EtcdSection

log = logging.getLogger("mooncaked.etcd")


class EtcdUnavailable(Exception):
    """etcd did not answer (down, partitioned, or slower than the timeout)."""


@dataclass(frozen=True)
class ConductorRecord(Message):
    """A conductor as etcd knows it: the value of conductors/<id> and of the leader key.
    ``incarnation`` is random per process, so a conductor restarted under the
    same id never mistakes its dead predecessor's leader key for its own."""
    WHERE = "conductor"
    conductor_id: str = wire(name)
    url: str = wire(name)
    incarnation: str = wire(name)


def encode(message: Message) -> bytes:
    return orjson.dumps(message.to_wire())


def decode_conductor(raw: bytes) -> ConductorRecord | None:
    """The record in a leader/conductor key; None (logged) when it does not decode."""
    try:
        return ConductorRecord.from_wire(orjson.loads(raw))
    except (orjson.JSONDecodeError, MessageError) as exc:
        log.error("unreadable conductor record in etcd (%s): ignored", exc)
        return None


def decode_node(raw: bytes) -> NodeRegistration | None:
    try:
        return NodeRegistration.from_wire(orjson.loads(raw))
    except (orjson.JSONDecodeError, MessageError) as exc:
        log.error("unreadable node record in etcd (%s): ignored", exc)
        return None


class EtcdKeys:
    """The key layout of one cluster."""

    def __init__(self, key_prefix: str, cluster: str) -> None:
        self.root = f"{key_prefix}/{cluster}/".encode()
        self.nodes = self.root + b"nodes/"
        self.conductors = self.root + b"conductors/"
        self.leader = self.root + b"conductor/leader"

    def node(self, node_id: str) -> bytes:
        return self.nodes + node_id.encode()

    def conductor(self, conductor_id: str) -> bytes:
        return self.conductors + conductor_id.encode()


def _import_aetcd() -> Any:
    try:
        import aetcd
    except ImportError:
        raise EtcdUnavailable(
            "etcd.endpoints is set but the etcd client is not installed: "
            "pip install aetcd (a dependency of mooncaked)") from None
    return aetcd


class EtcdStore:
    """One connection to the etcd cluster (rotating over ``endpoints`` on failure)."""

    def __init__(self, section: EtcdSection) -> None:
        if not section.endpoints:
            raise ValueError("EtcdStore needs etcd.endpoints")
        self.section = section
        self.keys = EtcdKeys(section.key_prefix, section.cluster)
        self.timeout_s = section.request_timeout_s
        self._aetcd = _import_aetcd()
        self._endpoint = 0
        self._client: Any = None

    @property
    def endpoint(self) -> str:
        return self.section.endpoints[self._endpoint]

    def _new_client(self) -> Any:
        host, _, port = self.endpoint.rpartition(":")
        # Keepalive pings notice a dead etcd on an idle watch stream.  A
        # channel of its own subchannels: by default gRPC shares them
        # process-wide by target, so the channel made after a failure
        # inherited the failed one's reconnect backoff (growing to tens of
        # seconds while etcd was down) and kept refusing calls with "failed
        # to connect to all addresses" well after etcd was back.
        return self._aetcd.Client(host=host, port=int(port), options={
            "grpc.keepalive_time_ms": 2000, "grpc.keepalive_timeout_ms": 1000,
            "grpc.keepalive_permit_without_calls": 1, "grpc.use_local_subchannel_pool": 1})

    def _connection(self) -> Any:
        if self._client is None:
            self._client = self._new_client()
        return self._client

    def _next_endpoint(self) -> None:
        """The next connection opened goes to the next endpoint."""
        self._endpoint = (self._endpoint + 1) % len(self.section.endpoints)

    async def _drop_connection(self, client: Any) -> None:
        """Give up ``client`` after a failed call: the next call opens a new
        connection to the next endpoint.  Only the connection the call used
        is dropped: one that another caller has opened since is left alone."""
        if client is not self._client:
            return
        self._client = None
        self._next_endpoint()
        await _close_quietly(client, self.timeout_s)

    async def _call_on(self, client: Any, what: str, method: str, *args: Any,
                       **kwargs: Any) -> Any:
        """``method`` on ``client`` within the timeout; any failure raises
        EtcdUnavailable (what to do with the client is the caller's)."""
        endpoint = self.endpoint
        try:
            async with asyncio.timeout(self.timeout_s):
                return await getattr(client, method)(*args, **kwargs)
        except asyncio.CancelledError:
            if _cancelled_by_caller():
                raise
            failure = "its connection was closed under it"
        except Exception as exc:  # noqa: BLE001 - grpc/aetcd raise many types; one error for callers
            failure = f"{type(exc).__name__}: {exc or 'timeout'}"
        raise EtcdUnavailable(f"etcd at {endpoint}: {what} failed ({failure})")

    async def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        client = self._connection()
        try:
            return await self._call_on(client, what, method, *args, **kwargs)
        except EtcdUnavailable:
            await self._drop_connection(client)
            raise

    async def close(self) -> None:
        client, self._client = self._client, None
        await _close_quietly(client, self.timeout_s)

    # -- leases ---------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        lease = await self._call("lease grant", "lease", ttl_s)
        return int(lease.id)

    async def refresh(self, lease_id: int) -> bool:
        """Renew a lease; False when etcd no longer has it (it expired)."""
        reply = await self._call("lease keep-alive", "refresh_lease", lease_id)
        return reply is not None and reply.TTL > 0

    async def revoke(self, lease_id: int) -> None:
        """Drop a lease and every key under it (a graceful exit)."""
        await self._call("lease revoke", "revoke_lease", lease_id)

    # -- keys -----------------------------------------------------------------

    async def put(self, key: bytes, value: bytes, lease_id: int | None = None) -> None:
        await self._call("put", "put", key, value, lease=lease_id)

    async def get(self, key: bytes) -> bytes | None:
        """The key's value; None when absent."""
        got = await self._call("get", "get", key)
        return None if got is None else got.value

    async def get_prefix(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        got = await self._call("get prefix", "get_prefix", prefix)
        return [(kv.key, kv.value) for kv in got]

    async def create(self, key: bytes, value: bytes, lease_id: int) -> bool:
        """Put ``key`` only if it does not exist (one transaction): True if we created it."""
        client = self._connection()
        tx = client.transactions
        succeeded, _ = await self._call(
            "transaction", "transaction", compare=[tx.create(key) == 0],
            success=[tx.put(key, value, lease=lease_id)], failure=[])
        return bool(succeeded)

    async def delete_if_value(self, key: bytes, value: bytes) -> bool:
        """Delete ``key`` only while it still holds ``value`` (a leader stepping down)."""
        client = self._connection()
        tx = client.transactions
        succeeded, _ = await self._call(
            "transaction", "transaction", compare=[tx.value(key) == value],
            success=[tx.delete(key)], failure=[])
        return bool(succeeded)

    async def wake_on_changes(self, key: bytes, wake: asyncio.Event, retry_s: float) -> None:
        """Set ``wake`` at every change of ``key``, until cancelled; a broken
        watch is opened again ``retry_s`` later (the callers' rounds go on
        meanwhile, so a missed change only costs a round)."""
        while True:
            try:
                async for _ in self.changes(key):
                    wake.set()
            except EtcdUnavailable as exc:
                log.debug("watch on %s: %s", key.decode(), exc)
            except Exception as exc:  # noqa: BLE001 - the client's stream errors vary
                log.debug("watch on %s failed: %r", key.decode(), exc)
            await asyncio.sleep(retry_s)

    async def changes(self, key: bytes, *, prefix: bool = False) -> AsyncIterator[None]:
        """One item per change of ``key`` (or of the keys under it), as etcd
        reports them; ends with EtcdUnavailable when the watch breaks.  Callers
        re-read the state after each item (a change carries no value here).

        The watch has a connection of its own, closed when it ends: a broken
        watch must not close the connection other calls are using (gRPC ends
        a call whose channel is closed with CancelledError, which once ended
        the election's campaign task for good)."""
        endpoint = self.endpoint
        client = self._new_client()
        method = "watch_prefix" if prefix else "watch"
        try:
            try:
                watch = await self._call_on(client, "watch", method, key)
            except EtcdUnavailable:
                self._next_endpoint()
                raise
            try:
                async for _event in watch:
                    yield None
            except asyncio.CancelledError:
                if _cancelled_by_caller():
                    raise
                raise EtcdUnavailable(f"etcd at {endpoint}: watch closed") from None
            except self._aetcd.exceptions.ClientError as exc:
                raise EtcdUnavailable(f"etcd watch broke ({type(exc).__name__}: {exc})") from None
            finally:
                try:
                    async with asyncio.timeout(self.timeout_s):
                        await watch.cancel()
                except Exception:  # noqa: BLE001 - the stream may already be gone
                    pass
            # The watch ended without an error: the connection went away.
            raise EtcdUnavailable("etcd watch ended")
        finally:
            await _close_quietly(client, self.timeout_s)


def _cancelled_by_caller() -> bool:
    """Whether the current task is being cancelled (by its owner or a timeout).

    gRPC's asyncio API also raises CancelledError in a call whose channel was
    closed meanwhile; that is a failed call, not a cancellation, and must not
    end the caller's task."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _close_quietly(client: Any, timeout_s: float) -> None:
    if client is None:
        return
    try:
        async with asyncio.timeout(timeout_s):
            await client.close()
    except Exception:  # noqa: BLE001 - a broken channel may fail to close; it is dropped
        pass
