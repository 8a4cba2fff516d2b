"""Thin gRPC adapter: WorkerService messages in, engine calls, messages out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from embedmesh.core import tensors
from embedmesh.core.errors import EmbedmeshError, FailedPrecondition, InvalidArgument, ResourceExhausted
from embedmesh.core.logs import get_logger
from embedmesh.core.server import MiB
from embedmesh.core.transport import pieces, wire
from embedmesh.services.worker.coalesce import coalesced
from embedmesh.services.worker.engines.base import Engine
from embedmesh.services.worker.lora_paths import default_lora_root, relative_to_root, resolve_adapter_path
from embedmesh.services.worker.many import ManyStreams, embeds_of
from embedmesh.services.worker.messages import delta_to_proto, info_to_proto, request_from_proto
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["WorkerServicer"]

log = get_logger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    request_parsers = {"GenerateMany": wire.parse_generate_many}
    """Request deserializers ``Server.add`` uses instead of protobuf's: a rows frame's bytes stay uncopied."""

    def __init__(self, engine: Engine, worker_id: str, lora_root: Path | None = None, max_queue: int = 64,
                 max_message_bytes: int = 512 * MiB) -> None:
        self.engine = engine
        self.max_message_bytes = max_message_bytes
        """The server's message size limit: also the most a generation's ``rows`` frames may add up to."""
        self.max_queue = max_queue
        """Sequences that may wait beyond a full batch; past them a generation is refused at once."""
        self.worker_id = worker_id
        self.lora_root = lora_root or default_lora_root()
        """LoRA adapters load only from folders under this one."""
        self.many = ManyStreams(self.generate, self._expect)
        """The GenerateMany streams (``worker/many.py``); ``main`` calls ``many.start_drain`` when a drain starts."""

    def _expect(self, request: worker_pb2.GenerateRequest) -> pieces.Arrival | None:
        """The rows a start frame's data-less embeds tensors wait for (``rows`` frames), NaN/Inf-scanned as they
        arrive when they come in the model's dtype (``request_from_proto`` then skips that scan for them)."""
        # one read of each tensor's data (a read copies it: cheap next to the request, whose rows come inline)
        dataless = [(path, t) for path, t in embeds_of(request) if not len(t.data)]
        if not dataless:
            return None
        kinds = [t.dtype for _, t in dataless if t.dtype in tensors.DTYPES]
        scan = None
        if kinds:
            model_dtype = tensors.dtype_from_name(self.engine.info().dtype)  # set before the engine is ready
            if all(k == model_dtype for k in kinds):
                scan = pieces.finite_scan(model_dtype, "prompt_embeds")
        return pieces.expect(request, lambda _: dataless, self.max_message_bytes, scan)

    async def generate(self, request: worker_pb2.GenerateRequest, arrival: pieces.Arrival | None = None
                       ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """One generation of a GenerateMany stream (``arrival``: its rows, when they came as ``rows`` frames)."""
        # Every engine relies on these checks (sampling ranges, finite rows, shapes, token ids, context), whoever
        # sent the request: they run here, once, for all engines.
        req = request_from_proto(request, await self.engine.ready_info(), arrival)
        if req.resumed and not self.engine.resumes:
            raise FailedPrecondition(f"resume_token_ids: the {self.engine.info().engine} engine cannot continue a "
                                     "generation", field="resume_token_ids", reason="RESUME_UNSUPPORTED")
        self._admit()
        prompt_len = req.prompt_len
        wants_text = req.sampling.logprobs is not None or req.sampling.prompt_logprobs is not None
        token_text = self.engine.token_text if wants_text else None
        async for delta in coalesced(self.engine.generate(req)):
            yield delta_to_proto(delta, prompt_len, token_text)

    async def GenerateMany(  # noqa: N802
        self, request_iterator: AsyncIterator[worker_pb2.GenerateManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateManyResponse]:
        async for results in self.many.serve(request_iterator):
            yield results

    def _admit(self) -> None:
        """Refuse a sequence at once when a full batch is running and ``max_queue`` more already wait."""
        limit = self.engine.info().max_batch_size + self.max_queue
        if self.engine.stats().active_requests >= limit:
            raise ResourceExhausted(f"the worker is at capacity ({limit} sequences running or queued); retry shortly",
                                    reason="WORKER_BUSY", retry_after_seconds=1.0)

    async def Abort(  # noqa: N802
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(aborted=await self.engine.abort(request.request_id))

    async def GetInfo(  # noqa: N802
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetInfoResponse:
        return info_to_proto(self.engine.info(), self.worker_id, self.engine.resumes)

    async def Embed(  # noqa: N802
        self, request: worker_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.EmbedResponse:
        inputs: list[str | list[int]] = [
            i.text if i.WhichOneof("kind") == "text" else list(i.token_ids.ids) for i in request.inputs
        ]
        if not inputs:
            raise InvalidArgument("input: at least one input is required", field="input", reason="EMPTY")
        dimensions = request.dimensions if request.HasField("dimensions") else None
        try:
            vectors, tokens = await self.engine.embed(inputs, dimensions)
        except NotImplementedError:
            raise FailedPrecondition(f"model: {self.engine.info().model} does not produce embeddings",
                                     field="model", reason="WRONG_TASK") from None
        return worker_pb2.EmbedResponse(embeddings=tensors.from_numpy(vectors), prompt_tokens=sum(tokens),
                                        input_tokens=tokens)

    async def _admin(self, what: str, call: Any) -> Any:
        try:
            return await call
        except NotImplementedError:
            raise FailedPrecondition(f"{what} is not supported by the {self.engine.info().engine} engine",
                                     reason="UNSUPPORTED_BY_ENGINE") from None

    async def LoadLoraAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        if not request.name or not request.path:
            field = "name" if not request.name else "path"
            raise InvalidArgument(f"{field} is required", field=field, reason="REQUIRED")
        path = resolve_adapter_path(request.path, self.lora_root)
        try:
            loaded = await self._admin("LoRA", self.engine.load_lora(request.name, str(path)))
        except EmbedmeshError as e:  # engines name the folder they opened: answer with the caller's path
            e.message = relative_to_root(e.message, self.lora_root)
            e.args = (e.message,)
            raise
        return worker_pb2.LoadLoraAdapterResponse(loaded=loaded)

    async def UnloadLoraAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        return worker_pb2.UnloadLoraAdapterResponse(
            unloaded=await self._admin("LoRA", self.engine.unload_lora(request.name)))

    async def ListLoraAdapters(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        adapters = await self._admin("LoRA", self.engine.list_loras())
        return worker_pb2.ListLoraAdaptersResponse(
            adapters=[worker_pb2.LoraAdapter(name=n, path=relative_to_root(p, self.lora_root))
                      for n, p in sorted(adapters.items())])

    async def Sleep(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        if request.level not in (1, 2):
            raise InvalidArgument("level must be 1 or 2", field="level", reason="OUT_OF_RANGE")
        await self._admin("sleep", self.engine.sleep(request.level))
        return worker_pb2.SleepResponse()

    async def WakeUp(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._admin("wake up", self.engine.wake_up())
        return worker_pb2.WakeUpResponse()

    async def ClearKvBlocks(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        return worker_pb2.ClearKvBlocksResponse(cleared=await self._admin("clearing KV blocks",
                                                                          self.engine.clear_kv_blocks()))

    async def GetStats(  # noqa: N802
        self, request: worker_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetStatsResponse:
        s = self.engine.stats()
        return worker_pb2.GetStatsResponse(
            active_requests=s.active_requests,
            queued_requests=s.queued_requests,
            completed_requests=s.completed_requests,
            aborted_requests=s.aborted_requests,
            generated_tokens=s.generated_tokens,
            max_batch_seen=s.max_batch_seen,
            sleeping=s.sleeping,
        )
