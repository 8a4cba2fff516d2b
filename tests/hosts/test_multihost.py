"""Faults on the mesh across hosts (the topology: conftest.py), each under load from the client namespace, each
with its figure — requests failed, seconds until the mesh stops sending to the lost part, seconds to recover after
the repair — written to the docs at the end of the session (``make test-hosts``: docs/multihost.md).

What is asserted is counts and detection, never speed: failures bounded by what was in flight on the lost part,
every request to the surviving parts served, detection and recovery within generous bounds.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.hosts.conftest import ADDR, PREPROCESSORS, ROUTERS, WORKERS, Figure, Mesh, addr, pg_ctl

pytestmark = pytest.mark.e2e

CONCURRENCY = 6
DETECT_BOUND_S = 20.0
"""'Eventually' for detection: the routers sweep a silent worker after 3 s, Envoy checks every 2 s."""
RECOVER_BOUND_S = 60.0
KEEPALIVE_GIVE_UP_S = 30 + 20
"""The latest a gRPC connection whose peer went silent is declared dead: one keepalive interval
(``core.server.KEEPALIVE_MS``) plus gRPC's default keepalive timeout (20 s)."""


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _first(snaps: list[dict[str, Any]], after: float, pred: Any) -> float | None:
    """Seconds from ``after`` to the first snapshot taken after it for which ``pred`` holds."""
    for s in snaps:
        if s["t"] >= after and pred(s):
            return float(s["t"] - after)
    return None


def _failures(recs: list[dict[str, Any]]) -> str:
    return "\n".join(f"{r['t0']:.1f}-{r['t1']:.1f} {r['error']}" for r in recs if not r["ok"])[:3000]


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def _run_load(mesh: Mesh, name: str, seconds: float, *extra: str) -> Path:
    out = mesh.work / f"{name}.jsonl"
    mesh.start_probe(name, "load", "--url", mesh.url, "--ca", mesh.ca, "--seconds", str(seconds),
                     "--concurrency", str(CONCURRENCY), "--out", str(out), *extra)
    return out


def _run_monitor(mesh: Mesh, name: str, seconds: float, *extra: str, host: str = "client") -> Path:
    out = mesh.work / f"{name}.jsonl"
    args = mesh.monitor_args() if host == "client" else []
    mesh.start_probe(name, "monitor", *args, "--seconds", str(seconds), "--out", str(out), *extra, host=host)
    return out


