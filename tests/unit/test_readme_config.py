"""``docs/configuration.md`` matches the code: the generated tables are exactly what ``scripts/config_table.py``
renders from the config dataclasses (every field's variable is listed, none that nothing reads), every variable the
hand-written rows name is read somewhere, and the README sends its readers there."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*ROOT.glob("services/embedmesh/**/*.py"), *ROOT.glob("gateway/embedmesh/**/*.py"), ROOT / "Makefile"]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLE = _script()


def _names(text: str) -> set[str]:
    return set(re.findall(r"`((?:EMBEDMESH|REDIS|OTEL)_[A-Z0-9_]+)`", text))


def _config_variables() -> set[str]:
    """Every variable a config dataclass reads: its own names and their aliases."""
    return {name.lstrip("!") for _, _, cls in TABLE.configs() for o in cls.options() for name in (o.env, *o.aliases)}


def problems(page: str, corpus: str) -> list[str]:
    """What is wrong with docs/configuration.md's text (empty when it matches the code)."""
    generated = TABLE.generated_block(page)
    if not generated:
        return ["the generated tables' markers are missing"]
    out = []
    read = _config_variables()
    listed = _names(generated)
    out += [f"{n} is read by a config but missing from the table" for n in sorted(read - listed)]
    out += [f"{n} is in the generated table but no config reads it" for n in sorted(listed - read)]
    if not out and generated != TABLE.render():
        out.append("the generated tables differ from scripts/config_table.py's output (flags, defaults or help)")
    by_hand = page.replace(generated, "")
    out += [f"{n} (hand-written row) is read by nothing" for n in sorted(_names(by_hand) - read)
            if not re.search(rf"\b{n}\b", corpus)]
    return out


def _readme() -> str:
    """docs/configuration.md, where the README's configuration tables moved (the name stays for the tests below)."""
    return (ROOT / "docs" / "configuration.md").read_text()


def _corpus() -> str:
    return "\n".join(p.read_text() for p in SOURCES)


def test_the_configuration_page_matches_the_code() -> None:
    assert TABLE.configs(), "no config listed in scripts/config_table.py"
    assert len(_names(TABLE.generated_block(_readme()))) >= 40  # the tables are there
    assert problems(_readme(), _corpus()) == []


def test_the_readme_links_the_configuration_page_and_holds_no_table_of_its_own() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "(docs/configuration.md)" in readme
    assert TABLE.BEGIN not in readme and TABLE.END not in readme


def test_missing_markers_fail() -> None:
    assert problems(_readme().replace(TABLE.BEGIN, ""), _corpus()) == ["the generated tables' markers are missing"]


def test_a_variable_missing_from_the_table_fails() -> None:
    readme = _readme()
    row = next(r for r in readme.splitlines() if r.startswith("| `EMBEDMESH_ROUTER_TEMPERATURE`"))
    assert problems(readme.replace(row + "\n", ""), _corpus()) == [
        "EMBEDMESH_ROUTER_TEMPERATURE is read by a config but missing from the table"]


def test_a_variable_nothing_reads_fails_in_either_table() -> None:
    readme = _readme()
    stale = readme.replace("`EMBEDMESH_ROUTER_TEMPERATURE`", "`EMBEDMESH_ROUTER_HEAT`", 1)
    assert "EMBEDMESH_ROUTER_HEAT is in the generated table but no config reads it" in problems(stale, _corpus())
    by_hand = readme.replace("`EMBEDMESH_TRACE_CONSOLE`", "`EMBEDMESH_TRACE_QUIET`", 1)
    assert problems(by_hand, _corpus()) == ["EMBEDMESH_TRACE_QUIET (hand-written row) is read by nothing"]


def test_a_stale_default_or_help_fails() -> None:
    readme = _readme()
    row = "| `EMBEDMESH_ROUTER_PORT` | `--port` | `50081` |"
    stale = readme.replace(row, row.replace("50081", "1"))
    assert stale != readme
    assert problems(stale, _corpus()) == [
        "the generated tables differ from scripts/config_table.py's output (flags, defaults or help)"]


def test_the_script_checks_and_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert TABLE.main(["--check"]) == 0
    assert TABLE.main([]) == 0
    assert capsys.readouterr().out == TABLE.render() + "\n"
