"""The preprocessor's ``embedmesh_preprocessor_generate_total`` read from its metrics port: how many Generate calls
it took, by (task, stream, transport) — transport ``pieces`` when the prompt tensors' bytes came as rows after the
header, ``message`` when they came in it."""

from __future__ import annotations

import urllib.request

__all__ = ["generate_calls", "grew"]

_NAME = "embedmesh_preprocessor_generate_total{"


def generate_calls(metrics_port: int) -> dict[tuple[str, str, str], float]:
    """{(task, stream, transport): count}, e.g. ("completion", "false", "pieces")."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: dict[tuple[str, str, str], float] = {}
    for line in text.splitlines():
        if not line.startswith(_NAME):
            continue
        labels = dict(part.split("=", 1) for part in line[len(_NAME):line.index("}")].split(","))
        key = tuple(labels[k].strip('"') for k in ("task", "stream", "transport"))
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])  # type: ignore[index]
    return out


def grew(before: dict[tuple[str, str, str], float], after: dict[tuple[str, str, str], float], task: str,
         stream: bool, transport: str) -> float:
    """How many calls of that kind were taken between the two readings."""
    key = (task, "true" if stream else "false", transport)
    return after.get(key, 0.0) - before.get(key, 0.0)
