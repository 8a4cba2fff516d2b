"""The image encode service as main builds it, with the real EfficientNet-Lite0 and SmolLM2's embedding matrix:
its rows for scikit-image's cat equal the preprocessor's in-process encoder's; a wrong projector stops start-up."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from embedmesh.core.server import mesh_channel
from embedmesh.core.tensors import from_numpy
from embedmesh.imageencoder.v1 import imageencoder_pb2, imageencoder_pb2_grpc
from embedmesh.services.image_encoder.config import ImageEncoderConfig
from embedmesh.services.image_encoder.main import build, start
from embedmesh.tensor.v1 import tensor_pb2

pytest.importorskip("efficientnet_lite_pytorch")


def chelsea() -> np.ndarray:
    path = Path(str(importlib.metadata.distribution("scikit-image").locate_file("skimage/data/chelsea.png")))
    return np.asarray(Image.open(path).convert("RGB"))


async def test_the_services_rows_are_the_in_process_encoders_rows() -> None:
    from embedmesh.models.convert import resolve_model_path
    from embedmesh.vision.stage import SoftPromptEncoder, encoder_digest

    local = SoftPromptEncoder(Path(resolve_model_path("default")))
    server = await start(ImageEncoderConfig(port=0))
    channel = mesh_channel(server.address)
    try:
        stub = imageencoder_pb2_grpc.ImageEncoderServiceStub(channel)
        assert (await stub.GetInfo(imageencoder_pb2.GetInfoRequest())).encodes == 0  # nothing loaded to answer
        info = await stub.GetInfo(imageencoder_pb2.GetInfoRequest(model="SmolLM2-135M-Instruct"))
        assert info.model.identity == local.identity and info.model.hidden_size == 576
        assert info.model.encoder_digest == encoder_digest(local.identity)
        pixels = chelsea()
        answer = await stub.Encode(imageencoder_pb2.EncodeRequest(
            model="SmolLM2-135M-Instruct", pixels=from_numpy(pixels, tensor_pb2.DATA_TYPE_UINT8),
            encoder_digest=info.model.encoder_digest))
        rows = np.frombuffer(answer.rows.data, np.float32).reshape(tuple(answer.rows.shape))
        assert np.array_equal(rows, local.encode(pixels)) and rows.shape[1] == 576
        assert answer.encode_seconds > 0
    finally:
        await channel.close()
        await server.drain()


def test_a_projector_of_the_wrong_width_stops_start_up_naming_the_file(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    save_file({"0.weight": np.zeros((768, 384), np.float32), "0.bias": np.zeros(768, np.float32),
               "2.weight": np.zeros((768, 768), np.float32), "2.bias": np.zeros(768, np.float32)},
              str(tmp_path / "mm_projector.safetensors"))
    with pytest.raises(ValueError, match="mm_projector.safetensors.*576"):
        build(ImageEncoderConfig(encoder="dinov2", image_projector=str(tmp_path)))