def test_worker_host_link_down_mid_stream_then_back(mesh: Mesh) -> None:
    """w1 (worker-0, worker-1) loses its link while streams run on it: those streams stall (no reset reaches
    anyone), the routers drop w1's workers once their heartbeats stop, every new stream goes to w2; the link
    comes back and w1's workers are routed to and serve again."""
    mesh.wait_settled()
    w1 = sorted(addr(h, p) for h, p in WORKERS.values() if h == "w1")
    load = _run_load(mesh, "load-worker-link", 80, "--max-tokens", "40", "--timeout", "90")
    mon = _run_monitor(mesh, "mon-worker-link", 90)
    t_cut = time.time() + 8
    _sleep_until(t_cut)
    mesh.hosts.link("w1", "down")
    # The first load's clients may all be stuck in streams on w1: fresh clients ask while it is away.
    _sleep_until(t_cut + 7)
    fresh = _run_load(mesh, "load-worker-link-fresh", 6, "--max-tokens", "20", "--stagger", "0.1")
    t_heal = t_cut + 20
    _sleep_until(t_heal)
    mesh.hosts.link("w1", "up")
    mesh.wait_probe("load-worker-link", 80 + 90 + 60)
    mesh.wait_probe("load-worker-link-fresh", 90 + 60)
    mesh.wait_probe("mon-worker-link", 60)
    recs, snaps, fresh_recs = _records(load), _records(mon), _records(fresh)

    def w1_gone(s: dict[str, Any]) -> bool:
        lists = list(s["routers"].values())
        return all(v is not None for v in lists) and not any(w in v for v in lists for w in w1)

    before = [s for s in snaps if s["t"] < t_cut]
    served_before = max(sum(s["workers"][w] or 0 for w in w1) for s in before)
    detect = _first(snaps, t_cut, w1_gone)
    recover = _first(snaps, t_heal, lambda s: all(v is not None and all(w in v for w in w1)
                                                   for v in s["routers"].values())
                     and all(s["workers"][w] is not None for w in w1)
                     and sum(s["workers"][w] for w in w1) > served_before)
    failed = [r for r in recs + fresh_recs if not r["ok"]]
    in_flight = [r for r in recs if r["t0"] < t_cut < r["t1"]]
    stalled = [r for r in recs if r["t0"] < t_cut + (detect or 0) and r["t1"] > t_cut + (detect or 0) + 3]
    stalled_failed = [r for r in stalled if not r["ok"]]
    ended = max((r["t1"] - t_cut for r in stalled), default=0.0)
    late = [r for r in failed if r["t0"] >= t_heal]
    mesh.figures.append(Figure(
        "worker host w1 (2 of 3 workers) link down 20 s mid-stream, then up", len(recs) + len(fresh_recs),
        len(failed), detect, recover, "both routers drop w1's workers",
        "both routers list them again and they complete requests",
        f"{len(in_flight)} streams in flight at the cut; {len(stalled)} stalled on w1 (nothing resets a pulled "
        f"link), {len(stalled_failed)} of them ended as `worker_lost` errors up to {ended:.0f} s after the cut (the "
        "preprocessor's HTTP/2 keepalive: 30 s ping, 20 s timeout); "
        f"{len(fresh_recs)} requests from fresh clients during the outage, all served by w2; {len(late)} requests "
        "failed after the repair (routed to w1 again while a preprocessor still held its stale connection to it, "
        "until that keepalive gave up); "
        "echo workers, 40-token streams"))

    assert detect is not None and detect <= DETECT_BOUND_S, (detect, snaps[-1])
    during = [r for r in fresh_recs if t_cut + detect + 1 <= r["t0"] and r["t1"] < t_heal]
    assert len(during) >= CONCURRENCY, f"too few requests during the outage: {len(during)}"
    assert all(r["ok"] for r in during), _failures(during)  # streams to the surviving host succeed
    # At most one stuck stream per client, plus a request per preprocessor routed to w1 as it re-joins, while
    # that preprocessor's own connection to it is still down; each a clean, retryable error.
    assert len(failed) <= CONCURRENCY + len(PREPROCESSORS), _failures(recs + fresh_recs)
    assert all("worker_lost" in r["error"] for r in failed), _failures(recs + fresh_recs)
    assert recover is not None and recover <= RECOVER_BOUND_S, snaps[-1]
    # Converged: once every connection that crossed the cut is either proven alive again or given up by the
    # keepalive (interval + timeout after the cut, plus a margin), every request is served.
    converged = [r for r in recs if r["t0"] >= t_cut + KEEPALIVE_GIVE_UP_S + 5]
    assert len(converged) >= CONCURRENCY and all(r["ok"] for r in converged), _failures(converged)


