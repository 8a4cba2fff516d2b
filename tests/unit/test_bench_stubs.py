"""The benches (and scripts) call only RPCs the mesh serves: a bench that calls a removed RPC fails here, not after a
session of numbers that were never measured (``bench_vllm.py`` once called the worker's unary ``Generate`` after it
was gone).

Each file is parsed, never imported (a bench starts meshes and engines when imported): an AST walk finds

- calls of a CamelCase attribute on a generated gRPC stub: ``<X>Stub(ch).Method(...)``, or ``stub.Method(...)``
  where ``stub`` was bound to ``<X>Stub(...)`` (assigned, also ``self.stub``) or annotated as ``<X>Stub``: the
  method must be one of service ``X``'s; on a receiver whose name ends in ``stub`` but whose stub class is not
  seen, of some service;
- string constants that name an RPC by its path (``"/embedmesh.inference.v1.InferenceService/Generate"``, what
  ``channel.unary_unary`` and the like take): that service must exist and have that method.

The services and their methods come from the generated descriptors (``gen/python``, imported as the services
import them), so a method removed from a ``.proto`` is removed here at the next ``scripts/gen_protos.sh``.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "gen" / "python"
SOURCES = sorted([*(ROOT / "bench").rglob("*.py"), *(ROOT / "scripts").glob("*.py")])

_RPC_PATH = re.compile(r"^/(embedmesh\.[\w.]+)/(\w+)$")
_CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]*$")


@dataclass(frozen=True)
class Services:
    """The generated services: ``methods`` by short name (``WorkerService``; what ``WorkerServiceStub`` calls) and
    ``by_full_name`` (``embedmesh.worker.v1.WorkerService``)."""

    methods: dict[str, frozenset[str]]
    by_full_name: dict[str, frozenset[str]]

    @property
    def any_method(self) -> frozenset[str]:
        return frozenset().union(*self.methods.values())


def generated_services() -> Services:
    methods: dict[str, set[str]] = {}
    full: dict[str, frozenset[str]] = {}
    for path in sorted(GEN.rglob("*_pb2.py")):
        module = importlib.import_module(".".join(path.relative_to(GEN).with_suffix("").parts))
        for service in module.DESCRIPTOR.services_by_name.values():
            names = frozenset(service.methods_by_name)
            methods.setdefault(service.name, set()).update(names)
            full[service.full_name] = names
    return Services({k: frozenset(v) for k, v in methods.items()}, full)


def _stub_class(node: ast.AST | None) -> str | None:
    """``X`` when ``node`` is ``X`` + ``Stub`` as a name, an attribute (``pb2_grpc.XStub``) or a string annotation."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        name = node.value.rsplit(".", 1)[-1]
    elif isinstance(node, ast.Attribute):
        name = node.attr
    elif isinstance(node, ast.Name):
        name = node.id
    else:
        return None
    return name[:-len("Stub")] if name.endswith("Stub") and len(name) > len("Stub") else None


def _made_stub(node: ast.AST | None) -> str | None:
    """``X`` when ``node`` is a call ``XStub(...)``."""
    return _stub_class(node.func) if isinstance(node, ast.Call) else None


