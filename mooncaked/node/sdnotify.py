"""systemd readiness notification (sd_notify) without libsystemd.

With ``Type=notify`` systemd sets ``$NOTIFY_SOCKET`` to a datagram socket;
the daemon sends ``READY=1`` once it takes work and ``STOPPING=1`` when it
begins a graceful shutdown.  Outside systemd the variable is unset and every
call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("mooncaked.sdnotify")


def notify(state: str) -> bool:
    """Send one notification; returns True if a socket was there to take it."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
    except OSError as exc:
        log.warning("sd_notify(%s) to %s failed: %s", state, address, exc)
        return False
    return True
