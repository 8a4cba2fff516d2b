"""The launcher (``make run``) with the echo engine: children live in their own sessions and die with the launcher
whatever kills it (SIGKILL included), Ctrl-C stops them cleanly, and the security switches (``--tls``, API keys) reach
every child and are announced."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import ssl
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from embedmesh import launcher
from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.mesh import Mesh, port_bindable, start_mesh
from tests.support.process_tree import wait_gone


def _child_pids(mesh: Mesh) -> dict[str, int]:
    return {name: int(pid) for name, pid in re.findall(r"\[launcher\]\s+(\S+)\s+\S+\s+\(pid (\d+)\)",
                                                        mesh.log_tail(100_000))}


def _port_free(port: int) -> bool:
    """Whether a new server could listen on ``port`` (as the mesh's servers do: SO_REUSEADDR, so connections in
    TIME_WAIT do not count)."""
    return port_bindable(port)


def _ports(mesh: Mesh) -> list[int]:
    return [mesh.gateway_port, mesh.preprocessor_port, *mesh.worker_ports,
            int(str(mesh.extra["router"]).rsplit(":", 1)[1])]


def test_children_die_with_a_sigkilled_launcher() -> None:
    mesh = start_mesh(engine="echo", workers=2)
    try:
        pids = _child_pids(mesh)
        assert set(pids) == {"worker-0", "worker-1", "preprocessor", "gateway"}  # the router runs in the preprocessor
        # Each child leads its own session: a terminal's Ctrl-C reaches only the launcher.
        assert all(os.getsid(pid) == pid for pid in pids.values())
        os.kill(mesh.proc.pid, signal.SIGKILL)
        mesh.proc.wait()
        assert wait_gone(list(pids.values())) == []
        # Sockets close with their process; allow the kernel a moment, then name any port still held.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(_port_free(p) for p in _ports(mesh)):
            time.sleep(0.1)
        assert [p for p in _ports(mesh) if not _port_free(p)] == []
    finally:
        mesh.stop()


def test_ctrl_c_stops_every_child_and_exits_0() -> None:
    mesh = start_mesh(engine="echo", workers=1)
    pids = list(_child_pids(mesh).values())
    assert len(pids) == 3
    assert mesh.stop() == 0  # SIGINT, as Ctrl-C sends it
    assert wait_gone(pids) == []
    assert "[launcher] stopped" in mesh.log_tail()


def _ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` has SIGINT ignored (its ``SigIgn`` mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask & (1 << (signal.SIGINT - 1)))


def _stopped_services(log: str) -> set[str]:
    """The services whose JSON log says they drained and stopped."""
    found = set()
    for line in log.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("msg") == "stopped":
                found.add(rec.get("service"))
    return found


def test_ctrl_c_stops_a_launcher_started_with_sigint_ignored() -> None:
    """A background job of a non-interactive shell (``make run &``, a supervisor, a CI runner) starts with SIGINT
    ignored: the launcher still stops on Ctrl-C, its children do not inherit the ignored SIGINT, each drains and
    exits, and the launcher exits 0 (not SIGKILLed by the harness after its timeout)."""
    mesh = start_mesh(engine="echo", workers=1, sigint_ignored=True)
    try:
        pids = _child_pids(mesh)
        assert set(pids) == {"worker-0", "preprocessor", "gateway"}
        assert not _ignores_sigint(mesh.proc.pid)
        assert [name for name, pid in pids.items() if _ignores_sigint(pid)] == []
    finally:
        code = mesh.stop()
    assert code == 0, mesh.log_tail()
    assert wait_gone(list(pids.values())) == []
    log = mesh.log_tail(1_000_000)
    assert "[launcher] stopped" in log
    assert _stopped_services(log) == {"worker", "preprocessor", "gateway"}


def test_the_launcher_handles_both_stop_signals_whatever_it_inherited() -> None:
    """SIGINT inherited ignored and SIGTERM at its default both become the launcher's handler; a signal that comes
    while the children are being started waits until they all are, then stops them (``arm``)."""
    before = {sig: signal.signal(sig, signal.SIG_IGN if sig == signal.SIGINT else signal.SIG_DFL)
              for sig in launcher.STOP_SIGNALS}
    try:
        signals = launcher.StopSignals()
        assert all(signal.getsignal(sig) == signals._on_signal for sig in launcher.STOP_SIGNALS)
        os.kill(os.getpid(), signal.SIGTERM)  # while starting: remembered, nothing raised
        assert signals.received == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            signals.arm()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs at the next bytecode boundary
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _args(*argv: str) -> argparse.Namespace:
    return launcher.parse_args(list(argv))


@pytest.mark.parametrize("tls, extra, holders", [
    (False, [], {"worker-0", "embed-worker", "preprocessor", "vector-store"}),  # the only credential inside
    (False, ["--router-process"], {"router", "worker-0", "embed-worker", "preprocessor", "vector-store"}),
    (True, [], {"preprocessor", "vector-store"}),  # certificates inside; the token only on the public port
])
def test_the_mesh_token_goes_only_to_the_services_that_use_it(tls: bool, extra: list[str], holders: set[str],
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """Least privilege: the client-facing gateway never holds the mesh token; with mutual TLS only the two ends of
    the one call that uses it do."""
    monkeypatch.delenv("EMBEDMESH_MESH_TOKEN", raising=False)
    monkeypatch.setenv("EMBEDMESH_API_KEYS", "key-12345678=alpha")
    envs: dict[str, dict[str, str]] = {}

    def spawn(name: str, module: str, args: list[str], env: dict[str, str], python: str = "") -> _FakeProc:
        envs[name] = env
        return _FakeProc()

    monkeypatch.setattr(launcher, "spawn_process", spawn)
    a = _args(*(["--tls", "--tls-dir", str(tmp_path)] if tls else []), *extra)
    env = dict(os.environ)  # as main() starts
    per_child, _ = launcher.security_env(a, env)
    launcher.start_mesh(a, per_child, env)
    assert set(envs) == {*(["router"] if extra or tls else []), "worker-0", "embed-worker", "preprocessor",
                         "vector-store", "gateway"}
    assert {name for name, e in envs.items() if "EMBEDMESH_MESH_TOKEN" in e} == holders
    assert all(e["EMBEDMESH_MESH_TOKEN"] == env["EMBEDMESH_MESH_TOKEN"] for n, e in envs.items() if n in holders)
    assert all(e["EMBEDMESH_API_KEYS"] for e in envs.values())  # keys still reach everyone that checks them


def test_gateway_tls_needs_tls() -> None:
    with pytest.raises(SystemExit):
        _args("--gateway-tls")


def test_a_tls_mesh_serves_and_its_workers_refuse_callers_without_a_mesh_certificate() -> None:
    mesh = start_mesh(engine="echo", workers=1, tls=True)
    try:
        tls_dir = Path(str(mesh.extra["tls_dir"]))
        with urllib.request.urlopen(f"{mesh.base_url}/health", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "ok"
        # With TLS the router stays a process: the preprocessor's public port takes no worker certificate.
        assert {s["service"] for s in body["services"]} == {"gateway", "preprocessor", "worker", "router"}
        ca = (tls_dir / "ca.pem").read_bytes()
        plain = grpc.ssl_channel_credentials(root_certificates=ca)
        with grpc.secure_channel(mesh.workers[0], plain) as ch, pytest.raises(grpc.RpcError):
            worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        mutual = grpc.ssl_channel_credentials(root_certificates=ca,
                                              private_key=(tls_dir / "client-key.pem").read_bytes(),
                                              certificate_chain=(tls_dir / "client.pem").read_bytes())
        with grpc.secure_channel(mesh.workers[0], mutual) as ch:
            info = worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        assert info.model == "echo"
        assert mesh.extra["router"] != mesh.preprocessor
        with grpc.secure_channel(str(mesh.extra["router"]), mutual) as ch:  # registered over mutual TLS
            workers = router_pb2_grpc.RouterServiceStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
        assert [w.registration.address for w in workers.workers] == mesh.workers
        assert "mutual TLS between services" in mesh.log_tail(100_000)
    finally:
        assert mesh.stop() == 0


def test_gateway_tls_serves_https() -> None:
    mesh = start_mesh(engine="echo", workers=1, tls=True, gateway_tls=True)
    try:
        assert mesh.base_url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(Path(str(mesh.extra["tls_dir"])) / "ca.pem"))
        with urllib.request.urlopen(f"{mesh.base_url}/health", timeout=10, context=ctx) as r:
            assert json.loads(r.read())["status"] == "ok"
    finally:
        mesh.stop()


class _FakeProc:
    pid = 0


def _plan(argv: list[str]) -> list[tuple[str, str, list[str]]]:
    """What start_mesh would start for ``argv``: (label, module, args), with nothing spawned."""
    a = launcher.parse_args(argv)
    started: list[tuple[str, str, list[str]]] = []

    def spawn(label: str, module: str, args: list[str], env: dict[str, str], python: str = "") -> _FakeProc:
        started.append((label, module, args))
        return _FakeProc()

    plan = launcher._Plan(a, dict(os.environ), spawn, {}, [])
    for name in launcher.check_mesh():
        launcher.STARTERS[name](plan)
    return started


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_the_launcher_starts_what_mesh_yaml_lists_on_its_ports_and_wires_its_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/mesh.yaml is the one description: the launcher's default ports are its ports, every service in it
    starts (callees first) with its module, and each caller gets its callees' addresses."""
    monkeypatch.delenv("EMBEDMESH_PREPROCESSOR_IMAGE_ENCODER", raising=False)
    started = _plan(["--workers", "2", "--router-process", "--image-encoders", "1"])
    by_label = {label: (module, args) for label, module, args in started}
    assert [label for label, _, _ in started] == ["router", "worker-0", "worker-1", "embed-worker", "image-encoder-0",
                                                 "preprocessor", "vector-store", "gateway"]
    mesh = launcher.MESH
    names = {"router": "router", "worker-0": "worker", "worker-1": "worker", "embed-worker": "worker-embed",
             "image-encoder-0": "image-encoder", "preprocessor": "preprocessor", "vector-store": "vector-store",
             "gateway": "gateway"}
    assert set(names.values()) == set(mesh)
    for label, (module, _) in by_label.items():
        assert module == mesh[names[label]].module
    assert _arg(by_label["gateway"][1], "--port") == str(mesh["gateway"].port)
    assert _arg(by_label["router"][1], "--port") == str(mesh["router"].port)
    assert _arg(by_label["worker-0"][1], "--port") == str(mesh["worker"].port)
    assert _arg(by_label["embed-worker"][1], "--port") == str(mesh["worker-embed"].port)
    assert _arg(by_label["image-encoder-0"][1], "--port") == str(mesh["image-encoder"].port) == "50111"
    pre = by_label["preprocessor"][1]
    assert _arg(pre, "--port") == str(mesh["preprocessor"].port)
    w = [f"127.0.0.1:{mesh['worker'].port}", f"127.0.0.1:{mesh['worker'].port + 1}",
         f"127.0.0.1:{mesh['worker-embed'].port}"]
    assert _arg(pre, "--workers") == ",".join(w)
    assert _arg(pre, "--routers") == f"127.0.0.1:{mesh['router'].port}"
    assert _arg(pre, "--image-encoder-address") == f"127.0.0.1:{mesh['image-encoder'].port}"
    assert _arg(by_label["worker-1"][1], "--routers") == f"127.0.0.1:{mesh['router'].port}"
    assert "--routers" not in by_label["embed-worker"][1]
    assert _arg(by_label["vector-store"][1], "--inference-addr") == f"127.0.0.1:{mesh['preprocessor'].port}"
    gw = by_label["gateway"][1]
    assert _arg(gw, "--preprocessor") == f"127.0.0.1:{mesh['preprocessor'].port}"
    assert _arg(gw, "--vector-store") == f"127.0.0.1:{mesh['vector-store'].port}"
    for name, flag in launcher.PORT_FLAGS.items():  # each port flag's default is that service's mesh.yaml port
        assert getattr(launcher.parse_args([]), flag[2:].replace("-", "_")) == mesh[name].port