def test_preprocessor_replica_killed_under_load_behind_envoy(mesh: Mesh) -> None:
    """preprocessor-b is SIGKILLed while the gateway's Envoy balances every request over both replicas: Envoy's
    active health check marks it failed and sends it nothing more, the other replica serves everything; restarted,
    it is healthy again and gets requests again."""
    mesh.wait_settled()
    p2 = addr(PREPROCESSORS["preprocessor-b"], 50051)
    load = _run_load(mesh, "load-pre-kill", 40, "--max-tokens", "8")
    mon = _run_monitor(mesh, "mon-pre-kill", 55, "--envoy-admin", "http://127.0.0.1:9901", host="gw")
    t_kill = time.time() + 10
    _sleep_until(t_kill)
    mesh.hosts.kill("preprocessor-b", signal.SIGKILL)
    t_restart = t_kill + 12
    _sleep_until(t_restart)
    mesh.hosts.restart("preprocessor-b")
    mesh.wait_probe("load-pre-kill", 40 + 90 + 60)
    mesh.wait_probe("mon-pre-kill", 60)
    recs, snaps = _records(load), [s for s in _records(mon) if s.get("envoy")]

    def p2_state(s: dict[str, Any]) -> dict[str, str]:
        return dict(s["envoy"].get(p2, {}))

    sent_before = max(int(p2_state(s).get("rq_total") or 0) for s in snaps if s["t"] < t_kill)
    assert sent_before > 0, "Envoy sent preprocessor-b nothing before the kill: no balancing"
    detect = _first(snaps, t_kill, lambda s: "failed" in p2_state(s).get("health_flags", ""))
    marked = [s for s in snaps if t_kill <= s["t"]]
    sent_at_mark = int(p2_state(next(s for s in marked if "failed" in p2_state(s).get("health_flags", "")))
                       ["rq_total"]) if detect is not None else 0
    recover = _first(snaps, t_restart, lambda s: p2_state(s).get("health_flags") == "healthy"
                     and int(p2_state(s).get("rq_total") or 0) > sent_at_mark)
    failed = [r for r in recs if not r["ok"]]
    mesh.figures.append(Figure(
        "preprocessor-b SIGKILLed under load behind Envoy, restarted 12 s later", len(recs), len(failed), detect,
        recover, "Envoy's active health check marks it failed", "healthy in Envoy and sent requests again",
        f"{sent_before} requests had gone to it before the kill; 8-token streams"))

    assert detect is not None and detect <= DETECT_BOUND_S, p2_state(snaps[-1])
    assert len(failed) <= CONCURRENCY, _failures(recs)  # at most the streams in flight on it, one per client
    during = [r for r in recs if t_kill + detect + 1 <= r["t0"] and r["t1"] < t_restart]
    assert len(during) >= CONCURRENCY and all(r["ok"] for r in during), _failures(during)
    sent_during = [int(p2_state(s).get("rq_total") or 0) for s in snaps if t_kill + detect < s["t"] < t_restart]
    assert sent_during and max(sent_during) == sent_at_mark, "Envoy sent requests to the failed replica"
    assert recover is not None and recover <= RECOVER_BOUND_S, p2_state(snaps[-1])


