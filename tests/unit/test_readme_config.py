"""The README's Configuration table names only variables some process reads: a renamed or removed variable fails
here instead of leaving operators a setting that does nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*ROOT.glob("services/embedmesh/**/*.py"), *ROOT.glob("gateway/embedmesh/**/*.py"), ROOT / "Makefile"]
# Config parsers that build names from a prefix: e("PORT") in the router's config reads EMBEDMESH_ROUTER_PORT.
PREFIXED = {"EMBEDMESH_ROUTER_": "services/embedmesh/services/router/config.py",
            "EMBEDMESH_VECTOR_STORE_": "services/embedmesh/services/vector_store/config.py"}


def _table_variables() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    names: list[str] = []
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        cell = row.split("|")[1]
        first = None
        for name in re.findall(r"`([A-Z_]+)`", cell):
            if name.startswith("_") and first is not None:  # `EMBEDMESH_ROUTER_PREFILL_WEIGHT` / `_DECODE_WEIGHT`
                name = first.rsplit("_", 2)[0] + name
            first = first or name
            names.append(name)
    return names


def _read_somewhere(name: str, corpus: str) -> bool:
    if re.search(rf"[\"'$]{{0,2}}\b{name}\b", corpus):
        return True
    for prefix, path in PREFIXED.items():
        if name.startswith(prefix) and f'"{name.removeprefix(prefix)}"' in (ROOT / path).read_text():
            return True
    return False


def test_every_variable_in_the_readme_table_is_read_by_the_code() -> None:
    names = _table_variables()
    assert len(names) >= 15, names  # the parser found the table
    corpus = "\n".join(p.read_text() for p in SOURCES)
    missing = [n for n in names if not _read_somewhere(n, corpus)]
    assert not missing, f"README's Configuration table names variables nothing reads: {missing}"
