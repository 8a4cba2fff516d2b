"""``make bench``: run every benchmark script in turn (never in parallel: 2 cores), print their tables, and write
each script's figures into its section of ``docs/benchmarks.md`` (``bench/docs_writer.py``).

    python bench/run_all.py [--only bench_lora.py,bench_cpu.py] [--no-docs] [ARGS passed to every script, e.g. --quick]

A script that fails leaves its section as the last successful run wrote it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import docs_writer  # noqa: E402  (a sibling module; bench/ is not a package)

SCRIPTS = ["bench_fastpath.py", "bench_cpu.py", "bench_mesh.py", "bench_encoder_cache.py", "bench_router.py",
           "bench_peers.py", "bench_clients.py",
           "bench_embeddings.py", "bench_vector_store.py",
           "bench_vector_search_e2e.py", "bench_vllm.py", "overload.py", "bench_openai_surface.py",
           "bench_structured.py", "bench_lora.py", "bench_fleet.py", "bench_fairshare.py", "bench_abuse.py",
           "bench_prompt_cache.py", "bench_batch.py", "bench_migration.py", "bench_responses_turns.py",
           "bench_hf_prefix.py", "bench_hf_routing.py", "bench_refusal_cpu.py", "bench_image_affinity.py"]


def run(path: Path, args: list[str]) -> tuple[int, str]:
    """Run one script, echoing its output as it comes, and return its exit status and everything it printed."""
    proc = subprocess.Popen([sys.executable, str(path), *args], cwd=HERE.parent, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    captured = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        captured.append(line)
    return proc.wait(), "".join(captured)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--only", default="", help="comma-separated scripts to run (default: all of them)")
    p.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md as it is")
    a, passed = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    chosen = [s.strip() for s in a.only.split(",") if s.strip()] or SCRIPTS
    unknown = [s for s in chosen if s not in SCRIPTS]
    if unknown:
        p.error(f"unknown script(s) {', '.join(unknown)}; known: {', '.join(SCRIPTS)}")
    failed = []
    for name in chosen:
        path = HERE / name
        if not path.exists():
            continue
        print(f"\n===== {name} =====", flush=True)
        code, output = run(path, passed)
        if code:
            failed.append(name)
        elif not a.no_docs:
            docs_writer.write(name, passed, output)
            print(f"(figures written to docs/benchmarks.md, section {name})", flush=True)
    if failed:
        print(f"\nfailed (their sections in docs/benchmarks.md left as they were): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
