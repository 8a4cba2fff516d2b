"""Image affinity across preprocessor replicas, end to end: what a repeated image costs with the gateway's affinity
key hashed by Envoy (the generated egress, ``generate.loopback(caller="gateway")``: a MAGLEV twin of the cluster for
requests carrying ``x-embedmesh-affinity``) and without it (the same config, twins taken out, ROUND_ROBIN), in one run.

Processes, all real and on loopback: two echo workers, two preprocessor replicas (each its own in-process
EfficientNet-Lite0 encoder and L1 cache), the two Envoys in front of the same two replicas, and one gateway in front
of each Envoy. Each image (scikit-image's chelsea.png, 451 x 300, with a few pixels changed so every image is new to
every cache) is sent twice through one gateway (chat completion, ``max_tokens`` 1, over httpx keep-alive): the first
send decodes and encodes it; the repeat is what affinity is about. Round robin alternates the replicas over the
gateway's one connection, so its repeat always lands on the replica that has not seen the image; affinity sends it
to the one that has (an L1 hit). Images alternate between the two gateways, so machine load hits both alike.

Phase "no Redis": a repeat on the other replica decodes and encodes again. Phase "Redis L2" (one real
redis-server, ``REDIS_URL`` on both replicas; skipped with ``--no-redis``): it decodes and finds the rows in L2.
Medians per phase and mode, encodes counted by the replicas' own ``embedmesh_image_encodes_total``; ``text only``
is the same request without an image (the front door and the echo worker, for reading the rest).

    .venv/bin/python bench/bench_image_affinity.py [--quick] [--images 30] [--no-redis]

The last line: ``image_affinity: repeat_p50_affinity_over_rr=X`` (no Redis).
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import io
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.envoy import affinity_healthy, generator, round_robin  # noqa: E402
from tests.support.mesh import free_port  # noqa: E402

HEADER = "x-embedmesh-affinity"
START_TIMEOUT_S = 120.0


def images(count: int, offset: int) -> list[str]:
    """``count`` data: URLs of chelsea.png, each with its own few pixels changed (a new pixel digest each)."""
    path = Path(str(importlib.metadata.distribution("scikit-image").locate_file("skimage/data/chelsea.png")))
    base = np.array(Image.open(path).convert("RGB"))
    out = []
    for i in range(offset, offset + count):
        px = base.copy()
        px[i % px.shape[0], :8] = (i * 7) % 256
        px[(i // px.shape[0]) % px.shape[0], 8:16] = (i * 13) % 256
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, "PNG")
        out.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return out


class Processes:
    """Started processes (their own sessions), stopped in reverse order by pid."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, args: list[str], name: str, env: dict[str, str] | None = None) -> None:
        with open(self.logs / f"{name}.log", "wb") as out:
            self.procs.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                               env={**os.environ, "EMBEDMESH_TRACE_CONSOLE": "0", **(env or {})}))

    def wait(self, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except (OSError, httpx.HTTPError):
                pass
            time.sleep(0.1)
        tails = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.logs.glob("*.log")))
        raise RuntimeError(f"{what} not within {START_TIMEOUT_S} s\n{tails}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


def encodes(metrics_ports: list[int]) -> int:
    total = 0.0
    for port in metrics_ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        total += sum(float(v) for v in re.findall(r"^embedmesh_image_encodes_total(?:\{[^}]*\})? (\S+)$", text, re.M))
    return int(total)


def start(procs: Processes, redis_url: str | None) -> tuple[dict[str, str], list[int]]:
    """The two replicas, the two Envoys and a gateway per Envoy: ({mode: gateway URL}, the replicas' metrics ports)."""
    envoy = str(Path(sys.executable).parent / "envoy")
    pres, metrics = [], []
    for name in ("a", "b"):
        worker, pre, mport = free_port(), free_port(), free_port()
        procs.spawn([sys.executable, "-m", "embedmesh.services.worker.main", "--engine", "echo", "--port",
                     str(worker)], f"worker-{name}")
        procs.spawn([sys.executable, "-m", "embedmesh.services.preprocessor.main", "--port", str(pre), "--workers",
                     f"127.0.0.1:{worker}", "--metrics-port", str(mport)], f"preprocessor-{name}",
                    env={"REDIS_URL": redis_url} if redis_url else None)
        pres.append(f"127.0.0.1:{pre}")
        metrics.append(mport)
    mesh = yaml.safe_load((ROOT / "deploy" / "mesh.yaml").read_text())
    gateways, admins = {}, []
    for mode in ("affinity", "round robin"):
        listen, admin, gw = free_port(), free_port(), free_port()
        config = generator().loopback(mesh, listen_port=listen, endpoints=pres, admin_port=admin, caller="gateway")
        if mode == "round robin":
            config = round_robin(config)
        path = procs.logs / f"envoy-{mode.replace(' ', '-')}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        procs.spawn([envoy, "-c", str(path), "--disable-hot-restart", "--log-level", "warning"],
                    f"envoy-{mode.replace(' ', '-')}")
        procs.spawn([sys.executable, "-m", "embedmesh.gateway.main", "--port", str(gw), "--preprocessor",
                     f"127.0.0.1:{listen}"], f"gateway-{mode.replace(' ', '-')}")
        gateways[mode] = f"http://127.0.0.1:{gw}"
        admins.append(admin)
    for admin in admins:
        procs.wait("Envoy sees both replicas healthy", lambda admin=admin: affinity_healthy(admin))
    for url in gateways.values():
        procs.wait("gateway up", lambda url=url: httpx.get(f"{url}/health", timeout=1).status_code == 200)
    return gateways, metrics


