"""``/v1/files`` (OpenAI Files) translated 1:1 to ``embedmesh.vectorstore.v1.VectorStoreService``.

    POST   /v1/files                  multipart: file, purpose -> file object
    GET    /v1/files                  ?purpose&limit&order&after -> list
    GET    /v1/files/{file_id}        -> file object
    DELETE /v1/files/{file_id}        -> {id, object: "file", deleted: true}
    GET    /v1/files/{file_id}/content -> the bytes

A body that is not well-formed multipart (no boundary, a part without a name, two files) or lacks the ``file`` or
``purpose`` field is a 400 naming the field. The service decides what is accepted (text-like files only: plain
text, Markdown, JSON; anything else is a 400 naming the type) and the size cap; the upload streams to it in 1 MiB
chunks.

``purpose=batch`` files are the Batch API's (``batches.py``): kept in the batch store, checked as JSONL at upload
(a 400 naming the line).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from embedmesh.gateway.batches import Batches, list_page, tenant_of
from embedmesh.gateway.context import Gateway, too_large
from embedmesh.gateway.errors import ApiError, bad_request, from_grpc
from embedmesh.gateway.paging import list_json, page_request
from embedmesh.gateway.vector_store_client import VectorStoreClient, json_response
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb

__all__ = ["routes"]

_CHUNK = 1 << 20
BATCH_PURPOSES = ("batch", "batch_output")


def file_json(f: pb.File) -> dict[str, Any]:
    return {"id": f.id, "object": "file", "bytes": f.size_bytes, "created_at": f.created_at, "filename": f.filename,
            "purpose": f.purpose, "status": "processed", "status_details": None, "expires_at": None}


async def _parse_form(request: Request, limit: int) -> FormData:
    """The multipart body, or a 400 naming ``file`` that says what is wrong with it (no boundary, a part without a
    name, more than one file, a field over 1 MiB, bytes that are not multipart); 413 past ``limit`` bytes, counted
    as they arrive (the declared length is a claim, and a chunked body declares none): the parser would otherwise
    spool a file of any size to the gateway's disk."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit)
    receive, seen = request.receive, 0

    async def bounded() -> Any:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise too_large(limit)
        return message

    try:
        return await Request(request.scope, bounded).form(max_files=1, max_fields=16)
    except (HTTPException, MultiPartException) as e:  # starlette turns MultiPartException into a 400 HTTPException
        detail = e.detail if isinstance(e, HTTPException) else e.message
        raise bad_request("file", f"malformed multipart/form-data body: {detail} Send fields 'file' (the file) and "
                                  "'purpose', as the openai SDK's files.create does", "invalid_multipart") from None
    except ClientDisconnect:
        raise ApiError(499, "the client closed the connection while sending the body",
                       code="client_disconnected") from None


def routes(gateway: Gateway, client: VectorStoreClient | None = None, batches: Batches | None = None) -> list[Route]:
    """The ``/v1/files`` routes; pass the same ``client`` as to ``vector_stores.routes`` to share one channel.
    With ``batches``, ``purpose=batch`` files (and the batches' output files) live in its store, not the vector
    store's: checked as JSONL when uploaded, listed by ``purpose=batch`` or ``batch_output``, and found first
    there by id."""
    vs = client or VectorStoreClient(gateway)

    async def batch_file(request: Request) -> dict[str, Any] | None:
        """The batch store's file of this id, None to ask the vector store; a 404 when there is none to ask."""
        if batches is None:
            return None
        fid = request.path_params["file_id"]
        found = await batches.store.file(tenant_of(request), fid)
        if found is None and not gateway.config.vector_store:
            raise ApiError(404, f"no file {fid!r}", param="file_id", code="not_found", type_="not_found_error")
        return found

    async def create(request: Request) -> Response:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise bad_request("file", "upload the file as multipart/form-data with fields 'file' and 'purpose'",
                              "invalid_content_type")
        form = await _parse_form(request, gateway.config.max_body_bytes)
        try:
            upload = form.get("file")
            purpose = form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("file", "is required (a multipart file field)", "missing")
            if not isinstance(purpose, str) or not purpose:
                raise bad_request("purpose", "is required", "missing")
            if batches is not None and purpose in BATCH_PURPOSES:
                if purpose != "batch":
                    raise bad_request("purpose", "batch_output files are written by batches, not uploaded")
                cap = gateway.config.batch_max_file_bytes
                content = await upload.read(cap + 1)  # bounded: the spooled upload is read up to the cap only
                return json_response(await batches.add_input_file(request, upload.filename or "", content))
            header = pb.UploadFileHeader(filename=upload.filename or "", purpose=purpose,
                                         content_type=upload.content_type or "")

            async def parts() -> AsyncIterator[pb.UploadFileRequest]:
                yield pb.UploadFileRequest(header=header)
                while chunk := await upload.read(_CHUNK):
                    yield pb.UploadFileRequest(chunk=chunk)

            try:
                r = await vs.stub().UploadFile(parts(), timeout=vs.timeout)
            except grpc.aio.AioRpcError as e:
                raise from_grpc(e) from None
        finally:
            await form.close()  # the spooled temporary file of the upload
        return json_response(file_json(r.file))

    async def list_files(request: Request) -> Response:
        purpose = request.query_params.get("purpose", "")
        # Batch files by their purposes; all of them when there is no vector store to hold any other file.
        if batches is not None and (purpose in BATCH_PURPOSES or not (purpose or gateway.config.vector_store)):
            page = page_request(request, before=False)
            if page.limit > 100:
                raise bad_request("limit", "must be in [1, 100]")
            data, more = await batches.store.list_files(tenant_of(request), (purpose,) if purpose else BATCH_PURPOSES,
                                                        page.after, page.limit or 20, page.order == pb.SORT_ORDER_ASC)
            return json_response(list_page(data, more))
        req = pb.ListFilesRequest(purpose=request.query_params.get("purpose", ""),
                                  page=page_request(request, before=False))
        r = await vs.call("ListFiles", req)
        return json_response(list_json([file_json(f) for f in r.data], r.page))

    async def retrieve(request: Request) -> Response:
        if (found := await batch_file(request)) is not None:
            return json_response(found)
        r = await vs.call("GetFile", pb.GetFileRequest(file_id=request.path_params["file_id"]))
        return json_response(file_json(r.file))

    async def delete(request: Request) -> Response:
        if (found := await batch_file(request)) is not None:
            await batches.store.delete_file(tenant_of(request), found["id"])  # type: ignore[union-attr]
            return json_response({"id": found["id"], "object": "file", "deleted": True})
        r = await vs.call("DeleteFile", pb.DeleteFileRequest(file_id=request.path_params["file_id"]))
        return json_response({"id": r.id, "object": "file", "deleted": r.deleted})

    async def content(request: Request) -> Response:
        fid = request.path_params["file_id"]
        if await batch_file(request) is not None:
            data = await batches.store.file_content(tenant_of(request), fid)  # type: ignore[union-attr]
            return Response(data or b"", media_type="application/jsonl")
        meta = await vs.call("GetFile", pb.GetFileRequest(file_id=fid))
        try:
            data = b"".join([m.chunk async for m in vs.stub().GetFileContent(pb.GetFileContentRequest(file_id=fid),
                                                                            timeout=vs.timeout)])
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return Response(data, media_type=meta.file.media_type or "application/octet-stream")

    return [
        Route("/v1/files", create, methods=["POST"]),
        Route("/v1/files", list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", retrieve, methods=["GET"]),
        Route("/v1/files/{file_id}", delete, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", content, methods=["GET"]),
    ]