def test_default_flags_start_the_mesh_make_run_has_always_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """mesh.yaml lists the image encoder and the router as services, yet ``make run`` with no flags starts neither:
    the router runs inside the preprocessor and images are encoded there; no caller is handed their addresses."""
    monkeypatch.delenv("EMBEDMESH_PREPROCESSOR_IMAGE_ENCODER", raising=False)
    monkeypatch.delenv("EMBEDMESH_NUM_IMAGE_ENCODERS", raising=False)
    started = _plan([])
    assert [(label, module) for label, module, _ in started] == [
        ("worker-0", "embedmesh.services.worker.main"), ("embed-worker", "embedmesh.services.worker.main"),
        ("preprocessor", "embedmesh.services.preprocessor.main"),
        ("vector-store", "embedmesh.services.vector_store.main"), ("gateway", "embedmesh.gateway.main")]
    pre = dict((label, args) for label, _, args in started)["preprocessor"]
    assert "--image-encoder-address" not in pre and "--routers" not in pre and "--embedded-router" in pre
    assert _arg(pre, "--workers") == "127.0.0.1:50061,127.0.0.1:50091"


def test_services_switched_off_are_not_started_nor_handed_to_callers() -> None:
    started = _plan(["--router-port", "0", "--vector-store-port", "0", "--embed-worker-port", "0"])
    labels = [label for label, _, _ in started]
    assert labels == ["worker-0", "preprocessor", "gateway"]
    pre = started[1][2]
    assert "--routers" not in pre and "--routers" not in started[0][2]
    assert _arg(pre, "--workers") == f"127.0.0.1:{launcher.MESH['worker'].port}"
    assert "--vector-store" not in started[2][2]


