"""The Grafana dashboard: well-formed, and built only on metric names that exist — the services' own
(``embedmesh_*``, each defined in the services' or the gateway's source; no exceptions) and Envoy's (read from a
real Envoy's /stats/prometheus)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.unit.deploy._support import DEPLOY, ROOT, load_script, mesh, tool

DASHBOARD = DEPLOY / "grafana" / "embedmesh.json"
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]


def _used(prefix: str) -> set[str]:
    """Metric names in the queries (label matchers and `by (...)` label lists removed first)."""
    names = set()
    for expr in _exprs():
        expr = re.sub(r"\{[^}]*\}|\bby \([^)]*\)", "", expr)
        names |= set(re.findall(rf"\b{prefix}[a-z0-9_]+", expr))
    return names


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_dashboard_is_well_formed() -> None:
    dash = _dashboard()
    assert dash["uid"] == "embedmesh"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert any(v["type"] == "datasource" for v in dash["templating"]["list"])
    for p in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_dashboard_covers_every_area() -> None:
    used = _used("embedmesh_")
    for needle in ("embedmesh_gateway_", "embedmesh_rpc_", "embedmesh_time_to_first_token",
                   "embedmesh_generated_tokens", "embedmesh_encoder_cache_", "embedmesh_router_", "embedmesh_worker_",
                   "embedmesh_vector_store_"):
        assert any(m.startswith(needle) for m in used), needle


def test_embedmesh_metrics_are_exported_by_the_services() -> None:
    source = "\n".join(p.read_text() for d in ("services", "gateway") for p in (ROOT / d).rglob("*.py"))
    defined = set(re.findall(r"[\"'](embedmesh_[a-z0-9_]+)[\"']", source))
    missing = {m for m in _used("embedmesh_") if not {m, _base(m)} & defined}
    assert not missing, f"dashboard uses metrics no service defines: {sorted(missing)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_envoy_metrics_exist_in_a_real_envoy() -> None:
    envoy = tool("envoy")
    gen = load_script("envoy/generate.py")
    admin = _free_port()
    cfg = gen.loopback(mesh(), listen_port=_free_port(), endpoints=[f"127.0.0.1:{_free_port()}"], admin_port=admin)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = subprocess.Popen([envoy, "-c", str(path), "--disable-hot-restart", "--log-level", "error"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline, text = time.monotonic() + 20, ""
            while time.monotonic() < deadline and not text:
                try:
                    url = f"http://127.0.0.1:{admin}/stats/prometheus"
                    text = urllib.request.urlopen(url, timeout=2).read().decode()
                except OSError:
                    time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(10)
    assert text, "envoy never served its admin API"
    exported = set(re.findall(r"^(envoy_[a-z0-9_]+)", text, re.M))
    assert _used("envoy_") - exported == set()
