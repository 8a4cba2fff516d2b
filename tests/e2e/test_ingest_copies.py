"""How many copies of a big prompt_embeds tensor each process holds at its peak, on a real echo mesh: the peak
resident memory a 64 MiB float32 tensor adds to the worker and to the preprocessor (VmHWM after a reset, against
the resident size before; the first big request, so the allocator has nothing to reuse).

Counted in payloads: the preprocessor receives the request bytes (gRPC's buffer and the bytes object it hands
over), reads the rows as a view of them (``transport.wire``) and sends them to the worker in 1 MiB pieces, each copied
just before it is sent (``worker_chunks.py``): ≤ 3.5 (2.6 measured). The worker copies each piece it receives into
rows it allocated once (``worker/chunks.py``): ≤ 2.5 (1.9 measured). Sent as one message (joined, then gRPC's
buffer and bytes object on the worker) the figures were 4.6 and 3.0; parsed with protobuf and read through
``.data``, 6.6 and 5.0: each bound fails if its fast path is lost."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.tensor.v1 import tensor_pb2
from tests.support import generate as gen
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def emesh() -> Iterator[Mesh]:
    m = start_mesh(engine="echo", extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
    yield m
    m.stop()


def _status(pid: str, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"{key} not in /proc/{pid}/status")


def _request(rows: np.ndarray) -> inference_pb2.CompletionParams:
    t = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=list(rows.shape), data=rows.tobytes())
    params = inference_pb2.CompletionParams(model="echo", prompt_embeds=[inference_pb2.PromptEmbeds(tensor=t)])
    params.sampling.max_tokens = 1
    return params


def test_a_big_tensor_is_held_at_most_4_times_by_the_worker_and_5_by_the_preprocessor(emesh: Mesh) -> None:
    rows = np.random.default_rng(0).standard_normal((29127, 576)).astype("<f4")  # 64 MiB
    opts = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
    with grpc.insecure_channel(emesh.preprocessor, options=opts) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        for _ in range(3):  # warm every code path with a small tensor first
            gen.complete(stub, _request(rows[:8]), timeout=60)
        children = subprocess.run(["pgrep", "-P", str(emesh.proc.pid)], capture_output=True, text=True).stdout.split()
        procs = {}
        for pid in children:
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read()
            for name in ("preprocessor.main", "worker.main"):
                if f"embedmesh.services.{name}" in cmd:  # one worker: the embedding worker is not started
                    procs[name] = pid
        assert set(procs) == {"preprocessor.main", "worker.main"}, procs
        time.sleep(0.3)
        base = {n: _status(p, "VmRSS") for n, p in procs.items()}
        for p in procs.values():
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")  # reset the peak (VmHWM) to the current resident size
        resp = gen.complete(stub, _request(rows), timeout=120)
    assert resp.usage.prompt_tokens == rows.shape[0]
    copies = {n: (_status(p, "VmHWM") - base[n]) / rows.nbytes for n, p in procs.items()}
    assert copies["worker.main"] <= 2.5, copies
    assert copies["preprocessor.main"] <= 3.5, copies
