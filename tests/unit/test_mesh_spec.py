"""deploy/mesh.yaml as the launcher reads it: every service with a module that exists, callees before callers, and
bad descriptions refused with the field named."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from embedmesh import mesh_spec


def test_the_checkout_description_lists_the_mesh_with_importable_modules() -> None:
    services = mesh_spec.load()
    assert {"gateway", "preprocessor", "router", "worker", "worker-embed", "vector-store",
            "image-encoder"} <= set(services)
    for s in services.values():
        assert importlib.util.find_spec(s.module) is not None, s
        assert 0 < s.port < 65536
    assert services["gateway"].protocol == "http" and services["gateway"].port == 8000
    assert services["preprocessor"].calls == ("worker", "worker-embed", "router", "image-encoder")
    assert services["worker"].registers_with == ("router",)
    assert services["image-encoder"].module == "embedmesh.services.image_encoder.main"
    assert services["image-encoder"].health == "embedmesh.imageencoder.v1.ImageEncoderService"


def test_every_service_is_under_services_one_list_for_the_launcher_and_the_generators() -> None:
    """No second list of services or calls beside ``services`` (the launcher and both generators read the same)."""
    doc = yaml.safe_load(mesh_spec.MESH_YAML.read_text())
    elsewhere = [key for key, value in doc.items() if key != "services" and isinstance(value, dict)
                 and any(isinstance(v, dict) and "module" in v for v in value.values())]
    assert elsewhere == [], "services listed outside `services`"
    assert [n for n, s in doc["services"].items() if "cluster_calls" in s] == [], "calls listed outside `calls`"
    assert list(doc["services"]) == ["gateway", "preprocessor", "router", "worker", "worker-embed", "vector-store",
                                     "image-encoder"]


def test_start_order_puts_every_callee_first() -> None:
    services = mesh_spec.load()
    order = mesh_spec.start_order(services)
    assert sorted(order) == sorted(services)
    for name, s in services.items():
        for callee in (*s.calls, *s.registers_with):
            assert order.index(callee) < order.index(name), (callee, name)
    assert order.index("router") < order.index("worker"), "workers stream KV events to a router already up"
    assert order.index("image-encoder") < order.index("preprocessor"), "the encoders' addresses go to the preprocessor"
    assert order[-1] == "gateway"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "mesh.yaml"
    p.write_text(text)
    return p


def test_unknown_callee_missing_port_and_cycles_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"services\.a\.calls names unknown services \['nope'\]"):
        mesh_spec.load(_write(tmp_path, "services:\n  a: {module: m, port: 1, calls: [nope]}\n"))
    with pytest.raises(ValueError, match=r"services\.a: needs module and an integer port"):
        mesh_spec.load(_write(tmp_path, "services:\n  a: {module: m}\n"))
    cyc = mesh_spec.load(_write(tmp_path, "services:\n  a: {module: m, port: 1, calls: [b]}\n"
                                          "  b: {module: m, port: 2, calls: [a]}\n"))
    with pytest.raises(ValueError, match="cycle: a -> b -> a"):
        mesh_spec.start_order(cyc)
    with pytest.raises(FileNotFoundError, match="mesh description is missing"):
        mesh_spec.load(tmp_path / "absent.yaml")