def test_router_hosts_partitioned_then_healed(mesh: Mesh) -> None:
    """r1 is partitioned away for 20 s, r2 too for the last 12 of them: with one router left the preprocessors ask
    the other; with none they fall back to their own worker pools (requests keep being served); healed, the workers
    re-register with both routers and routing converges again (no more fallbacks)."""
    mesh.wait_settled()
    want = sorted(addr(h, p) for h, p in WORKERS.values())
    load = _run_load(mesh, "load-router", 50, "--max-tokens", "8")
    mon = _run_monitor(mesh, "mon-router", 65)
    t_r1 = time.time() + 8
    _sleep_until(t_r1)
    mesh.hosts.link(ROUTERS["router-0"], "down")
    t_r2 = t_r1 + 8
    _sleep_until(t_r2)
    mesh.hosts.link(ROUTERS["router-1"], "down")
    t_heal = t_r1 + 20
    _sleep_until(t_heal)
    mesh.hosts.link(ROUTERS["router-0"], "up")
    mesh.hosts.link(ROUTERS["router-1"], "up")
    mesh.wait_probe("load-router", 50 + 90 + 60)
    mesh.wait_probe("mon-router", 60)
    recs, snaps = _records(load), _records(mon)

    def fallbacks(s: dict[str, Any]) -> float:
        return float(sum(v or 0 for v in s["fallbacks"].values()))

    at_r2 = max((fallbacks(s) for s in snaps if s["t"] < t_r2), default=0.0)
    detect = _first(snaps, t_r2, lambda s: fallbacks(s) > at_r2)
    end_load = max(r["t1"] for r in recs)
    final = max(fallbacks(s) for s in snaps if s["t"] <= end_load + 2)
    recover = _first(snaps, t_heal, lambda s: all(v == want for v in s["routers"].values())
                     and fallbacks(s) >= final)
    failed = [r for r in recs if not r["ok"]]
    one_down = [r for r in recs if t_r1 <= r["t0"] < t_r2]
    both_down = [r for r in recs if t_r2 <= r["t0"] < t_heal]
    mesh.figures.append(Figure(
        "router hosts: r1 partitioned 20 s, r2 too for the last 12 s, then both healed", len(recs), len(failed),
        detect, recover, "preprocessors fall back to their own pools (fallback counter rises) once both are away",
        "both routers list all 3 workers again and no request falls back any more",
        f"{len(one_down)} requests with r1 away (r2 answered), {len(both_down)} with both away "
        f"({final - at_r2:.0f} fallbacks); 8-token streams"))

    assert not failed, _failures(recs)  # routing is advice: no request fails because no router answers
    assert len(one_down) >= CONCURRENCY and len(both_down) >= CONCURRENCY
    assert detect is not None and detect <= DETECT_BOUND_S, snaps[-1]
    assert recover is not None and recover <= RECOVER_BOUND_S, snaps[-1]
    converged = [r for r in recs if r["t0"] >= t_heal + recover]
    assert len(converged) >= CONCURRENCY, "the load went on after routing converged"


def test_redis_restarted_under_load(mesh: Mesh) -> None:
    """Redis (the encoder cache's shared L2, on the data host) is stopped and started again, empty, while
    prompt_embeds requests run through both preprocessors: no request fails, both stop using L2 while it is away
    and use it again once it is back (available, and written: Redis holds keys again)."""
    mesh.wait_settled()
    caches = [addr(h, 50051) for h in PREPROCESSORS.values()]
    load = _run_load(mesh, "load-redis", 50, "--max-tokens", "4", "--embeds")
    mon = _run_monitor(mesh, "mon-redis", 60)
    t_stop = time.time() + 12
    _sleep_until(t_stop)
    mesh.hosts.kill("redis", signal.SIGTERM)
    t_start = t_stop + 8
    _sleep_until(t_start)
    mesh.hosts.restart("redis")
    mesh.wait_probe("load-redis", 50 + 90 + 60)
    mesh.wait_probe("mon-redis", 60)
    recs, snaps = _records(load), _records(mon)
    cached = [s for s in snaps if all(s["caches"].get(c) for c in caches)]
    hits_at_start = sum(max((s["caches"][c]["hits"] for s in cached if s["t"] < t_start), default=0)
                        for c in caches)
    assert all(s["caches"][c]["available"] for s in cached if s["t"] < t_stop - 1 for c in caches)
    detect = _first(cached, t_stop, lambda s: not any(s["caches"][c]["available"] for c in caches))
    recover = _first(cached, t_start, lambda s: all(s["caches"][c]["available"] for c in caches))
    hits_again = _first(cached, t_start, lambda s: sum(s["caches"][c]["hits"] for c in caches) > hits_at_start)
    keys = int(mesh.probe("redis", "--addr", addr("data", 6379)).strip())
    failed = [r for r in recs if not r["ok"]]
    away = [r for r in recs if t_stop <= r["t0"] < t_start]
    mesh.figures.append(Figure(
        "Redis (encoder cache L2) stopped under prompt_embeds load, started again empty 8 s later", len(recs),
        len(failed), detect, recover, "both preprocessors report L2 unavailable",
        "both report L2 available again",
        f"{len(away)} requests while Redis was away; {keys} keys in Redis at the end; L2 hits again "
        f"{'not within the load' if hits_again is None else f'{hits_again:.1f} s after the restart'}; "
        "24-row prompt_embeds, "
        "preprocessor L1 256 KiB"))

    assert not failed, _failures(recs)  # the cache is a cache: its loss fails nothing
    assert len(away) >= CONCURRENCY
    assert detect is not None and detect <= DETECT_BOUND_S, snaps[-1]
    assert recover is not None and recover <= RECOVER_BOUND_S, snaps[-1]
    assert keys > 0, "the mesh writes to Redis again"


