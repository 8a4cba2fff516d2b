"""gateway/files.py: ``/v1/files`` through a bare app with a scripted VectorStoreService stub — an upload's stream
(header with filename, purpose and content type, then the bytes in 1 MiB chunks), the file objects, list paging,
delete, content with the file's media type; a bad body's 400 before any call; no vector store configured -> 501.
(Malformed multipart bodies are fuzzed in test_fuzz_requests.py.)"""

from __future__ import annotations

import os
from typing import Any

from embedmesh.core.errors import InvalidArgument, NotFound
from embedmesh.gateway import files
from embedmesh.gateway.vector_stores import VectorStoreClient
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from tests.unit.gateway.conftest import FakeStub, bare_gateway, route_client, rpc_error

FILE = pb.File(id="file-1", size_bytes=11, created_at=1700000000, filename="notes.md", purpose="assistants",
               media_type="text/markdown")
FILE_JSON = {"id": "file-1", "object": "file", "bytes": 11, "created_at": 1700000000, "filename": "notes.md",
             "purpose": "assistants", "status": "processed", "status_details": None, "expires_at": None}


class ScriptedClient(VectorStoreClient):
    def __init__(self, gateway: Any, stub: FakeStub) -> None:
        super().__init__(gateway)
        self._stub = stub  # type: ignore[assignment]


def client(**answers: Any) -> tuple[Any, FakeStub]:
    gw = bare_gateway(vector_store="127.0.0.1:1", request_timeout_seconds=9)
    stub = FakeStub(**answers)
    return route_client(files.routes(gw, ScriptedClient(gw, stub))), stub


def test_an_upload_streams_its_header_then_the_bytes_in_chunks() -> None:
    http, stub = client(UploadFile=pb.UploadFileResponse(file=FILE))
    data = os.urandom((1 << 20) + 3)
    r = http.post("/v1/files", files={"file": ("notes.md", data, "text/markdown")}, data={"purpose": "assistants"})
    assert r.status_code == 200, r.text
    assert r.json() == FILE_JSON
    [(method, messages, timeout)] = stub.calls
    assert (method, timeout) == ("UploadFile", 9.0)
    assert messages[0] == pb.UploadFileRequest(header=pb.UploadFileHeader(filename="notes.md", purpose="assistants",
                                                                          content_type="text/markdown"))
    assert [len(m.chunk) for m in messages[1:]] == [1 << 20, 3]
    assert b"".join(m.chunk for m in messages[1:]) == data


def test_an_upload_without_purpose_or_file_or_multipart_is_a_400_before_any_call() -> None:
    http, stub = client(UploadFile=pb.UploadFileResponse(file=FILE))
    r = http.post("/v1/files", files={"file": ("a.txt", b"x", "text/plain")})
    assert r.status_code == 400 and r.json()["error"] == {"message": "purpose: is required",
                                                         "type": "invalid_request_error", "param": "purpose",
                                                         "code": "missing"}
    r = http.post("/v1/files", files={"other": ("a.txt", b"x", "text/plain")}, data={"purpose": "assistants"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "file: is required (a multipart file field)"
    r = http.post("/v1/files", json={"file": "x", "purpose": "assistants"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
    assert stub.calls == []


def test_an_upload_over_the_body_limit_is_a_413_counted_as_it_arrives() -> None:
    """Declared or not (chunked), a multipart body past max_body_bytes is refused while it arrives instead of being
    spooled whole to the gateway's disk; nothing reaches the vector store."""
    gw = bare_gateway(vector_store="127.0.0.1:1", request_timeout_seconds=9, max_body_bytes=64 * 1024)
    stub = FakeStub(UploadFile=pb.UploadFileResponse(file=FILE))
    http = route_client(files.routes(gw, ScriptedClient(gw, stub)))
    data = os.urandom(256 * 1024)
    r = http.post("/v1/files", files={"file": ("big.bin", data, "application/octet-stream")},
                  data={"purpose": "assistants"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    boundary = "b0undary"
    body = (f"--{boundary}\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nassistants\r\n"
            f"--{boundary}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"big.bin\"\r\n"
            f"content-type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()

    def chunked() -> Any:  # no content-length: only counting can refuse it
        for i in range(0, len(body), 16 * 1024):
            yield body[i:i + 16 * 1024]

    r = http.post("/v1/files", content=chunked(), headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    small = http.post("/v1/files", files={"file": ("small.bin", data[:1000], "application/octet-stream")},
                      data={"purpose": "assistants"})
    assert small.status_code == 200, small.text  # under the limit: served as before
    assert [m for m, _, _ in stub.calls] == ["UploadFile"]


def test_the_services_refusal_of_an_upload_is_mapped() -> None:
    http, _ = client(UploadFile=rpc_error(InvalidArgument("file: only text files are accepted, got image/png",
                                                          field="file", reason="UNSUPPORTED_FILE_TYPE")))
    r = http.post("/v1/files", files={"file": ("a.png", b"\x89PNG", "image/png")}, data={"purpose": "assistants"})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "file: only text files are accepted, got image/png", "type": "invalid_request_error",
        "param": "file", "code": "unsupported_file_type"}


def test_list_pages_and_filters_by_purpose() -> None:
    http, stub = client(ListFiles=pb.ListFilesResponse(data=[FILE], page=pb.PageInfo(first_id="file-1",
                                                                                    last_id="file-1", has_more=True)))
    r = http.get("/v1/files?purpose=assistants&limit=1&order=asc&after=file-0")
    assert r.json() == {"object": "list", "data": [FILE_JSON], "first_id": "file-1", "last_id": "file-1",
                        "has_more": True}
    assert stub.last("ListFiles") == pb.ListFilesRequest(purpose="assistants", page=pb.PageRequest(
        limit=1, order=pb.SORT_ORDER_ASC, after="file-0"))
    r = http.get("/v1/files?order=up")
    assert r.status_code == 400 and r.json()["error"]["param"] == "order"


def test_retrieve_delete_and_content() -> None:
    http, stub = client(GetFile=pb.GetFileResponse(file=FILE), DeleteFile=pb.DeleteFileResponse(id="file-1",
                                                                                                 deleted=True),
                        GetFileContent=[pb.GetFileContentResponse(chunk=b"# Hel"),
                                        pb.GetFileContentResponse(chunk=b"lo\n")])
    assert http.get("/v1/files/file-1").json() == FILE_JSON
    assert stub.last("GetFile") == pb.GetFileRequest(file_id="file-1")
    assert http.delete("/v1/files/file-1").json() == {"id": "file-1", "object": "file", "deleted": True}
    r = http.get("/v1/files/file-1/content")
    assert r.content == b"# Hello\n" and r.headers["content-type"].startswith("text/markdown")
    assert stub.last("GetFileContent") == pb.GetFileContentRequest(file_id="file-1")


def test_an_unknown_file_is_a_404() -> None:
    http, _ = client(GetFile=rpc_error(NotFound("file_id: no file 'file-9'", field="file_id")))
    r = http.get("/v1/files/file-9")
    assert r.status_code == 404 and r.json()["error"]["param"] == "file_id"


def test_without_a_vector_store_the_routes_are_501() -> None:
    http = route_client(files.routes(bare_gateway()))
    r = http.get("/v1/files")
    assert r.status_code == 501 and r.json()["error"] == {
        "message": "the vector store is not configured on this gateway (--vector-store)",
        "type": "not_implemented_error", "param": None, "code": "not_implemented"}
