"""``make bench``: run every benchmark script in turn (never in parallel: 2 cores) and print their tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ["bench_fastpath.py", "bench_cpu.py", "bench_mesh.py", "bench_encoder_cache.py", "bench_router.py",
           "bench_clients.py",
           "bench_embeddings.py", "bench_vector_store.py",
           "bench_vector_search_e2e.py", "bench_vllm.py", "overload.py", "bench_openai_surface.py",
           "bench_structured.py", "bench_lora.py"]


def main() -> int:
    failed = []
    for name in SCRIPTS:
        path = HERE / name
        if not path.exists():
            continue
        print(f"\n===== {name} =====", flush=True)
        r = subprocess.run([sys.executable, str(path), *sys.argv[1:]], cwd=HERE.parent)
        if r.returncode:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
