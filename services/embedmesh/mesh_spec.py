"""The mesh's one description, ``deploy/mesh.yaml``, read for local runs: which services exist, the module each
runs, its port, its health name and which services it calls.

The Kubernetes and Envoy generators (``deploy/k8s/generate.py``, ``deploy/envoy/generate.py``) read the same file;
the launcher (``make run``) and the e2e harness (``tests/support/mesh.py``, through the launcher) start what it
lists, in an order where every service starts after the ones it calls, and hand each caller its callees' addresses.
One list serves both: a service the launcher runs only when a flag asks for it (the image encoder, the router
process) is listed like the others, and its starter in ``launcher.STARTERS`` starts nothing otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["MESH_YAML", "ServiceSpec", "load", "start_order"]

MESH_YAML = Path(__file__).resolve().parents[2] / "deploy" / "mesh.yaml"
"""``deploy/mesh.yaml`` of this checkout (the launcher runs from a checkout: ``make run``)."""


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    module: str
    """``python -m`` module of the process."""
    port: int
    """Its listening port (gRPC, or HTTP for the gateway)."""
    calls: tuple[str, ...]
    """Services it dials."""
    registers_with: tuple[str, ...] = ()
    """Services it streams to by name rather than through a balanced call (a worker's KV events to every router);
    they start first too."""
    health: str = ""
    """grpc.health.v1 service name ("" for the HTTP gateway)."""
    protocol: str = "grpc"


def load(path: Path | str = MESH_YAML) -> dict[str, ServiceSpec]:
    """The services of ``mesh.yaml`` by name; a file that lacks a field or names an unknown callee is refused."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the mesh description is missing (run from a checkout of embedmesh)")
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    services: dict[str, ServiceSpec] = {}
    for name, s in (doc.get("services") or {}).items():
        try:
            services[name] = ServiceSpec(name=name, module=str(s["module"]), port=int(s["port"]),
                                         calls=tuple(s.get("calls") or ()),
                                         registers_with=tuple(s.get("registers_with") or ()),
                                         health=str(s.get("health", "")),
                                         protocol=str(s.get("protocol", "grpc")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: services.{name}: needs module and an integer port ({e})") from None
    for s in services.values():
        for key in ("calls", "registers_with"):
            unknown = [c for c in getattr(s, key) if c not in services]
            if unknown:
                raise ValueError(f"{path}: services.{s.name}.{key} names unknown services {unknown}")
    return services


def start_order(services: dict[str, ServiceSpec]) -> list[str]:
    """Names in an order where each service comes after every service it calls (ties keep the file's order)."""
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise ValueError(f"mesh.yaml: calls form a cycle: {' -> '.join((*path, name))}")
        state[name] = 1
        for callee in (*services[name].calls, *services[name].registers_with):
            visit(callee, (*path, name))
        state[name] = 2
        order.append(name)

    for name in services:
        visit(name, ())
    return order