def _receiver_name(node: ast.AST) -> str | None:
    """``stub`` for ``stub`` and ``self.stub`` (what a stub is bound to), else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


def _bound_stubs(tree: ast.AST) -> dict[str, set[str]]:
    """Every name (``stub``, ``self.stub``) the file binds to a stub, with the services it stands for."""
    bound: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        pairs: list[tuple[ast.AST, str | None]] = []
        if isinstance(node, ast.Assign):
            pairs = [(t, _made_stub(node.value)) for t in node.targets]
        elif isinstance(node, ast.AnnAssign):
            pairs = [(node.target, _made_stub(node.value) or _stub_class(node.annotation))]
        elif isinstance(node, ast.arg):
            pairs = [(ast.Name(node.arg), _stub_class(node.annotation))]
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            pairs = [(node.optional_vars, _made_stub(node.context_expr))]
        for target, service in pairs:
            name = _receiver_name(target)
            if name is not None and service is not None:
                bound.setdefault(name, set()).add(service)
    return bound


@dataclass(frozen=True)
class RpcCall:
    """One RPC a source calls: on a stub of ``services`` (short names; empty: a ``...stub`` of unknown class), or by
    its path (``services`` then holds the service's full name)."""

    line: int
    services: frozenset[str]
    method: str
    by_path: bool = False


def rpc_calls(source: str, filename: str = "<source>") -> Iterator[RpcCall]:
    """Each RPC ``source`` calls on a stub or names by its path (see the module docstring)."""
    tree = ast.parse(source, filename=filename)
    bound = _bound_stubs(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _RPC_PATH.match(node.value)
            if m:
                yield RpcCall(node.lineno, frozenset({m.group(1)}), m.group(2), by_path=True)
            continue
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _CAMEL.match(node.func.attr)):
            continue
        receiver = node.func.value
        made = _made_stub(receiver)
        name = _receiver_name(receiver)
        kinds = {made} if made else bound.get(name or "", set())
        if kinds or (name is not None and name.lower().endswith("stub")):
            yield RpcCall(node.lineno, frozenset(kinds), node.func.attr)


def unknown_rpcs(source: str, services: Services, filename: str = "<source>") -> list[str]:
    """Each RPC ``source`` calls that no generated service has, as ``file:line: what``."""
    out: list[str] = []
    for call in rpc_calls(source, filename):
        where = f"{filename}:{call.line}"
        if call.by_path:
            (service,) = call.services
            if call.method not in services.by_full_name.get(service, frozenset()):
                out.append(f"{where}: /{service}/{call.method} is no RPC of the generated services")
        elif call.services:
            if not any(call.method in services.methods.get(k, frozenset()) for k in call.services):
                out.append(f"{where}: {'/'.join(sorted(call.services))}Stub has no method {call.method}")
        elif call.method not in services.any_method:
            out.append(f"{where}: no generated service has a method {call.method}")
    return out


@pytest.fixture(scope="module")
def services() -> Services:
    return generated_services()


def test_the_descriptors_hold_the_mesh_services(services: Services) -> None:
    assert "GenerateMany" in services.methods["WorkerService"]
    assert "Generate" not in services.methods["WorkerService"]  # the removed unary call bench_vllm.py made
    assert "Put" in services.by_full_name["embedmesh.cache.v1.EncoderCacheService"]


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_every_rpc_a_bench_or_script_calls_exists(path: Path, services: Services) -> None:
    assert unknown_rpcs(path.read_text(), services, str(path.relative_to(ROOT))) == []


def test_the_walk_sees_the_calls_the_benches_make() -> None:
    """Not vacuous: the calls the benches make today are among those checked (if one moves, move it here)."""
    seen = {(p.name, c.method, c.services) for p in SOURCES for c in rpc_calls(p.read_text())}
    assert {("bench_abuse.py", "Generate", frozenset({"InferenceService"})),
            ("bench_migration.py", "ClearKvBlocks", frozenset({"WorkerService"})),
            ("mesh_generate.py", "GenerateInline", frozenset({"embedmesh.inference.v1.InferenceService"}))} <= seen


BAD = '''
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from embedmesh.inference.v1 import inference_pb2_grpc

async def run(ch, other: "worker_pb2_grpc.WorkerServiceStub") -> None:
    worker = worker_pb2_grpc.WorkerServiceStub(ch)
    async for d in worker.Generate(worker_pb2.GenerateRequest()):       # removed: GenerateMany now
        pass
    await worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest())   # exists
    await inference_pb2_grpc.InferenceServiceStub(ch).Completes(None)   # no such method
    await other.Embed(None)                                                # exists
    await other.Embeddings(None)                                           # no such method
    self.stub = worker_pb2_grpc.WorkerServiceStub(ch)
    await self.stub.Abort(None)                                            # exists
    await self.stub.Stop(None)                                             # no such method
    await mystery_stub.NoSuchRpc(None)                                     # no service has it
    await mystery_stub.Abort(None)                                         # some service has it
    ch.unary_unary("/embedmesh.worker.v1.WorkerService/Generate")         # removed
    ch.unary_unary("/embedmesh.worker.v1.WorkerService/GenerateMany")     # exists
    ch.unary_unary("/embedmesh.nope.v1.Nope/Generate")                    # no such service
    logger.Info("not a stub")                                              # not a stub: not checked
'''


def test_a_call_of_a_method_no_service_has_is_reported(services: Services) -> None:
    found = unknown_rpcs(BAD, services)
    lines = sorted(int(f.split(":")[1]) for f in found)
    assert lines == [7, 10, 12, 15, 16, 18, 20], found
    assert any("WorkerServiceStub has no method Generate" in f for f in found)
    assert any("InferenceServiceStub has no method Completes" in f for f in found)
