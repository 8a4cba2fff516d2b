"""Generate every Envoy sidecar config from deploy/envoy/services.yaml.

Each sidecar has an ingress listener (``port + 1000``) in front of its own service, and one egress listener per
service it calls (``127.0.0.1:15000 + port % 1000``) that balances *per request* (HTTP/2, least request) over the callee's
pod IPs (headless Service, STRICT_DNS), ejects endpoints that fail active ``grpc.health.v1`` checks or return
errors (outlier detection), retries only the idempotent RPCs listed, and applies timeouts. Kubernetes Services
balance connections, not HTTP/2 streams, which is why this exists.

    python deploy/envoy/generate.py [--check]          # write (or compare) deploy/k8s/base/envoy/*.yaml
    python deploy/envoy/generate.py --loopback NAME PORT HEALTH HOST:PORT [HOST:PORT ...]   # print a test config
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "k8s" / "base" / "envoy"
INGRESS_OFFSET = 1000
"""Ingress listener port = service port + 1000 (preprocessor 50051 -> 51051)."""
EGRESS_BASE = 15000
"""Egress listener for a callee = 15000 + callee port % 1000 (preprocessor -> 127.0.0.1:15051)."""


def _cluster(name: str, endpoints: list[tuple[str, int]], health: str | None, static: bool = False,
             interval: str = "2s") -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if static else "STRICT_DNS",
        "connect_timeout": "1s",
        "lb_policy": "LEAST_REQUEST",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
                for host, port in endpoints
            ]}],
        },
        "outlier_detection": {"consecutive_5xx": 5, "consecutive_gateway_failure": 3, "interval": "5s",
                              "base_ejection_time": "15s", "max_ejection_percent": 50},
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
    }
    if health is not None:
        cluster["health_checks"] = [{
            "timeout": "1s", "interval": interval, "unhealthy_threshold": 1, "healthy_threshold": 1,
            # Without this a cluster that has not carried traffic yet checks only every 60 s, so a replica that
            # flips to NOT_SERVING right after start would keep receiving requests for a minute.
            "no_traffic_interval": interval,
            "grpc_health_check": {"service_name": health},
        }]
    return cluster


def _route_config(cluster: str, idempotent: list[str], timeout: str = "600s") -> dict[str, Any]:
    routes: list[dict[str, Any]] = [
        {"match": {"path": path}, "route": {
            "cluster": cluster, "timeout": "30s",
            "retry_policy": {"retry_on": "unavailable,reset,connect-failure,refused-stream", "num_retries": 2,
                             "per_try_timeout": "10s"},
        }}
        for path in idempotent
    ]
    routes.append({"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": timeout}})
    return {"name": cluster, "virtual_hosts": [{"name": cluster, "domains": ["*"], "routes": routes}]}


def _listener(name: str, address: str, port: int, cluster: str, idempotent: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "address": {"socket_address": {"address": address, "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                         ".HttpConnectionManager",
                "stat_prefix": name,
                "codec_type": "AUTO",
                "http2_protocol_options": {},
                "stream_idle_timeout": "900s",
                "route_config": _route_config(cluster, idempotent),
                "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
            },
        }]}],
    }


def sidecar(name: str, spec: dict[str, Any], all_services: dict[str, Any], namespace: str,
            admin_port: int) -> dict[str, Any]:
    listeners, clusters = [], []
    if not spec.get("http"):
        listeners.append(_listener("ingress", "0.0.0.0", spec["port"] + INGRESS_OFFSET, "local_app",
                                   spec.get("idempotent", [])))
        clusters.append(_cluster("local_app", [("127.0.0.1", spec["port"])], spec.get("health")))
    for callee in spec.get("calls", []):
        target = all_services[callee]
        host = f"{callee}-headless.{namespace}.svc.cluster.local"
        listeners.append(_listener(f"egress_{callee}", "127.0.0.1", EGRESS_BASE + target["port"] % 1000, callee,
                                   target.get("idempotent", [])))
        clusters.append(_cluster(callee, [(host, target["port"])], target.get("health")))
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


def loopback(listen_port: int, health: str, endpoints: list[str], idempotent: list[str] | None = None,
             admin_port: int = 0) -> dict[str, Any]:
    """A config for tests: one listener on 127.0.0.1 in front of replicas on loopback, fast health checks."""
    eps = [(e.rsplit(":", 1)[0], int(e.rsplit(":", 1)[1])) for e in endpoints]
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [_listener("ingress", "127.0.0.1", listen_port, "replicas", idempotent or [])],
            "clusters": [_cluster("replicas", eps, health, static=True, interval="0.3s")],
        },
    }


def render_all() -> dict[str, str]:
    spec = yaml.safe_load((HERE / "services.yaml").read_text())
    out = {}
    for name, svc in spec["services"].items():
        cfg = sidecar(name, svc, spec["services"], spec["namespace"], spec["admin_port"])
        out[f"{name}.yaml"] = "# Generated by deploy/envoy/generate.py from services.yaml; do not edit.\n" + \
            yaml.safe_dump(cfg, sort_keys=False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if generated/ differs from what would be written")
    ap.add_argument("--loopback", nargs="+", metavar="ARG")
    a = ap.parse_args()
    if a.loopback:
        port, health, *endpoints = a.loopback
        print(yaml.safe_dump(loopback(int(port), health, endpoints), sort_keys=False))
        return 0
    files = render_all()
    if a.check:
        stale = [n for n, text in files.items() if not (OUT / n).exists() or (OUT / n).read_text() != text]
        if stale:
            print(f"out of date: {stale}; run python deploy/envoy/generate.py", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(exist_ok=True)
    for n, text in files.items():
        (OUT / n).write_text(text)
    print(f"wrote {len(files)} configs to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
