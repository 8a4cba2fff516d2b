"""The Envoy pieces the Envoy e2e tests and bench_image_affinity.py share: the config generator (deploy/ is not a
package), the affinity egress's round-robin variant, and its clusters' health as Envoy's admin API reports it."""

from __future__ import annotations

import copy
import urllib.request
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "AFFINITY_CLUSTERS", "generator", "round_robin", "affinity_healthy"]

ROOT = Path(__file__).resolve().parents[2]
AFFINITY_CLUSTERS = ("preprocessor", "preprocessor_affinity")
"""The gateway's egress to the preprocessor: the plain cluster (least request; round robin in ``round_robin``'s
variant) and its hashed twin."""


def generator() -> Any:
    """deploy/envoy/generate.py as a module."""
    spec = spec_from_file_location("_envoy_generate", ROOT / "deploy" / "envoy" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def round_robin(config: dict[str, Any], header: str = "x-embedmesh-affinity") -> dict[str, Any]:
    """The generated affinity egress without its hashing twins (routes and cluster), on ROUND_ROBIN: what the
    replicas get without affinity."""
    plain = copy.deepcopy(config)
    for listener in plain["static_resources"]["listeners"]:
        vhost = listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]
        twins = [r for r in vhost["routes"] if "hash_policy" in r["route"]]
        assert twins and all(r["route"]["hash_policy"] == [{"header": {"header_name": header}}] for r in twins)
        vhost["routes"] = [r for r in vhost["routes"] if "hash_policy" not in r["route"]]
    clusters = plain["static_resources"]["clusters"]
    assert [c["lb_policy"] for c in clusters] == ["LEAST_REQUEST", "MAGLEV"]
    plain["static_resources"]["clusters"] = [{**clusters[0], "lb_policy": "ROUND_ROBIN"}]
    return plain


def affinity_healthy(admin: int, replicas: int = 2) -> bool:
    """Whether Envoy (admin port ``admin``) sees every replica healthy in each of the egress's clusters."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/clusters", timeout=5).read().decode()
    flags = [line.split("::")[3] for line in text.splitlines()
             if line.split("::")[0] in AFFINITY_CLUSTERS and line.split("::")[2] == "health_flags"]
    return len(flags) in (replicas, 2 * replicas) and all(f == "healthy" for f in flags)
