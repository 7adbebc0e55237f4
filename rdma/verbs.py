"""RDMA transport via pyverbs (rdma-core's Python binding)."""

from __future__ import annotations

import sys

_DEBIAN_DIST = "/usr/lib/python3/dist-packages"


def import_pyverbs():
    """Import pyverbs lazily; Debian's python3-pyverbs lives outside the venv."""
    try:
        import pyverbs  # noqa: F401
    except ImportError:
        if _DEBIAN_DIST not in sys.path:
            sys.path.append(_DEBIAN_DIST)
        import pyverbs  # noqa: F401
    import pyverbs.device as device
    return device


def probe() -> tuple[bool, str]:
    """(True, device names) when an RDMA device is usable, else (False, why)."""
    try:
        device = import_pyverbs()
    except ImportError as e:
        return False, f"pyverbs not installed ({e})"
    try:
        devs = device.get_device_list()
    except Exception as e:  # PyverbsRDMAError: no devices / no rdma-core provider
        return False, f"{type(e).__name__}: {e}"
    if not devs:
        return False, "no RDMA devices"
    return True, ",".join(d.name.decode() for d in devs)
