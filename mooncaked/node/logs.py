"""One logging setup for every process: one line per event, role in the name."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, role: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log is noisy at info; keep it for debugging only.
    logging.getLogger("aiohttp.access").setLevel(
        logging.DEBUG if level.lower() == "debug" else logging.WARNING)
