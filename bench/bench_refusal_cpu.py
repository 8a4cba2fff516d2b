"""What a refused request of a tenant at its share costs the gateway: answered by its HTTP protocol from the
headers (``gateway/protocol.py``, ``tenant_admission.py``) or, as before, by the app's own admission (the same
protocol with its tenant check off, so the request reaches Starlette). The real gateway app on uvicorn in its own
process; the tenant (``max_concurrent_requests`` 1) holds one request, then sends N small completions one after
another on one kept-alive connection, each answered 429. Reported: the gateway process's CPU per refused request,
rounds alternated, and the ratio of the medians.

    python bench/bench_refusal_cpu.py [--requests N] [--rounds R]

Last line: ``refusal_cpu: protocol_us=.. app_us=.. ratio=..``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

KEY = "tenant-at-share-0001"
_SERVER = r"""
import asyncio, sys
import uvicorn
from starlette.responses import Response
from starlette.routing import Route
from embedmesh.core import auth
from embedmesh.gateway import GatewayConfig, create_app
from embedmesh.gateway.protocol import GatewayHttpProtocol

class InApp(GatewayHttpProtocol):
    def _admit_tenant(self, key):
        return None, None  # the app's own admission answers

async def main():
    auth.configure_keys(auth.KeyRing([auth.ApiKey(auth._digest(sys.argv[2]), "tenant", max_concurrent_requests=1)]))
    async def hold(request):
        await asyncio.Event().wait()
    app = create_app(GatewayConfig(preprocessor="127.0.0.1:1", max_inflight=64),
                     extra_routes=[lambda gw: [Route("/v1/hold", hold, methods=["POST"])]])
    proto = GatewayHttpProtocol if sys.argv[1] == "protocol" else InApp
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="off",
                                           http=proto, access_log=False))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    print(server.servers[0].sockets[0].getsockname()[1], flush=True)
    await task

asyncio.run(main())
"""
_BODY = b'{"model": "m", "prompt": "hello there", "max_tokens": 4}'


def _request(path: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(_BODY)}\r\n\r\n").encode() + _BODY


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _refusals(port: int, n: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        req, buf = _request("/v1/completions"), b""
        for _ in range(n):
            s.sendall(req)
            while True:
                head, sep, rest = buf.partition(b"\r\n\r\n")
                if sep:
                    length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
                    if len(rest) >= length:
                        break
                data = s.recv(65536)
                if not data:
                    raise SystemExit("the gateway closed the connection")
                buf += data
            if not head.startswith(b"HTTP/1.1 429"):
                raise SystemExit(f"expected 429, got {head[:40]!r}")
            buf = rest[length:]


def _round(mode: str, n: int) -> float:
    root = Path(__file__).resolve().parents[1]
    paths = [root / "gateway", root / "services", root / "gen" / "python"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, mode, KEY], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        held = socket.create_connection(("127.0.0.1", port))
        held.sendall(_request("/v1/hold"))  # the tenant's one request in flight
        _refusals(port, 200)  # warm-up (imports, first route matches)
        before = _cpu_s(proc.pid)
        _refusals(port, n)
        used = _cpu_s(proc.pid) - before
        held.close()
        return used / n * 1e6
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    got: dict[str, list[float]] = {"protocol": [], "app": []}
    for _ in range(a.rounds):
        for mode in got:
            got[mode].append(_round(mode, a.requests))
    print(f"refusal_cpu: {a.requests} refused small completions of a tenant at its share, one kept-alive connection, "
          f"{a.rounds} alternated rounds; the gateway's CPU per refused request (us)")
    print("\n| answered by | rounds (us) | median (us) |\n|---|---|---|")
    for mode, xs in got.items():
        print(f"| {mode} | {', '.join(f'{x:.0f}' for x in xs)} | {statistics.median(xs):.0f} |")
    p, q = statistics.median(got["protocol"]), statistics.median(got["app"])
    print(f"\nrefusal_cpu: protocol_us={p:.0f} app_us={q:.0f} ratio={p / q:.2f}")


if __name__ == "__main__":
    main()
