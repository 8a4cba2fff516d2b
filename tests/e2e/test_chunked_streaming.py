"""A big Generate pieces prompt (one raw tensor of 8 MiB or more, in the model's dtype) goes on to its worker while it
arrives (``pieces.Arrival``, ``thresholds.ROUTE_BYTES``), on a real echo mesh: the answer is what one message
gives for the same tensor; a stream that breaks a rule part-way — a NaN in its last piece, bytes missing, bytes too
many — is answered with that rule by name, no response message goes out before the stream ended, and nothing
reaches the engine; rows go on to the worker before the client's last piece was sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from embedmesh.core.errors import from_rpc_error
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support import generate as gen
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

ROWS, HIDDEN = 4000, 576  # 9.2 MB of float32: past the 8 MiB streaming threshold
MiB = 1 << 20
OPTS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]


@pytest.fixture(scope="module")
def emesh() -> Iterator[Mesh]:
    m = start_mesh(engine="echo", extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
    yield m
    m.stop()


def _params(rows: np.ndarray, with_data: bool) -> inference_pb2.CompletionParams:
    t = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=list(rows.shape),
                          data=rows.tobytes() if with_data else b"")
    params = inference_pb2.CompletionParams(model="echo", prompt_embeds=[inference_pb2.PromptEmbeds(tensor=t)])
    params.sampling.max_tokens = 3
    return params


def _pieces(rows: np.ndarray, data: bytes | None = None) -> list[inference_pb2.GenerateRequest]:
    data = rows.tobytes() if data is None else data
    return [gen.header(completion=_params(rows, False))] \
        + [gen.rows(data[i:i + MiB]) for i in range(0, len(data), MiB)]


def _completed(mesh: Mesh) -> int:
    with grpc.insecure_channel(mesh.workers[0]) as ch:
        return int(worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=10)
                   .completed_requests)


def _rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((ROWS, HIDDEN)).astype("<f4")


def test_a_big_prompt_streamed_through_gives_what_complete_gives(emesh: Mesh) -> None:
    rows = _rows(0)
    with grpc.insecure_channel(emesh.preprocessor, options=OPTS) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        whole = gen.complete(stub, _params(rows, True), timeout=60)
        got = gen.whole(stub, iter(_pieces(rows)), timeout=60)
        events = list(gen.streamed(stub, iter(_pieces(rows)), timeout=60))
    assert [c.text for c in got.choices] == [c.text for c in whole.choices] and got.choices[0].text
    assert got.usage.prompt_tokens == whole.usage.prompt_tokens == ROWS
    assert "".join(e.text for e in events) == whole.choices[0].text
    assert events[-1].usage.total_tokens == whole.usage.total_tokens
    # n choices: each goes to a worker from the same arriving rows
    pieces = _pieces(rows)
    pieces[0].request.completion.n = 3
    with grpc.insecure_channel(emesh.preprocessor, options=OPTS) as ch:
        three = gen.whole(inference_pb2_grpc.InferenceServiceStub(ch), iter(pieces), timeout=60)
    assert [c.text for c in three.choices] == [whole.choices[0].text] * 3
    assert three.usage.prompt_tokens == ROWS


@pytest.mark.parametrize("case, field, reason", [
    ("NaN in the last piece", "prompt_embeds", "NON_FINITE"),
    ("bytes missing", "rows", "INCOMPLETE"),
    ("bytes too many", "rows", "TOO_MANY_BYTES"),
])
def test_a_stream_that_breaks_a_rule_part_way_is_refused_and_reaches_no_engine(emesh: Mesh, case: str, field: str,
                                                                                reason: str) -> None:
    rows = _rows(1)
    data = rows.tobytes()
    if case == "NaN in the last piece":
        bad = rows.copy()
        bad[-1, 5] = np.nan
        data = bad.tobytes()
    elif case == "bytes missing":
        data = data[:-4]
    else:
        data = data + b"\0" * 4
    before = _completed(emesh)
    with grpc.insecure_channel(emesh.preprocessor, options=OPTS) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            gen.whole(stub, iter(_pieces(rows, data)), timeout=60)
        got: list[inference_pb2.StreamCompleteResponse] = []
        with pytest.raises(grpc.RpcError) as info2:
            for e in gen.streamed(stub, iter(_pieces(rows, data)), timeout=60):
                got.append(e)
    for err in (info.value, info2.value):
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        e = from_rpc_error(err)
        assert (e.field, e.reason) == (field, reason), err.details()
    assert got == []  # nothing went out before the stream ended
    if case != "bytes too many":  # (the extra bytes come after every row the worker needs)
        assert _completed(emesh) == before  # nothing reached the engine


def test_rows_go_on_to_the_worker_before_the_last_piece_is_sent(emesh: Mesh) -> None:
    """The client holds its last piece back until the worker has received the start frame of a generation whose
    rows follow as rows frames: visible as the worker's generation in flight (waiting for its rows) while the
    client still holds a piece (nothing else runs on the mesh meanwhile)."""
    rows = _rows(2)
    pieces = _pieces(rows)
    release = threading.Event()
    seen_in_flight: list[bool] = []

    def messages() -> Iterator[inference_pb2.GenerateRequest]:
        yield from pieces[:-1]
        release.wait(30)
        yield pieces[-1]

    def watch() -> None:
        import urllib.request

        base = emesh.extra["metrics_base"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = urllib.request.urlopen(f"http://127.0.0.1:{base + 10}/metrics", timeout=10).read().decode()
            if any(line.startswith('embedmesh_rpc_in_flight{method="GenerateMany.generation"')
                   and not line.endswith(" 0.0") for line in text.splitlines()):
                seen_in_flight.append(True)
                break
            time.sleep(0.02)
        release.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    with grpc.insecure_channel(emesh.preprocessor, options=OPTS) as ch:
        got = gen.whole(inference_pb2_grpc.InferenceServiceStub(ch), messages(), timeout=60)
    watcher.join()
    assert got.usage.prompt_tokens == ROWS
    assert seen_in_flight == [True]
