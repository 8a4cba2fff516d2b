"""The NetworkPolicies as rendered (every overlay), evaluated with Kubernetes' rules: a pod selected by any policy
with policyType Ingress is isolated, and a connection is allowed when some policy selecting the pod has a rule whose
peers (none = everyone; podSelector = pods of the policy's namespace; namespaceSelector = pods of matching
namespaces; both = AND) and ports (none = all) match it.

What must hold: ingress to every embedmesh pod is denied by default; from outside the mesh only the gateway's REST
port and the preprocessor's public gRPC port answer; every other service port (apps, sidecar ingresses) answers
embedmesh pods only; metrics answer the monitoring namespace; Redis and PostgreSQL answer only their clients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.unit.deploy._support import OVERLAYS, by_kind, grpc_services, mesh, render, workloads

MESH_LABEL = {"app.kubernetes.io/part-of": "embedmesh"}


@dataclass(frozen=True)
class Source:
    """Who connects: a pod (its labels and namespace, and that namespace's labels), or None for outside the
    cluster's pods (a load balancer, a node port, another cluster)."""

    pod_labels: dict[str, str] | None = None
    namespace: str = ""
    namespace_labels: dict[str, str] = field(default_factory=dict)


OUTSIDE = Source()


def _in_ns(labels: dict[str, str] | None, ns: str) -> Source:
    return Source(labels, ns, {"kubernetes.io/metadata.name": ns})


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # matchExpressions would need evaluating too
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_matches(peer: dict[str, Any], src: Source, policy_ns: str) -> bool:
    assert set(peer) <= {"podSelector", "namespaceSelector"}, peer  # no ipBlock in our policies
    if src.pod_labels is None:
        return False
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], src.namespace_labels):
            return False
    elif src.namespace != policy_ns:
        return False
    return "podSelector" not in peer or _matches(peer["podSelector"], src.pod_labels)


def allowed(policies: list[dict[str, Any]], pod_labels: dict[str, str], port: int, src: Source) -> bool:
    selecting = [p for p in policies if "Ingress" in p["spec"]["policyTypes"]
                 and _matches(p["spec"]["podSelector"], pod_labels)]
    if not selecting:
        return True  # not isolated
    for p in selecting:
        for rule in p["spec"].get("ingress") or []:
            peers_ok = "from" not in rule or any(_peer_matches(peer, src, p["metadata"]["namespace"])
                                                 for peer in rule["from"])
            ports_ok = "ports" not in rule or any(r.get("protocol", "TCP") == "TCP" and r["port"] == port
                                                  for r in rule["ports"])
            if peers_ok and ports_ok:
                return True
    return False


def _pods(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, str], set[int]]]:
    """Every workload's pod labels and every port its containers (sidecars included) listen on."""
    out = {}
    for name, w in workloads(docs).items():
        spec = w["spec"]["template"]["spec"]
        ports = {p["containerPort"] for c in [*spec.get("initContainers", []), *spec["containers"]]
                 for p in c.get("ports", [])}
        out[name] = (w["spec"]["template"]["metadata"]["labels"], ports)
    return out


@pytest.fixture(params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[list[dict[str, Any]], dict[str, tuple[dict[str, str],
                                                                                             set[int]]]]:
    docs = render(request.param)
    return list(by_kind(docs, "NetworkPolicy").values()), _pods(docs)


def _public() -> dict[int, str]:
    return {int(s["port"]): n for n, s in mesh()["services"].items() if s.get("public")}


def test_public_ports_are_the_gateway_and_the_preprocessor() -> None:
    svcs = mesh()["services"]
    assert _public() == {svcs["gateway"]["port"]: "gateway", svcs["preprocessor"]["port"]: "preprocessor"}


def test_every_embedmesh_pod_is_isolated_by_a_default_deny(rendered: Any) -> None:
    policies, pods = rendered
    deny = [p for p in policies if p["spec"]["podSelector"] == {"matchLabels": MESH_LABEL}]
    assert len(deny) == 1 and deny[0]["spec"]["ingress"] == [] and deny[0]["spec"]["policyTypes"] == ["Ingress"]
    for name, (labels, _) in pods.items():
        assert _matches(deny[0]["spec"]["podSelector"], labels), name


def test_only_the_public_ports_answer_outside_the_mesh(rendered: Any) -> None:
    policies, pods = rendered
    reached = {(name, port) for name, (labels, ports) in pods.items() for port in ports
               if allowed(policies, labels, port, OUTSIDE)}
    assert reached == {(name, port) for port, name in _public().items()}
    # The same from a pod of another namespace that is not the monitoring one.
    other = _in_ns({"app": "x"}, "default")
    assert {(n, p) for n, (labels, ports) in pods.items() for p in ports
            if allowed(policies, labels, p, other)} == reached


def test_internal_services_answer_mesh_pods_only(rendered: Any) -> None:
    policies, pods = rendered
    ns = mesh()["namespace"]
    offset = mesh()["envoy"]["ingress_offset"]
    caller = _in_ns({**MESH_LABEL, "app.kubernetes.io/name": "preprocessor"}, ns)
    stranger = _in_ns({"app.kubernetes.io/name": "debug-shell"}, ns)  # a pod in the namespace, not the mesh's
    for name in grpc_services():
        labels, _ = pods[name]
        port = mesh()["services"][name]["port"]
        for p in (port, port + offset):
            assert allowed(policies, labels, p, caller), (name, p)
            public = _public().get(p) == name
            assert allowed(policies, labels, p, stranger) is public, (name, p)
            assert allowed(policies, labels, p, OUTSIDE) is public, (name, p)
    for name in ("worker", "worker-embed", "router", "vector-store"):
        labels, ports = pods[name]
        assert not any(allowed(policies, labels, p, OUTSIDE) for p in ports), name


def test_metrics_answer_the_monitoring_namespace(rendered: Any) -> None:
    policies, pods = rendered
    prometheus = _in_ns({"app.kubernetes.io/name": "prometheus"}, mesh()["network"]["monitoring_namespace"])
    stats = mesh()["envoy"]["stats_port"]
    for name, svc in mesh()["services"].items():
        labels, _ = pods[name]
        metrics = svc.get("metrics_port", 9100)
        for port in (metrics, stats):
            assert allowed(policies, labels, port, prometheus), (name, port)
        assert not allowed(policies, labels, svc["port"] + mesh()["envoy"]["ingress_offset"], prometheus), name


def test_stores_answer_only_their_clients(rendered: Any) -> None:
    policies, pods = rendered
    ns = mesh()["namespace"]
    for store, port in mesh()["network"]["stores"].items():
        labels, ports = pods[store]
        assert port in ports
        clients = {n for n, s in mesh()["services"].items() if store in s.get("stores", [])}
        assert clients, store
        for name in mesh()["services"]:
            src = _in_ns(pods[name][0], ns)
            assert allowed(policies, labels, port, src) is (name in clients), (store, name)
        assert not allowed(policies, labels, port, OUTSIDE)
    assert {n for n, s in mesh()["services"].items() if "postgres" in s.get("stores", [])} == {"vector-store"}