def test_a_service_or_call_mesh_yaml_adds_without_a_starter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from embedmesh.mesh_spec import ServiceSpec

    extra = {**launcher.MESH, "reranker": ServiceSpec("reranker", "embedmesh.reranker", 50111, ())}
    monkeypatch.setattr(launcher, "MESH", extra)
    with pytest.raises(SystemExit, match=r"services \['reranker'\], calls \[\]; add them to STARTERS"):
        launcher.check_mesh()
    gw = launcher.MESH["gateway"]
    calls_more = {**launcher.MESH, "gateway": ServiceSpec("gateway", gw.module, gw.port, (*gw.calls, "router"))}
    monkeypatch.setattr(launcher, "MESH", calls_more)
    with pytest.raises(SystemExit, match=r"calls \['gateway -> router'\]"):
        launcher.check_mesh()


def test_enable_lora_reaches_only_engines_that_need_the_flag() -> None:
    hf = _plan(["--lora-modules", "a=x", "--router-port", "0", "--vector-store-port", "0"])
    assert "--enable-lora" not in hf[0][2] and _arg(hf[0][2], "--lora-modules") == "a=x"
    from embedmesh.services.worker.engines import registry

    assert [n for n in registry.names() if registry.spec(n).lora_needs_flag] == ["vllm", "sglang"]


