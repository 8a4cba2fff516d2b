"""LoRA adapters at run time, with vLLM's routes and bodies: ``POST /v1/load_lora_adapter {"lora_name",
"lora_path"}`` and ``POST /v1/unload_lora_adapter {"lora_name"}``. They call the admin RPCs of the public gRPC API
(``InferenceService.LoadLoraAdapter`` / ``UnloadLoraAdapter``); the preprocessor checks the caller's key is an admin
key (with keys configured), so the gateway holds no privilege of its own. A loaded adapter is a model: it appears in
``/v1/models`` with ``parent`` = its base model, and requests name it as ``model``."""

from __future__ import annotations

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from embedmesh.gateway.context import Gateway
from embedmesh.gateway.errors import bad_request, from_grpc
from embedmesh.gateway.requests import LoadLoraRequest, UnloadLoraRequest, parse
from embedmesh.inference.v1 import inference_pb2

__all__ = ["routes"]

_TIMEOUT_S = 600.0


def routes(gw: Gateway) -> list[Route]:
    async def load(request: Request) -> Response:
        r = parse(LoadLoraRequest, await gw.read_json(request))
        req = inference_pb2.LoadLoraAdapterRequest(lora_name=r.lora_name, lora_path=r.lora_path, workers=r.workers)
        try:
            await gw.stub.LoadLoraAdapter(req, timeout=_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload(request: Request) -> Response:
        r = parse(UnloadLoraRequest, await gw.read_json(request))
        req = inference_pb2.UnloadLoraAdapterRequest(lora_name=r.lora_name)
        try:
            await gw.stub.UnloadLoraAdapter(req, timeout=_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def sleep(request: Request) -> Response:
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise bad_request("level", "must be 1 or 2", "invalid_value")
        try:
            resp = await gw.stub.SleepWorkers(inference_pb2.SleepWorkersRequest(level=int(level)), timeout=_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return JSONResponse({"workers": list(resp.workers)})

    async def wake_up(request: Request) -> Response:
        try:
            resp = await gw.stub.WakeUpWorkers(inference_pb2.WakeUpWorkersRequest(), timeout=_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return JSONResponse({"workers": list(resp.workers)})

    async def is_sleeping(request: Request) -> Response:
        try:
            resp = await gw.stub.IsSleeping(inference_pb2.IsSleepingRequest(), timeout=60)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return JSONResponse({"is_sleeping": resp.is_sleeping, "sleeping_workers": list(resp.sleeping)})

    return [Route("/v1/load_lora_adapter", load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload, methods=["POST"]),
            # vLLM's sleep-mode routes (its dev-mode names); the admin plane, like the LoRA routes.
            Route("/sleep", sleep, methods=["POST"]), Route("/wake_up", wake_up, methods=["POST"]),
            Route("/is_sleeping", is_sleeping, methods=["GET"])]
