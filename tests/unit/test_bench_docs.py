"""``make bench`` writes docs/benchmarks.md from the benchmarks' own output (``bench/docs_writer.py``,
``bench/run_all.py``): each script's section is replaced by what it printed, the rest of the page is kept, and the
page has one section for every script ``make bench`` runs."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "bench"))


writer = _load("docs_writer")
run_all = _load("run_all")

# What bench_lora.py prints (its progress lines, then its table), as the script writes it.
LORA_OUTPUT = textwrap.dedent("""\
    hf    base only     59.0 tok/s (8 clients)
    ... starting vllm mesh
    vllm  base only     72.3 tok/s (8 clients)

    | engine | requests | tokens/s, 8 clients | vs base |
    |---|---|---|---|
    | hf | base only | 59.0 | 1.00 |
    | hf | 4 adapters | 53.5 | 0.91 |
    """)

# What bench_router.py prints: fixed-width text, no markdown table.
ROUTER_OUTPUT = textwrap.dedent("""\
    ... building the index

    indexer: 1,000,064 (worker, block) entries, 656,520 distinct blocks, 64 workers
                                        embedmesh (Python)   Dynamo (Rust, documented)
      stored events: blocks / s                  2,830,000            ~9,000,000 ops/s
    FASTPATH_JSON {"not": "figures"}
    """)


def test_the_page_has_one_section_per_script_make_bench_runs() -> None:
    page = PAGE.read_text()
    for script in [*run_all.SCRIPTS, *writer.DEVICE_SCRIPTS]:
        begin, end = writer.markers(script)
        assert page.count(begin) == 1 and page.count(end) == 1, script
        assert page.index(begin) < page.index(end), script
    # no section of a script make bench (or a device run) no longer runs
    assert page.count("<!-- BEGIN ") == len(run_all.SCRIPTS) + len(writer.DEVICE_SCRIPTS)


def test_no_section_holds_a_figure_without_saying_where_it_came_from() -> None:
    """Every section is either the script's own output, text carried over once with its command, or empty."""
    page = PAGE.read_text()
    for script in run_all.SCRIPTS:
        text = writer.current(page, script)
        assert text is not None
        assert text.startswith(("Last run:", "Carried over from the README", "Not yet written by `make bench`")), script
        if text.startswith("Carried over"):
            assert f"`python bench/{script}" in text.split("\n", 1)[0], script


def test_a_markdown_table_stays_a_table_and_progress_lines_go() -> None:
    text = writer.figures(LORA_OUTPUT)
    assert "| hf | 4 adapters | 53.5 | 0.91 |" in text.splitlines()  # outside any code block
    assert "starting vllm mesh" not in text
    assert text.startswith("```text\nhf    base only     59.0 tok/s (8 clients)\nvllm  base only")
    assert text.count("```") == 2


def test_fixed_width_output_goes_in_a_text_block_without_machine_lines() -> None:
    text = writer.figures(ROUTER_OUTPUT)
    assert text.startswith("```text\nindexer: 1,000,064") and text.endswith("~9,000,000 ops/s\n```")
    assert "FASTPATH_JSON" not in text and "building the index" not in text


def test_a_run_replaces_its_own_section_and_nothing_else() -> None:
    page = PAGE.read_text()
    when = datetime(2026, 11, 27, 7, 5, tzinfo=UTC)
    new = writer.replace(page, "bench_lora.py", writer.section("bench_lora.py", ["--quick"], LORA_OUTPUT, when, 1.5))
    text = writer.current(new, "bench_lora.py")
    assert text is not None
    assert text.startswith("Last run: 2026-11-27 07:05 UTC, `python bench/bench_lora.py --quick` by `bench/run_all.py`")
    assert "load average 1.50" in text and "| hf | base only | 59.0 | 1.00 |" in text
    for script in run_all.SCRIPTS:
        if script != "bench_lora.py":
            assert writer.current(new, script) == writer.current(page, script)
    begin, end = writer.markers("bench_lora.py")
    assert new.split(begin)[0] == page.split(begin)[0] and new.split(end)[1] == page.split(end)[1]
    again = writer.replace(new, "bench_lora.py", writer.section("bench_lora.py", [], ROUTER_OUTPUT, when, 0.5))
    assert "| hf | base only" not in again and "indexer: 1,000,064" in again  # replaced, not appended


def test_a_script_new_to_make_bench_gets_a_section_at_the_end() -> None:
    new = writer.replace("# Benchmarks\n", "bench_new.py", "figures")
    begin, end = writer.markers("bench_new.py")
    assert new == f"# Benchmarks\n\n## bench_new.py\n\n{begin}\nfigures\n{end}\n"
    assert writer.current(new, "bench_new.py") == "figures"


def test_run_all_writes_what_a_script_printed_and_keeps_a_failed_scripts_section(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(PAGE.read_text())
    before = doc.read_text()
    outputs = {"bench_lora.py": (0, LORA_OUTPUT), "bench_router.py": (1, ROUTER_OUTPUT)}
    calls: list[tuple[str, list[str]]] = []

    def fake_run(path: Path, args: list[str]) -> tuple[int, str]:
        calls.append((path.name, args))
        return outputs[path.name]

    monkeypatch.setattr(run_all, "run", fake_run)
    monkeypatch.setattr(run_all.docs_writer, "DOC", doc)
    assert run_all.main(["--only", "bench_lora.py,bench_router.py", "--quick"]) == 1  # one failed
    assert calls == [("bench_lora.py", ["--quick"]), ("bench_router.py", ["--quick"])]
    after = doc.read_text()
    lora = writer.current(after, "bench_lora.py")
    assert lora is not None and "`python bench/bench_lora.py --quick`" in lora and "| hf | 4 adapters |" in lora
    assert writer.current(after, "bench_router.py") == writer.current(before, "bench_router.py")
    assert PAGE.read_text() == before  # the real page untouched


def test_run_all_refuses_a_script_it_does_not_know(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run_all.main(["--only", "bench_nothing.py"])
    assert "unknown script(s) bench_nothing.py" in capsys.readouterr().err


def test_run_all_runs_a_real_script_and_captures_its_output(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint('| a | b |')\nprint(sys.argv[1:])\n")
    code, output = run_all.run(script, ["--quick"])
    assert code == 0 and output == "| a | b |\n['--quick']\n"