def test_router_replicas_take_the_next_ports_and_every_worker_and_preprocessor_gets_them_all() -> None:
    started = _plan(["--workers", "2", "--engine", "mocker", "--router-replicas", "3", "--router-port", "7000",
                     "--router-mode", "round-robin"])
    by_label = {label: args for label, _, args in started}
    assert [label for label, _, _ in started] == ["router", "router-1", "router-2", "worker-0", "worker-1",
                                                 "preprocessor", "gateway"]  # mocker: no embedding, no vector store
    assert [_arg(by_label[r], "--port") for r in ("router", "router-1", "router-2")] == ["7000", "7001", "7002"]
    assert all(_arg(by_label[r], "--mode") == "round-robin" for r in ("router", "router-1", "router-2"))
    assert "--metrics-port" in by_label["router"] and "--metrics-port" not in by_label["router-1"]
    routers = ",".join(f"127.0.0.1:{7000 + k}" for k in range(3))
    assert _arg(by_label["worker-1"], "--routers") == routers and _arg(by_label["preprocessor"], "--routers") == routers
    assert "--mode" not in _plan(["--router-replicas", "2"])[0][2]  # kv is the routers' default


def test_one_router_replica_runs_inside_the_preprocessor_unless_asked_for_a_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (one preprocessor, one router replica) starts no router process: the preprocessor routes
    (``--embedded-router``, the router's mode in its EMBEDMESH_ROUTER_MODE) and the workers stream to its port;
    ``--router-process`` starts the router service as before, and --router-port 0 still means no router."""
    envs: dict[str, dict[str, str]] = {}

    def spawn(label: str, module: str, args: list[str], env: dict[str, str], python: str = "") -> _FakeProc:
        envs[label] = env
        return _FakeProc()

    monkeypatch.delenv("EMBEDMESH_ROUTER_MODE", raising=False)
    monkeypatch.setattr(launcher, "spawn_process", spawn)
    started = _plan(["--workers", "2", "--engine", "mocker", "--router-mode", "round-robin"])
    by_label = {label: args for label, _, args in started}
    assert [label for label, _, _ in started] == ["worker-0", "worker-1", "preprocessor", "gateway"]
    pre = by_label["preprocessor"]
    assert "--embedded-router" in pre and "--routers" not in pre
    own = f"127.0.0.1:{launcher.MESH['preprocessor'].port}"
    assert _arg(by_label["worker-0"], "--routers") == own and _arg(by_label["worker-1"], "--routers") == own
    a = launcher.parse_args(["--engine", "mocker", "--router-mode", "round-robin"])
    launcher.start_mesh(a)
    assert envs["preprocessor"]["EMBEDMESH_ROUTER_MODE"] == "round-robin"
    assert "EMBEDMESH_ROUTER_MODE" not in envs["worker-0"]

    separate = {label: args for label, _, args in _plan(["--router-process"])}
    assert "router" in separate and "--embedded-router" not in separate["preprocessor"]
    assert _arg(separate["preprocessor"], "--routers") == f"127.0.0.1:{launcher.MESH['router'].port}"
    off = {label: args for label, _, args in _plan(["--router-port", "0"])}
    assert "router" not in off and "--embedded-router" not in off["preprocessor"]
    assert "--routers" not in off["preprocessor"] and "--routers" not in off["worker-0"]


@pytest.mark.parametrize("argv", [["--embedded-router", "--router-process"],
                                  ["--embedded-router", "--router-replicas", "2"], ["--embedded-router", "--tls"]])
def test_the_embedded_router_flag_refuses_a_layout_with_router_processes(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        launcher.parse_args(argv)


def test_router_replicas_are_bounded() -> None:
    with pytest.raises(SystemExit):
        launcher.parse_args(["--router-replicas", "0"])


def test_image_encoders_start_before_the_preprocessor_which_gets_their_addresses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBEDMESH_PREPROCESSOR_IMAGE_ENCODER", raising=False)
    started = _plan(["--engine", "echo", "--image-encoders", "2", "--image-encoder-port", "7100",
                     "--workers", "1"])
    by_label = {label: (module, args) for label, module, args in started}
    labels = [label for label, _, _ in started]
    assert labels.index("image-encoder-0") < labels.index("image-encoder-1") < labels.index("preprocessor")
    for k in range(2):
        module, args = by_label[f"image-encoder-{k}"]
        assert module == "embedmesh.services.image_encoder.main" and _arg(args, "--port") == str(7100 + k)
        assert _arg(args, "--encoder") == "efficientnet-lite0"
        assert _arg(args, "--tokenizer") == _arg(by_label["preprocessor"][1], "--tokenizer")  # the same folder
    assert _arg(by_label["preprocessor"][1], "--image-encoder-address") == "127.0.0.1:7100,127.0.0.1:7101"
    # Several models: each encoder gets the preprocessor's name=folder of every model besides the default one.
    several = {label: args for label, _, args in _plan(["--image-encoders", "1", "--model", "/m/one", "--model",
                                                        "default", "--model", "/m/two"])}
    for label in ("preprocessor", "image-encoder-0"):
        assert _arg(several[label], "--model-tokenizers") == "one=/m/one,two=/m/two", label
    default = _plan(["--engine", "echo"])  # 0: encoded inside the preprocessor, as make run has it
    assert not any(label.startswith("image-encoder") for label, _, _ in default)
    assert all("--image-encoder-address" not in args for _, _, args in default)


def test_image_encoders_run_the_preprocessors_encoder_and_none_start_when_images_are_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDMESH_PREPROCESSOR_IMAGE_ENCODER", "dinov2")
    monkeypatch.setenv("EMBEDMESH_PREPROCESSOR_IMAGE_PROJECTOR", "/p")
    args = {label: a for label, _, a in _plan(["--engine", "echo", "--image-encoders", "1"])}["image-encoder-0"]
    assert (_arg(args, "--encoder"), _arg(args, "--image-projector"), _arg(args, "--port")) == ("dinov2", "/p",
                                                                                               "50111")
    monkeypatch.setenv("EMBEDMESH_PREPROCESSOR_IMAGE_ENCODER", "off")
    assert [label for label, _, _ in _plan(["--engine", "echo", "--image-encoders", "1"])] == [
        "worker-0", "preprocessor", "gateway"]
    with pytest.raises(SystemExit):
        _plan(["--image-encoders", "17"])


def test_with_tls_an_image_encoder_has_its_own_certificate_and_no_mesh_token(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    """Only the preprocessor may call it (core/callers.py), with its certificate: the encoder needs no token."""
    monkeypatch.delenv("EMBEDMESH_MESH_TOKEN", raising=False)
    monkeypatch.delenv("EMBEDMESH_PREPROCESSOR_IMAGE_ENCODER", raising=False)
    envs: dict[str, dict[str, str]] = {}

    def spawn(name: str, module: str, args: list[str], env: dict[str, str], python: str = "") -> _FakeProc:
        envs[name] = env
        return _FakeProc()

    monkeypatch.setattr(launcher, "spawn_process", spawn)
    a = _args("--tls", "--tls-dir", str(tmp_path), "--image-encoders", "1", "--engine", "echo")
    env = dict(os.environ)
    per_child, _ = launcher.security_env(a, env)
    launcher.start_mesh(a, per_child, env)
    assert envs["image-encoder-0"]["EMBEDMESH_TLS_CERT"] == str(tmp_path / "image-encoder.pem")
    assert "EMBEDMESH_MESH_TOKEN" not in envs["image-encoder-0"] and "EMBEDMESH_MESH_TOKEN" in envs["preprocessor"]
