"""Write a benchmark's figures into ``docs/benchmarks.md``, from the benchmark's own output.

Each script ``make bench`` runs owns one section of the page, between two markers::

    <!-- BEGIN bench_lora.py: written by make bench ... -->
    ...the run's command, when and where it ran, and what the script printed...
    <!-- END bench_lora.py -->

``bench/run_all.py`` captures what a script prints and, when the script succeeded, replaces the text between its
markers with :func:`section` of that output, so no figure on the page is ever copied by hand: the page always shows
the last successful run of each script. Text outside the markers is written by people and kept as it is.
"""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
_PROGRESS = re.compile(r"^\s*(\.\.\.|FASTPATH_JSON |=====)")
"""Lines that report progress or carry machine-readable data, not figures: left off the page."""


DEVICE_SCRIPTS = {"gpu_check.py": "scripts/gpu_check.py --record"}
"""Checks that run only on a lent GPU machine, never in ``make bench``: each section is written from the log the
device run sent back, by the command named here."""


def markers(script: str) -> tuple[str, str]:
    """The two marker lines around ``script``'s section."""
    by = DEVICE_SCRIPTS.get(script)
    if by:
        return (f"<!-- BEGIN {script}: written by {by} from a device run's log; edits here are overwritten -->",
                f"<!-- END {script} -->")
    return (f"<!-- BEGIN {script}: written by make bench (bench/run_all.py) from the script's output; "
            f"edits here are overwritten -->", f"<!-- END {script} -->")


def figures(output: str) -> str:
    """The script's output as markdown: its markdown tables as they are, everything else in ``text`` blocks.

    Progress lines (``... ``) and machine-readable lines are dropped; blank lines at either end of a block too.
    """
    blocks: list[tuple[bool, list[str]]] = []
    for line in output.splitlines():
        if _PROGRESS.match(line):
            continue
        is_table = line.lstrip().startswith("|")
        if not blocks or blocks[-1][0] != is_table:
            blocks.append((is_table, []))
        blocks[-1][1].append(line.rstrip())
    out = []
    for is_table, lines in blocks:
        while lines and not lines[0].strip():
            lines.pop(0)
        while lines and not lines[-1].strip():
            lines.pop()
        if not lines:
            continue
        out.append("\n".join(lines) if is_table else "```text\n" + "\n".join(lines) + "\n```")
    return "\n\n".join(out)


def section(script: str, args: list[str], output: str, when: datetime | None = None,
            load: float | None = None) -> str:
    """The text between ``script``'s markers for one successful run with ``args`` that printed ``output``."""
    when = when or datetime.now(UTC)
    load = os.getloadavg()[0] if load is None else load
    command = " ".join(["python", f"bench/{script}", *args])
    head = (f"Last run: {when:%Y-%m-%d %H:%M} UTC, `{command}` by `bench/run_all.py` "
            f"({os.cpu_count()} CPUs, load average {load:.2f} at its end).")
    body = figures(output)
    return head + "\n\n" + (body if body else "(the script printed no figures)")


def replace(page: str, script: str, text: str) -> str:
    """``page`` with the text between ``script``'s markers replaced by ``text``.

    A page without the script's markers gets a new section at its end (a script added to ``make bench``).
    """
    begin, end = markers(script)
    if begin not in page or end not in page:
        return page.rstrip("\n") + f"\n\n## {script}\n\n{begin}\n{text}\n{end}\n"
    start, stop = page.index(begin) + len(begin), page.index(end)
    if stop < start:
        raise ValueError(f"docs/benchmarks.md: the END marker of {script} comes before its BEGIN marker")
    return page[:start] + "\n" + text + "\n" + page[stop:]


def current(page: str, script: str) -> str | None:
    """The text between ``script``'s markers, or None when the page has none."""
    begin, end = markers(script)
    if begin not in page or end not in page:
        return None
    return page[page.index(begin) + len(begin):page.index(end)].strip("\n")


def write(script: str, args: list[str], output: str, doc: Path | None = None) -> None:
    """Put one successful run's figures on the page (``doc``, default :data:`DOC`), leaving every other section."""
    doc = doc or DOC
    page = doc.read_text() if doc.exists() else "# Benchmarks\n"
    doc.write_text(replace(page, script, section(script, args, output)))