def chat(client: httpx.Client, url: str, model: str, image: str | None) -> float:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is in the picture?"}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    t = time.perf_counter()
    r = client.post(f"{url}/v1/chat/completions", json={"model": model, "max_tokens": 1,
                                                        "messages": [{"role": "user", "content": content}]})
    spent = time.perf_counter() - t
    r.raise_for_status()
    return spent


def phase(name: str, count: int, redis_url: str | None, logs: Path) -> dict[str, Any]:
    procs = Processes(logs)
    try:
        gateways, metrics = start(procs, redis_url)
        with httpx.Client(timeout=120) as client:
            model = client.get(f"{gateways['affinity']}/v1/models").json()["data"][0]["id"]
            for image in images(2, 10_000):  # warm-up: round robin loads each replica's encoder once
                chat(client, gateways["round robin"], model, image)
            for _ in range(5):
                chat(client, gateways["affinity"], model, None)
            sent = {"affinity": images(count, 0), "round robin": images(count, count)}
            first: dict[str, list[float]] = {m: [] for m in sent}
            repeat: dict[str, list[float]] = {m: [] for m in sent}
            encoded = dict.fromkeys(sent, 0)
            text = []
            for i in range(count):
                for mode, url in gateways.items():
                    before = encodes(metrics)
                    first[mode].append(chat(client, url, model, sent[mode][i]))
                    repeat[mode].append(chat(client, url, model, sent[mode][i]))
                    encoded[mode] += encodes(metrics) - before
                text.append(chat(client, gateways["affinity"], model, None))
    finally:
        procs.stop()
    return {"name": name, "count": count, "text": statistics.median(text) * 1e3,
            "first": {m: statistics.median(v) * 1e3 for m, v in first.items()},
            "repeat": {m: statistics.median(v) * 1e3 for m, v in repeat.items()}, "encodes": encoded}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=30, help="fresh images per mode and phase, each sent twice")
    p.add_argument("--quick", action="store_true", help="8 images per mode and phase")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis L2 phase")
    a = p.parse_args()
    count = 8 if a.quick else a.images
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-image-affinity-") as tmp:
        logs = Path(tmp)
        results.append(phase("no Redis", count, None, logs))
        if not a.no_redis:
            from tests.support.redis_server import RedisServer

            server = RedisServer().start()
            try:
                results.append(phase("Redis L2", count, server.url, logs))
            finally:
                server.close()
    print(f"{count} images per mode and phase (451x300 PNG, each sent twice through the gateway), 2 preprocessor "
          "replicas behind Envoy, echo workers, max_tokens 1; p50 per request, ms")
    print()
    print("| phase | mode | first send p50 | repeat p50 | encodes | text-only p50 |")
    print("|---|---|---|---|---|---|")
    for r in results:
        for mode in ("affinity", "round robin"):
            print(f"| {r['name']} | {mode} | {r['first'][mode]:.1f} | {r['repeat'][mode]:.1f} | "
                  f"{r['encodes'][mode]} / {r['count']} images | {r['text']:.1f} |")
    print()
    for r in results[1:]:
        ratio = r["repeat"]["affinity"] / r["repeat"]["round robin"]
        print(f"image_affinity_redis: repeat_p50_affinity_over_rr={ratio:.3f}")
    r = results[0]
    print(f"image_affinity: repeat_p50_affinity_over_rr={r['repeat']['affinity'] / r['repeat']['round robin']:.3f}")


if __name__ == "__main__":
    main()
