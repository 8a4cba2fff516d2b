"""Two (or more) git trees' meshes side by side: each tree's echo mesh up at once, bench_peers.py's first three
shapes (its bodies and client counts) sent to each in interleaved rounds, and the on-CPU time per request of each
service read from ``/proc/<pid>/task/*/schedstat`` (nanoseconds, not the 10 ms ticks of ``/proc/<pid>/stat``), so
a change is measured against the code before it on the same machine in the same minutes (other load moves both).
Prints per shape the median of the rounds per tree and per service, and the paired per-round change of each tree
against the first. ``--py-spy PATH`` instead records the first tree's preprocessor and gateway under each shape and
prints where their samples go (``profile_front_door.summarize``). Findings: docs/perf/front-door.md.

    git worktree add --detach /tmp/wt_before <rev>   # then in it: PYTHON=.venv/bin/python bash scripts/gen_protos.sh
    python bench/ab_trees.py --rounds 20 --requests 800 /tmp/wt_before /path/to/new/tree
    python bench/ab_trees.py --py-spy ~/.cache/embedmesh/venvs/tools/bin/py-spy --seconds 12 .
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_peers import MODEL, SHAPES, Shape, _body, tree_cpu  # noqa: E402
from flamegraphs import service_pids  # noqa: E402

from tests.support.mesh import Mesh, start_mesh  # noqa: E402

WHO = ("gateway", "preprocessor", "worker")


def on_cpu(pid: int) -> float:
    """On-CPU seconds of ``pid`` and its descendants, every thread (schedstat)."""
    total = 0
    for p in tree_cpu([pid]):
        for f in glob.glob(f"/proc/{p}/task/*/schedstat"):
            try:
                total += int(Path(f).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass  # a thread that ended between the listing and the read
    return total / 1e9


async def send(url: str, shape: Shape, n: int) -> None:
    """``n`` requests of ``shape`` from ``shape.clients`` concurrent clients."""
    import aiohttp

    body, left = _body(shape), [n]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as s:
        async def client() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with s.post(url + shape.path, data=body, headers={"content-type": "application/json"}) as r:
                    await r.read()
                    assert r.status == 200, r.status

        await asyncio.gather(*[client() for _ in range(shape.clients)])


def start(tree: Path) -> tuple[Mesh, dict[str, int]]:
    """The echo mesh of ``tree`` (its sources and generated protos on the services' PYTHONPATH)."""
    path = ":".join(str(tree / p) for p in ("clients/python/src", "gateway", "gen/python", "services"))
    mesh = start_mesh(engine=MODEL, env={"PYTHONPATH": path})
    return mesh, {k: int(v) for k, v in service_pids(mesh.proc.pid).items() if k in WHO}


def ab(trees: list[Path], rounds: int, requests: int) -> None:
    shapes = SHAPES[:3]
    meshes: list[tuple[str, Mesh, dict[str, int]]] = []
    try:
        for tree in trees:
            meshes.append((str(tree), *start(tree)))
        for shape in shapes:  # warm-up: connections, caches, lazily made threads
            for _, mesh, _ in meshes:
                asyncio.run(send(mesh.base_url, shape, 100))
        got: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
        for r in range(rounds):
            for shape in shapes:
                for name, mesh, roots in (meshes if r % 2 == 0 else meshes[::-1]):
                    n = requests if shape.clients > 1 else requests * 3 // 8
                    before = {w: on_cpu(p) for w, p in roots.items()}
                    asyncio.run(send(mesh.base_url, shape, n))
                    got[(name, shape.name)].append({w: (on_cpu(p) - before[w]) / n * 1e3 for w, p in roots.items()})
            print(f"round {r + 1}/{rounds} {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}", flush=True)
        print(f"\non-CPU ms per request (schedstat), median of {rounds} interleaved rounds [lowest-highest round]")
        for shape in shapes:
            print(shape.name)
            first = [sum(x.values()) for x in got[(meshes[0][0], shape.name)]]
            for name, _, _ in meshes:
                rows = got[(name, shape.name)]
                sums = [sum(x.values()) for x in rows]
                per = ", ".join(f"{w} {statistics.median(x[w] for x in rows):.3f}" for w in WHO)
                paired = sorted(100 * (b - a) / a for a, b in zip(first, sums, strict=True))
                change = f"; paired change vs the first tree: median {statistics.median(paired):+.1f} %" \
                    f" [{paired[0]:+.0f} .. {paired[-1]:+.0f}]" if name != meshes[0][0] else ""
                print(f"  {name}: {statistics.median(sums):.3f} [{min(sums):.2f}-{max(sums):.2f}] ({per}){change}")
    finally:
        for _, mesh, _ in meshes:
            mesh.stop()


def profile(tree: Path, py_spy: str, seconds: float) -> None:
    from profile_front_door import summarize

    folder = Path(tempfile.mkdtemp(prefix="ab-trees-py-spy-"))
    mesh, roots = start(tree)
    try:
        for shape in SHAPES[:3]:
            asyncio.run(send(mesh.base_url, shape, 200))
            files = {w: folder / f"{w}-{shape.path.rsplit('/', 1)[-1]}-{shape.clients}.txt" for w in roots}
            spies = [subprocess.Popen([py_spy, "record", "-p", str(pid), "-f", "raw", "-o", str(files[w]), "-r", "200",
                                       "-d", str(int(seconds)), "--nonblocking"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL) for w, pid in roots.items()]
            before = {w: on_cpu(p) for w, p in roots.items()}
            n, stop = 0, time.monotonic() + seconds
            while time.monotonic() < stop:
                asyncio.run(send(mesh.base_url, shape, 200))
                n += 200
            cpu = {w: (on_cpu(p) - before[w]) / n * 1e3 for w, p in roots.items()}
            for s in spies:
                s.wait(timeout=120)
            print(f"\n== {shape.name}: {n} requests; on-CPU ms/request "
                  + ", ".join(f"{w} {c:.2f}" for w, c in cpu.items()))
            for w in ("preprocessor", "gateway"):
                print(f"-- {w}\n" + "\n".join(summarize(files[w], n, cpu[w], 30)))
        print(f"\nraw stacks in {folder}")
    finally:
        mesh.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", type=Path, help="git trees with gen/python built (the first is the baseline)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--requests", type=int, default=800, help="per round and tree (the 1-client shape: 3/8 of it)")
    p.add_argument("--py-spy", default="", help="profile the first tree instead (py-spy's path)")
    p.add_argument("--seconds", type=float, default=12.0)
    a: Any = p.parse_args()
    if a.py_spy:
        profile(a.trees[0].resolve(), a.py_spy, a.seconds)
    else:
        ab([t.resolve() for t in a.trees], a.rounds, a.requests)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