def test_postgres_restarted_while_files_are_ingested(mesh: Mesh) -> None:
    """PostgreSQL (the vector store's pgvector backend, on the data host) restarts while files are being added to a
    vector store: every file ends completed, listed once, with each chunk stored once."""
    files = 12
    state = mesh.work / "ingest.json"
    mesh.start_probe("ingest", "ingest", "--url", mesh.url, "--ca", mesh.ca, "--files", str(files),
                     "--paragraphs", "2", "--out", str(state))
    uploaded = Path(f"{state}.uploaded")
    deadline = time.monotonic() + 120
    while not uploaded.exists() and time.monotonic() < deadline and mesh.hosts.procs["ingest"].alive():
        time.sleep(0.2)
    assert uploaded.exists(), mesh.hosts.procs["ingest"].tail()
    time.sleep(1.0)  # some files attached and being ingested, more on their way
    t_stop = time.time()
    pg_ctl(mesh, "stop", "-m", "fast")
    time.sleep(3)
    pg_ctl(mesh, "start")
    t_start = time.time()
    mesh.wait_probe("ingest", 180)
    info = json.loads(state.read_text())
    out = json.loads(mesh.probe("ingested", "--url", mesh.url, "--ca", mesh.ca, "--state", str(state),
                                "--timeout", "180", timeout=240))
    chunks = json.loads(mesh.probe("pg-chunks", "--dsn", f"host={ADDR['data']} port=5432 user=postgres "
                                   "dbname=postgres", "--store", info["store"]))
    listed = [f["id"] for f in out["listed"]]
    done = [f for f in out["listed"] if f["status"] == "completed"]
    doubled = {fid: c for fid, c in chunks["files"].items() if c["rows"] != c["distinct"]}
    incomplete = {fid: c for fid, c in chunks["files"].items() if c["rows"] != c["chunks_total"]}
    ingest_end = out["t_done"]
    vs_log = mesh.hosts.procs["vector-store"].log.read_text(errors="replace")
    retried = vs_log.count("database connection lost while ingesting; trying the file again")
    mesh.figures.append(Figure(
        f"PostgreSQL stopped (fast) while {files} files were being added to a vector store, started 3 s later",
        files + len(info["errors"]), files - len(done) + len(info["errors"]), None, ingest_end - t_start,
        "not applicable: the store has one database", "every file ingested (seconds from the restart)",
        f"{retried} ingestions found the connection lost and started their file again; "
        f"{len(info['errors'])} attach requests answered 5xx and were retried by the client; "
        f"attach began {t_stop - info['t_attach']:.1f} s before the stop; {len(set(listed))} files listed, "
        f"{len(listed) - len(set(listed))} twice; {sum(c['rows'] for c in chunks['files'].values())} chunk rows, "
        f"{len(doubled)} files with a chunk stored twice; vector store errors while PostgreSQL was away: "
        f"{'; '.join(out['errors'][:2]) or 'none'}"))

    assert retried >= 1, "the restart did not meet an ingestion in flight"
    assert sorted(listed) == sorted(info["files"]), "a file was lost or listed twice"
    assert chunks["store_file_rows"] == files
    assert len(done) == files, [f for f in out["listed"] if f["status"] != "completed"]
    assert not doubled and not incomplete, (doubled, incomplete)
