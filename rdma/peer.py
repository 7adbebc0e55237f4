"""A transfer-engine peer in its own process, driven over stdin/stdout.

Used by the tests and the benchmark to get a real second process:

    python -m rdma.peer --name B --size 1048576 [--nics a,b] [--token T]

prints its segment descriptor as one JSON line, then answers commands,
one per line, with one JSON line each:

    fill SEED              fill the region with deterministic bytes
    sha OFFSET LENGTH      sha256 of a range of the region
    stats                  engine stats
    guard PAGE_BYTES       guard the region with PageGrants over pages of
                           PAGE_BYTES, grant every page; -> {"capability": c}
    quit                   exit

It exits when stdin closes, so a killed parent leaves no orphan.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys

from .config import TransferConfig
from .engine import TransferEngine
from .guard import PageGrants


def pattern(seed: int, n: int) -> bytes:
    """Deterministic, position-dependent bytes (a hash chain; cheap for MBs)."""
    out = bytearray()
    block, i = b"", 0
    while len(out) < n:
        block = hashlib.sha512(seed.to_bytes(8, "little") + i.to_bytes(8, "little")).digest() * 64
        out += block
        i += 1
    return bytes(out[:n])


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--nics", default="127.0.0.1")
    ap.add_argument("--token", default="")
    ap.add_argument("--set", action="append", default=[], help="config key=value (json value)")
    a = ap.parse_args(argv)
    kw = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    cfg = TransferConfig(transport="tcp", nics=a.nics.split(","), auth_token=a.token, **kw)
    eng = TransferEngine(cfg, a.name)
    await eng.start()
    buf = bytearray(a.size)
    region = eng.register_local_memory(buf)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def reply(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply(eng.segment_descriptor())
    while True:
        line = (await reader.readline()).decode().split()
        if not line or line[0] == "quit":
            break
        cmd = line[0]
        if cmd == "fill":
            buf[:] = pattern(int(line[1]), a.size)
            reply({"ok": True})
        elif cmd == "sha":
            off, n = int(line[1]), int(line[2])
            reply({"sha": hashlib.sha256(region.view[off:off + n]).hexdigest()})
        elif cmd == "stats":
            reply(eng.stats())
        elif cmd == "guard":
            grants = PageGrants(int(line[1]))
            eng.set_write_guard(region.id, grants)
            reply({"capability": grants.grant(range(-(-a.size // grants.page_bytes)))})
        else:
            reply({"error": f"unknown command {cmd}"})
    await eng.close()


if __name__ == "__main__":
    asyncio.run(main())


class PeerProcess:
    """Parent-side handle of a ``python -m rdma.peer`` child (tests, bench)."""

    def __init__(self, name: str, size: int, nics: str = "127.0.0.1", token: str = "",
                 settings: dict | None = None, prefix: list[str] | None = None, cwd: str | None = None) -> None:
        import os
        import subprocess
        root = cwd or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cmd = list(prefix or []) + [sys.executable, "-m", "rdma.peer", "--name", name, "--size", str(size),
                                     "--nics", nics, "--token", token]
        for k, v in (settings or {}).items():
            cmd += ["--set", f"{k}={json.dumps(v)}"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=root, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(5)
            raise RuntimeError(f"peer {name} failed to start (rc={self.proc.returncode})")
        self.descriptor: dict = json.loads(line)

    def cmd(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError("peer exited")
        return json.loads(out)

    def sha(self, offset: int, length: int) -> str:
        return self.cmd(f"sha {offset} {length}")["sha"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(5)
            except Exception:
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass
