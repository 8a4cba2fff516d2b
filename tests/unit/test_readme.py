"""The README is a front door that stays true: short, its two commands are real Makefile targets, its diagram names
only RPCs the protos define (and every service they define), its engine matrix is the engine registry, its links
resolve, its docs index lists every page in docs/, and no page holds a hand-written test count or duration."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PENDING = {"docs/deployment.md", "docs/multihost.md"}
"""Pages the README links that are written alongside it (container images, several hosts): checked once they exist."""
PENDING_TARGETS = {"images", "test-images", "test-hosts"}
"""Makefile targets the README names that are being added alongside it: checked once they exist."""
OWN_PAGES = ["README.md", "docs/configuration.md", "docs/benchmarks.md", "docs/operations.md", "docs/engines.md",
             "docs/api.md", "docs/design.md"]


def _readme() -> str:
    return README.read_text()


def proto_rpcs() -> dict[str, set[str]]:
    """Every service the protos define, with its RPC names."""
    out: dict[str, set[str]] = {}
    for proto in sorted((ROOT / "protos").rglob("*.proto")):
        service = None
        for line in proto.read_text().splitlines():
            if m := re.match(r"\s*service\s+(\w+)\s*\{", line):
                service = m.group(1)
                out[service] = set()
            elif service and (m := re.match(r"\s*rpc\s+(\w+)\s*\(", line)):
                out[service].add(m.group(1))
            elif service and re.match(r"^\}", line):
                service = None
    return out


def diagram(readme: str) -> str:
    """The first code block under "## Architecture"."""
    section = readme.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```\n(.*?)```", section, re.S)
    assert m, "no diagram under ## Architecture"
    return m.group(1)


def diagram_problems(text: str, rpcs: dict[str, set[str]]) -> list[str]:
    """What the diagram names that the protos do not define, and what it leaves out."""
    out = []
    named: dict[str, set[str]] = {}
    for service, methods in re.findall(r"\b(\w+Service)/(\{[^}]*\}|\*|\w+)", text):
        names = {"*"} if methods == "*" else {n.strip() for n in methods.strip("{}").split(",")}
        named.setdefault(service, set()).update(names)
        if service not in rpcs:
            out.append(f"{service} is not a service in protos/")
            continue
        out += [f"{service}/{n} is not an RPC in protos/" for n in sorted(names - {"*"} - rpcs[service])]
    out += [f"the diagram leaves out {s}" for s in sorted(set(rpcs) - set(named))]
    qualified = re.sub(r"\b\w+Service/(\{[^}]*\}|\*|\w+)", "", text)
    every_rpc = set().union(*rpcs.values())
    out += [f"{w} is written without its service (Service/{w})" for w in sorted(set(re.findall(r"\b\w+\b", qualified))
                                                                                 & every_rpc)]
    return out


def test_the_readme_is_short() -> None:
    assert len(_readme().splitlines()) <= 250


def test_it_opens_with_exactly_the_two_commands_and_both_are_targets() -> None:
    first = re.search(r"```bash\n(.*?)```", _readme(), re.S)
    assert first and _readme().index(first.group(0)) < _readme().index("\n## ")
    commands = [line.split("#")[0].strip() for line in first.group(1).splitlines() if line.strip()]
    assert commands == ["make run", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    run = re.search(r"^run:(.*)$", makefile, re.M)
    test = re.search(r"^test:(.*)$", makefile, re.M)
    assert run and test
    # From a fresh machine: run builds the venv and the model first; test builds everything the suites start.
    assert {"venv", "model"} <= set(run.group(1).split())
    builds = {"venv", "model", "sysdeps", "lint-proto", "ts-client", "sglang-venv", "vllm-venv"}
    assert builds <= set(test.group(1).split())
    assert re.search(r"^\t\$\(PY\) -m embedmesh\.launcher", makefile[run.end():], re.M)
    assert re.search(r"^\t\$\(PY\) -m pytest tests\b", makefile[test.end():], re.M)


def test_every_make_target_the_readme_names_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    named = set(re.findall(r"`make ([\w-]+)", _readme()))
    assert {"run", "test", "bench"} <= named
    missing = named - targets
    assert missing <= PENDING_TARGETS, f"the README names make targets the Makefile lacks: {sorted(missing)}"
    if missing:
        pytest.skip(f"targets being added alongside the README: {sorted(missing)}")


def test_the_diagram_names_real_rpcs_and_every_service() -> None:
    rpcs = proto_rpcs()
    assert {"InferenceService", "WorkerService", "RouterService"} <= set(rpcs)
    assert "GenerateMany" in rpcs["WorkerService"] and "RouteMany" in rpcs["RouterService"]
    assert diagram_problems(diagram(_readme()), rpcs) == []


def test_the_diagram_check_catches_a_stale_name() -> None:
    rpcs = proto_rpcs()
    text = diagram(_readme())
    assert "RouterService/RouteMany" in text
    renamed = text.replace("RouterService/RouteMany", "RouterService/RouteAll")
    assert diagram_problems(renamed, rpcs) == ["RouterService/RouteAll is not an RPC in protos/"]
    grouped = text.replace("{GenerateInline,", "{GenerateLots,", 1)
    assert diagram_problems(grouped, rpcs) == ["InferenceService/GenerateLots is not an RPC in protos/"]
    bare = text.replace("RouterService/RouteMany", "RouteMany")
    assert diagram_problems(bare, rpcs) == ["RouteMany is written without its service (Service/RouteMany)"]
    assert diagram_problems(text, {**rpcs, "NewService": {"Go"}}) == ["the diagram leaves out NewService"]


def test_every_grpc_method_path_in_the_readme_exists() -> None:
    rpcs = proto_rpcs()
    paths = re.findall(r"embedmesh\.\w+\.v1\.(\w+)/(\w+)", _readme())
    assert paths  # the grpcurl example
    assert [f"{s}/{m}" for s, m in paths if m not in rpcs.get(s, set())] == []


def test_the_engine_matrix_is_the_registry() -> None:
    registry = (ROOT / "services/embedmesh/services/worker/engines/registry.py").read_text()
    registered = re.findall(r'^register\(EngineSpec\("([\w-]+)"', registry, re.M)
    assert registered
    section = _readme().split("\n## Engines\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert sorted(re.match(r"\| `([\w-]+)`", r).group(1) for r in rows) == sorted(registered)  # type: ignore[union-attr]


def test_the_examples_are_the_three_surfaces() -> None:
    readme = _readme()
    assert 'extra_body={"prompt_embeds"' in readme and "openai.OpenAI(" in readme
    assert "from embedmesh_client import Client" in readme
    assert (ROOT / "clients/python/src/embedmesh_client").is_dir()
    assert "grpcurl -plaintext" in readme


def _links(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"\w+://", t)
            and not t.startswith("#")]


@pytest.mark.parametrize("page", OWN_PAGES)
def test_every_relative_link_resolves(page: str) -> None:
    base = (ROOT / page).parent
    targets = {(base / link).resolve().relative_to(ROOT).as_posix() for link in _links(page) if link}
    missing = {t for t in targets if not (ROOT / t).exists()}
    assert missing <= PENDING, f"{page} links to missing files: {sorted(missing - PENDING)}"
    if missing:
        pytest.skip(f"pages being written alongside: {sorted(missing)}")


def test_the_docs_index_lists_every_page() -> None:
    index = _readme().split("\n## Documentation\n", 1)[1]
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    listed = set(re.findall(r"\]\((docs/[^)#]+\.md)\)", index))
    assert pages - listed == set()
    assert {"docs/configuration.md", "docs/benchmarks.md", "docs/operations.md", "docs/engines.md",
            "docs/ARCHITECTURE.md", "SECURITY.md"} <= listed | set(re.findall(r"\]\(([^)#]+\.md)\)", index))


@pytest.mark.parametrize("page", OWN_PAGES)
def test_no_hand_written_test_count_or_duration(page: str) -> None:
    text = (ROOT / page).read_text()
    counts = re.findall(r"\b\d[\d,]*\s+tests\b", text)
    durations = re.findall(r"make test[^.\n]*\b\d+\s*(?:min|minutes|m \d+ s|s)\b", text)
    assert counts == [] and durations == []
