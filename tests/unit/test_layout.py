"""Tests mirror the tree: every module with logic (a function or a class at module level) has its test file at
the mirrored path.

- ``services/embedmesh/<path>/<m>.py`` -> ``tests/unit/<path>/test_<m>.py``
- ``services/embedmesh/<path>/<pkg>/__init__.py`` with logic -> ``tests/unit/<path>/<pkg>/test_init.py``
- ``gateway/embedmesh/gateway/<m>.py`` -> ``tests/unit/gateway/test_<m>.py``

Modules that only declare (constants, metric objects, re-exports) need none. The generated protobuf stubs live in
``gen/``, outside these trees.

Rooms stay small: no module of these trees over ``MAX_LINES`` lines, no function over cyclomatic complexity
``MAX_COMPLEXITY`` (radon's count, the figure ``radon cc -s services gateway`` prints; radon is a dev dependency
so the test and a person at the shell read the same number), except the few listed with the reason splitting them
would make them worse."""

from __future__ import annotations

import ast
from pathlib import Path

from radon.complexity import cc_visit

ROOT = Path(__file__).resolve().parents[2]
TREES = (ROOT / "services" / "embedmesh", ROOT / "gateway" / "embedmesh")
TESTS = ROOT / "tests" / "unit"


def has_logic(module: Path) -> bool:
    tree = ast.parse(module.read_text(), filename=str(module))
    return any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) for node in tree.body)


def mirrored_test(tree: Path, module: Path) -> Path:
    rel = module.relative_to(tree)
    name = "test_init.py" if rel.name == "__init__.py" else f"test_{rel.name}"
    return TESTS.joinpath(*rel.parts[:-1], name)


def modules_with_logic() -> list[tuple[Path, Path]]:
    return [(tree, m) for tree in TREES for m in sorted(tree.rglob("*.py")) if has_logic(m)]


def test_the_trees_are_where_this_test_looks() -> None:
    found = modules_with_logic()
    assert all(tree.is_dir() for tree in TREES)
    assert any(m.name == "servicer.py" for _, m in found) and any("gateway" in m.parts for _, m in found)


def test_the_rules() -> None:
    tree = TREES[0]
    assert mirrored_test(tree, tree / "services" / "worker" / "engines" / "vllm" / "kv_events.py") == (
        TESTS / "services" / "worker" / "engines" / "vllm" / "test_kv_events.py")
    assert mirrored_test(tree, tree / "services" / "worker" / "engines" / "hf" / "__init__.py") == (
        TESTS / "services" / "worker" / "engines" / "hf" / "test_init.py")
    assert mirrored_test(TREES[1], TREES[1] / "gateway" / "app.py") == TESTS / "gateway" / "test_app.py"


def _missing(tree: Path) -> list[tuple[Path, Path]]:
    return [(m.relative_to(ROOT), mirrored_test(t, m).relative_to(ROOT)) for t, m in modules_with_logic()
            if t == tree and not mirrored_test(t, m).is_file()]


def _check(tree: Path) -> None:
    missing = _missing(tree)
    assert not missing, (
        f"{len(missing)} module(s) with a function or class have no test at the mirrored path; add one (a test "
        "folder needs an __init__.py):\n" + "\n".join(f"  {m}  ->  {t}" for m, t in missing))


def test_every_service_module_with_logic_has_its_test_at_the_mirrored_path() -> None:
    _check(TREES[0])


def test_every_gateway_module_with_logic_has_its_test_at_the_mirrored_path() -> None:
    _check(TREES[1])


def test_every_test_folder_is_a_package() -> None:
    # Tests are imported by full name: a folder without __init__.py (e.g. one named vllm) could shadow a library.
    folders = {p.parent for p in TESTS.rglob("test_*.py")}
    assert not sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file())


MAX_LINES = 600
MAX_COMPLEXITY = 25

LONG_MODULES: dict[str, str] = {
    # path relative to the repository root -> why it may be longer than MAX_LINES (none today)
}
COMPLEX_FUNCTIONS: dict[str, str] = {
    # "path:qualified name" -> why it may be above MAX_COMPLEXITY (none today)
}
"""Listed entries are exempt, not required to be over: an entry whose room has shrunk can go."""


def _modules() -> list[Path]:
    return [m for tree in TREES for m in sorted(tree.rglob("*.py"))]


def _blocks(blocks: list) -> list:
    """Every function and method radon measures, nested ones included."""
    out = []
    for b in blocks:
        if hasattr(b, "methods"):
            out += _blocks(b.methods + getattr(b, "inner_classes", []))
        else:
            out.append(b)
            out += _blocks(getattr(b, "closures", []))
    return out


def test_no_module_is_longer_than_600_lines() -> None:
    found = {str(m.relative_to(ROOT)): len(m.read_text().splitlines()) for m in _modules()}
    long = {path: n for path, n in found.items() if n > MAX_LINES and path not in LONG_MODULES}
    assert not long, f"split these modules (at most {MAX_LINES} lines each): {long}"
    assert set(LONG_MODULES) <= set(found), "LONG_MODULES names a module that is gone"


def test_no_function_is_more_complex_than_25() -> None:
    found = {f"{m.relative_to(ROOT)}:{b.fullname}": b.complexity for m in _modules()
             for b in _blocks(cc_visit(m.read_text()))}
    complex_ = {name: cc for name, cc in found.items() if cc > MAX_COMPLEXITY and name not in COMPLEX_FUNCTIONS}
    assert not complex_, f"simplify these functions (cyclomatic complexity at most {MAX_COMPLEXITY}): {complex_}"
    assert set(COMPLEX_FUNCTIONS) <= set(found), "COMPLEX_FUNCTIONS names a function that is gone"



def _imports(module: Path) -> set[str]:
    tree = ast.parse(module.read_text(), filename=str(module))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_preprocessor_and_the_gateway_import_nothing_of_the_worker() -> None:
    # Rules both sides apply live in core/ (core/model_rules.py, core/embeds.py, core/sampling.py).
    rooms = [TREES[0] / "services" / "preprocessor", TREES[1]]
    found = {str(m.relative_to(ROOT)): sorted(n for n in _imports(m) if n.startswith("embedmesh.services.worker"))
             for room in rooms for m in room.rglob("*.py")}
    assert not {m: names for m, names in found.items() if names}
