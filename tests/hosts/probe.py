"""The clients of the multi-host tests: run inside a namespace (``ip netns exec emh-client python -m
tests.hosts.probe ...``), never in the root one. Every loop here is bounded in time and count.

    health   --url U --ca C [--timeout S]                wait until the gateway's /health says every service serves
    load     --url U --ca C --seconds S --concurrency N --out F [--max-tokens T] [--embeds]
                                                          N clients streaming completions for S seconds; one JSON
                                                          line per request (start, end, ok, error, tokens)
    monitor  --tls-dir D --seconds S --out F [--routers A,B] [--workers A,B] [--metrics U,V] [--caches A,B]
             [--envoy-admin U]                            one JSON line per poll: each router's live workers, each
                                                          worker's completed requests, each preprocessor's router
                                                          fallbacks, each encoder cache's L2 tier, Envoy's hosts
    ingest   --url U --ca C --files N --out F              upload N files and add them to a new vector store
    ingested --url U --ca C --state F --timeout S          wait until every file of that store is done; print counts
    pg-chunks --dsn D --store S                           per file: chunk rows, distinct positions, recorded total
    redis    --addr H:P                                    DBSIZE
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

MODEL = "echo"
HIDDEN = 576
PAYLOADS = 12
ROWS = 24


def _client(ca: str, timeout: float) -> Any:
    import httpx

    return httpx.Client(verify=ca, timeout=timeout)


def cmd_health(a: argparse.Namespace) -> int:
    deadline = time.monotonic() + a.timeout
    last = ""
    with _client(a.ca, 5) as h:
        while time.monotonic() < deadline:
            try:
                r = h.get(f"{a.url}/health")
                last = r.text
                if r.status_code == 200 and r.json().get("status") == "ok":
                    print(last)
                    return 0
            except Exception as e:  # noqa: BLE001 - not up yet
                last = repr(e)
            time.sleep(0.5)
    print(f"not healthy after {a.timeout} s: {last[:2000]}", file=sys.stderr)
    return 1


def _payloads() -> list[str]:
    import numpy as np
    import torch

    out = []
    for i in range(PAYLOADS):
        rows = torch.from_numpy(np.random.default_rng(100 + i).standard_normal((ROWS, HIDDEN), dtype=np.float32))
        buf = io.BytesIO()
        torch.save(rows * 0.02, buf)
        out.append(base64.b64encode(buf.getvalue()).decode())
    return out


def cmd_load(a: argparse.Namespace) -> int:
    payloads = _payloads() if a.embeds else []
    lock = threading.Lock()
    out = open(a.out, "w")  # noqa: SIM115 - closed below
    stop_at = time.time() + a.seconds

    def client(k: int) -> None:
        time.sleep(k * a.stagger)  # clients out of step, so a fault finds streams at every stage
        with _client(a.ca, a.timeout) as h:
            for n in range(100_000):  # bounded: the clock ends it long before
                if time.time() >= stop_at:
                    return
                body: dict[str, Any] = {"model": MODEL, "max_tokens": a.max_tokens, "temperature": 0,
                                        "stream": True, "prompt": f"client {k} request {n}: tell me a story"}
                if payloads:
                    body["prompt"] = ""
                    body["prompt_embeds"] = payloads[(k + n * a.concurrency) % len(payloads)]
                rec: dict[str, Any] = {"client": k, "t0": time.time(), "tokens": 0, "ok": False, "error": ""}
                try:
                    with h.stream("POST", f"{a.url}/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            rec["error"] = f"HTTP {r.status_code} {r.read().decode(errors='replace')[:300]}"
                        else:
                            done = False
                            for line in r.iter_lines():
                                if not line.startswith("data: "):
                                    continue
                                data = line[6:]
                                if data == "[DONE]":
                                    done = True
                                    break
                                event = json.loads(data)
                                if "error" in event:
                                    rec["error"] = json.dumps(event["error"])[:300]
                                    break
                                rec["tokens"] += len(event["choices"][0].get("text", ""))
                            rec["ok"] = done and not rec["error"] and rec["tokens"] == a.max_tokens
                            if done and not rec["error"] and not rec["ok"]:
                                rec["error"] = f"{rec['tokens']} of {a.max_tokens} tokens"
                except Exception as e:  # noqa: BLE001 - every failure is a recorded outcome
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                rec["t1"] = time.time()
                with lock:
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                if not rec["ok"]:
                    time.sleep(0.2)  # a failing mesh is not hammered

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(a.seconds + a.timeout + 30)
    out.close()
    return 0


def _grpc_creds(tls_dir: str) -> Any:
    import grpc

    d = Path(tls_dir)
    return grpc.ssl_channel_credentials(root_certificates=(d / "ca.pem").read_bytes(),
                                        private_key=(d / "client-key.pem").read_bytes(),
                                        certificate_chain=(d / "client.pem").read_bytes())


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})?\s+([0-9.eE+-]+)$", line)
            if m:
                total += float(m.group(2))
    return total


def _envoy_hosts(admin: str) -> dict[str, dict[str, str]]:
    text = urllib.request.urlopen(f"{admin}/clusters", timeout=2).read().decode()
    hosts: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and re.fullmatch(r"[\d.]+:\d+", parts[1]):
            hosts.setdefault(parts[1], {})[parts[2]] = parts[3]
    return {h: {k: v.get(k, "") for k in ("health_flags", "rq_total", "rq_error", "cx_active")}
            for h, v in hosts.items()}


def cmd_monitor(a: argparse.Namespace) -> int:
    import grpc

    from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
    from embedmesh.router.v1 import router_pb2, router_pb2_grpc
    from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

    creds = _grpc_creds(a.tls_dir) if a.tls_dir else None
    token = [("x-embedmesh-mesh-token", a.mesh_token)] if a.mesh_token else []
    chans: dict[str, Any] = {}

    def chan(addr: str) -> Any:
        if addr not in chans:
            chans[addr] = grpc.secure_channel(addr, creds) if creds else grpc.insecure_channel(addr)
        return chans[addr]

    def forget(addr: str) -> None:
        """A failed channel is closed and made anew next poll: gRPC's reconnect backoff would otherwise delay
        seeing a part come back by up to its backoff (seconds), which is the monitor's artefact, not the mesh's."""
        ch = chans.pop(addr, None)
        if ch is not None:
            ch.close()

    split = (lambda s: [x for x in s.split(",") if x])  # noqa: E731
    stop_at = time.time() + a.seconds
    with open(a.out, "w") as out:
        for _ in range(100_000):
            if time.time() >= stop_at:
                break
            snap: dict[str, Any] = {"t": time.time()}
            routers: dict[str, Any] = {}
            for r in split(a.routers):
                try:
                    resp = router_pb2_grpc.RouterServiceStub(chan(r)).ListWorkers(
                        router_pb2.ListWorkersRequest(), timeout=a.rpc_timeout, metadata=token)
                    routers[r] = sorted(w.registration.address for w in resp.workers)
                except grpc.RpcError as e:
                    forget(r)
                    routers[r] = None if e.code() != grpc.StatusCode.PERMISSION_DENIED else e.details()
            snap["routers"] = routers
            workers: dict[str, Any] = {}
            for w in split(a.workers):
                try:
                    s = worker_pb2_grpc.WorkerServiceStub(chan(w)).GetStats(worker_pb2.GetStatsRequest(),
                                                                           timeout=a.rpc_timeout, metadata=token)
                    workers[w] = int(s.completed_requests)
                except grpc.RpcError:
                    forget(w)
                    workers[w] = None
            snap["workers"] = workers
            fallbacks: dict[str, Any] = {}
            for m in split(a.metrics):
                try:
                    text = urllib.request.urlopen(m, timeout=a.rpc_timeout).read().decode()
                    fallbacks[m] = _metric(text, "embedmesh_router_fallback_total")
                except OSError:
                    fallbacks[m] = None
            snap["fallbacks"] = fallbacks
            caches: dict[str, Any] = {}
            for c in split(a.caches):
                try:
                    st = cache_pb2_grpc.EncoderCacheServiceStub(chan(c)).Stats(cache_pb2.StatsRequest(),
                                                                               timeout=a.rpc_timeout, metadata=token)
                    (l2,) = [t for t in st.tiers if t.tier == "l2"]
                    caches[c] = {"available": bool(l2.available), "hits": int(l2.hits),
                                 "unavailable": int(l2.unavailable)}
                except (grpc.RpcError, ValueError):
                    forget(c)
                    caches[c] = None
            snap["caches"] = caches
            if a.envoy_admin:
                try:
                    snap["envoy"] = _envoy_hosts(a.envoy_admin)
                except OSError:
                    snap["envoy"] = None
            out.write(json.dumps(snap) + "\n")
            out.flush()
            time.sleep(max(0.0, a.interval - (time.time() - snap["t"])))
    return 0


def _openai(a: argparse.Namespace) -> Any:
    import httpx
    import openai

    return openai.OpenAI(base_url=f"{a.url}/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(verify=a.ca, timeout=60))


def cmd_ingest(a: argparse.Namespace) -> int:
    import openai

    client = _openai(a)
    store = client.vector_stores.create(name="multihost")
    ids = []
    for i in range(a.files):
        # Distinct text per file (several chunks each), so a lost or doubled file shows in the counts.
        text = "\n\n".join(f"File {i} paragraph {p}: " + " ".join(f"word{i}x{p}x{w}" for w in range(60))
                           for p in range(a.paragraphs))
        ids.append(client.files.create(file=(f"doc-{i}.txt", text.encode()), purpose="assistants").id)
    t_attach = time.time()
    Path(a.out + ".uploaded").write_text(json.dumps({"store": store.id, "files": ids, "t_attach": t_attach}))
    errors: list[str] = []
    for fid in ids:
        # A client retries what the store could not do (a 5xx): adding a file twice must not ingest it twice.
        for attempt in range(10):
            try:
                client.vector_stores.files.create(vector_store_id=store.id, file_id=fid)
                break
            except openai.APIStatusError as e:
                errors.append(f"{e.status_code} {str(e)[:160]}")
                if e.status_code < 500 or attempt == 9:
                    raise
                time.sleep(1)
    Path(a.out).write_text(json.dumps({"store": store.id, "files": ids, "t_attach": t_attach,
                                       "t_attached": time.time(), "errors": errors}))
    return 0


def cmd_ingested(a: argparse.Namespace) -> int:
    client = _openai(a)
    state = json.loads(Path(a.state).read_text())
    deadline = time.monotonic() + a.timeout
    listed: list[Any] = []
    errors: list[str] = []
    while time.monotonic() < deadline:
        try:
            listed = list(client.vector_stores.files.list(vector_store_id=state["store"], limit=100))
            if len(listed) >= len(state["files"]) and all(f.status in ("completed", "failed", "cancelled")
                                                          for f in listed):
                break
        except Exception as e:  # noqa: BLE001 - the store may be reconnecting
            errors.append(f"{type(e).__name__}: {e}"[:200])
        time.sleep(1)
    store = client.vector_stores.retrieve(state["store"])
    print(json.dumps({"listed": [{"id": f.id, "status": f.status,
                                  "error": f.last_error.message if f.last_error else ""} for f in listed],
                      "file_counts": store.file_counts.model_dump(), "t_done": time.time(),
                      "errors": errors[-5:]}))
    return 0


def cmd_pg_chunks(a: argparse.Namespace) -> int:
    """Per file of the store: chunk rows, distinct chunk positions, and the chunk count its ingestion recorded."""
    import psycopg

    with psycopg.connect(a.dsn, connect_timeout=10) as conn:
        rows = conn.execute(
            "SELECT f.file_id, f.chunks_total, count(c.id), count(DISTINCT c.seq) FROM vs_store_files f "
            "LEFT JOIN vs_chunks c ON c.store_id = f.store_id AND c.file_id = f.file_id WHERE f.store_id = %s "
            "GROUP BY f.file_id, f.chunks_total", (a.store,)).fetchall()
        store_rows = conn.execute("SELECT count(*) FROM vs_store_files WHERE store_id = %s", (a.store,)).fetchone()
    print(json.dumps({"files": {r[0]: {"chunks_total": r[1], "rows": r[2], "distinct": r[3]} for r in rows},
                      "store_file_rows": store_rows[0] if store_rows else 0}))
    return 0


def cmd_redis(a: argparse.Namespace) -> int:
    host, port = a.addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=3) as s:
        s.sendall(b"DBSIZE\r\n")
        reply = s.recv(64)
    print(int(reply[1:].split(b"\r\n")[0]))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("health")
    h.add_argument("--url", required=True)
    h.add_argument("--ca", required=True)
    h.add_argument("--timeout", type=float, default=120)
    ld = sub.add_parser("load")
    ld.add_argument("--url", required=True)
    ld.add_argument("--ca", required=True)
    ld.add_argument("--seconds", type=float, required=True)
    ld.add_argument("--concurrency", type=int, default=6)
    ld.add_argument("--max-tokens", type=int, default=8)
    ld.add_argument("--timeout", type=float, default=90)
    ld.add_argument("--embeds", action="store_true")
    ld.add_argument("--stagger", type=float, default=0.3, help="client k starts k times this many seconds late")
    ld.add_argument("--out", required=True)
    m = sub.add_parser("monitor")
    m.add_argument("--tls-dir", default="")
    m.add_argument("--mesh-token", default="")
    m.add_argument("--seconds", type=float, required=True)
    m.add_argument("--interval", type=float, default=0.25)
    m.add_argument("--rpc-timeout", type=float, default=0.5)
    m.add_argument("--routers", default="")
    m.add_argument("--workers", default="")
    m.add_argument("--metrics", default="")
    m.add_argument("--caches", default="")
    m.add_argument("--envoy-admin", default="")
    m.add_argument("--out", required=True)
    i = sub.add_parser("ingest")
    i.add_argument("--url", required=True)
    i.add_argument("--ca", required=True)
    i.add_argument("--files", type=int, default=24)
    i.add_argument("--paragraphs", type=int, default=6)
    i.add_argument("--out", required=True)
    g = sub.add_parser("ingested")
    g.add_argument("--url", required=True)
    g.add_argument("--ca", required=True)
    g.add_argument("--state", required=True)
    g.add_argument("--timeout", type=float, default=180)
    c = sub.add_parser("pg-chunks")
    c.add_argument("--dsn", required=True)
    c.add_argument("--store", required=True)
    r = sub.add_parser("redis")
    r.add_argument("--addr", required=True)
    a = p.parse_args(argv)
    return {"health": cmd_health, "load": cmd_load, "monitor": cmd_monitor, "ingest": cmd_ingest,
            "ingested": cmd_ingested, "pg-chunks": cmd_pg_chunks, "redis": cmd_redis}[a.cmd](a)


if __name__ == "__main__":
    raise SystemExit(main())
