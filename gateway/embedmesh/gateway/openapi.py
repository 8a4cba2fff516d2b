"""``GET /openapi.json`` (an OpenAPI 3.1 document of every route this gateway serves) and ``GET /docs`` (an HTML page
listing them). Both are open, like ``/health`` (``auth.OPEN_PATHS``).

The document is built from the running app's own routes, so it cannot miss one: each served (method, path) is
looked up in ``OPERATIONS``, which says what it takes and answers. The JSON request bodies are the gateway's request
models (``requests/``, ``vector_stores.py``) as ``msgspec.json.schema_components`` writes them, with the
``prompt_embeds`` extensions described where a field is typed ``Any`` (``_FIELD_SCHEMAS``). Every error status is
OpenAI's error body (``ErrorResponse``); the success bodies are written here beside the code that shapes them
(``completions.py``, ``embeddings.py``, ``files.py``, ``vector_stores.py`` …) and the e2e schemathesis run checks
each real answer against them. A served route missing from ``OPERATIONS`` still appears (with only its errors and a
``default`` answer) and ``tests/unit/gateway/test_openapi.py`` fails on it.

``/docs`` is self-contained: no script, no CDN; the table of operations links to the document.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Route

from embedmesh.gateway import requests, vector_stores
from embedmesh.gateway.context import Gateway
from embedmesh.gateway.requests.responses import PASSTHROUGH, ResponsesRequest

__all__ = ["routes", "document", "OPERATIONS", "served_operations"]

_REF = "#/components/schemas/{name}"
TITLE = "embedmesh gateway"
VERSION = "0.1.0"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}


def _obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    """An object with these keys (more keys allowed: OpenAI adds fields over time and clients ignore them)."""
    return {"type": "object", "required": list(required), "properties": {**required, **(optional or {})}}


def _list_of(item: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's paged list object (``paging.list_json``)."""
    return _obj({"object": {"const": "list"}, "data": {"type": "array", "items": item},
                 "first_id": _nullable(_STR), "last_id": _nullable(_STR), "has_more": _BOOL})


_USAGE = _obj({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT})
_LOGPROBS = _nullable({"type": "object"})
_FINISH = _nullable(_STR)
_TOOL_CALL = _obj({"id": _STR, "type": {"const": "function"},
                   "function": _obj({"name": _STR, "arguments": _STR})})
_COUNTS = _obj({k: _INT for k in ("in_progress", "completed", "failed", "cancelled", "total")})

# Success bodies, each as the function named beside it shapes it.
RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "ErrorResponse": _obj({"error": _obj({"message": _STR, "type": _STR, "param": _nullable(_STR),
                                          "code": _nullable(_STR)})}),
    # completions._whole
    "Completion": _obj({"id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
                        "choices": {"type": "array", "items": _obj({"index": _INT, "text": _STR,
                                                                     "finish_reason": _FINISH,
                                                                     "logprobs": _LOGPROBS})},
                        "usage": _USAGE}),
    "ChatCompletion": _obj({"id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
                            "choices": {"type": "array", "items": _obj({
                                "index": _INT, "finish_reason": _FINISH, "logprobs": _LOGPROBS,
                                "message": _obj({"role": {"const": "assistant"}, "content": _nullable(_STR)},
                                                {"tool_calls": {"type": "array", "items": _TOOL_CALL}})})},
                            "usage": _USAGE}),
    # embeddings.routes
    "EmbeddingList": _obj({"object": {"const": "list"}, "model": _STR,
                           "data": {"type": "array", "items": _obj({
                               "object": {"const": "embedding"}, "index": _INT,
                               "embedding": {"anyOf": [{"type": "array", "items": _NUM}, _STR],
                                             "description": "floats, or base64 of little-endian float32 "
                                                            "(encoding_format=base64)"}})},
                           "usage": _obj({"prompt_tokens": _INT, "total_tokens": _INT})}),
    # app.mesh_routes
    "ModelList": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _obj(
        {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "max_model_len": _INT,
         "hidden_size": _INT, "task": _STR, "ready_workers": _INT, "parent": _nullable(_STR), "root": _STR})}}),
    "Health": _obj({"status": {"enum": ["ok", "degraded", "unavailable"]},
                    "services": {"type": "array", "items": _obj(
                        {"service": _STR, "name": _STR, "status": {"enum": ["serving", "degraded", "down"]}},
                        {"detail": _STR, "model": _STR})}},
                   {"detail": _STR}),
    # lora.routes
    "Workers": _obj({"workers": {"type": "array", "items": _STR}}),
    "Sleeping": _obj({"is_sleeping": _BOOL, "sleeping_workers": {"type": "array", "items": _STR}}),
    # uploads.routes
    "PromptEmbedsObject": _obj({"id": _STR, "object": {"const": "prompt_embeds"}},
                               {"shape": {"type": "array", "items": _INT}, "dtype": _STR, "bytes": _INT,
                                "present": _BOOL, "deleted": _BOOL, "expires_at": _nullable(_INT)}),
    # files.file_json
    "File": _obj({"id": _STR, "object": {"const": "file"}, "bytes": _INT, "created_at": _INT, "filename": _STR,
                  "purpose": _STR, "status": _STR, "status_details": _nullable(_STR),
                  "expires_at": _nullable(_INT)}),
    "FileList": _list_of(_ref("File")),
    "FileDeleted": _obj({"id": _STR, "object": {"const": "file"}, "deleted": _BOOL}),
    # vector_stores.store_json, store_file_json, batch_json, search
    "VectorStore": _obj({"id": _STR, "object": {"const": "vector_store"}, "created_at": _INT, "name": _STR,
                         "usage_bytes": _INT, "file_counts": _COUNTS, "status": _STR,
                         "expires_after": _nullable(_obj({"anchor": _STR, "days": _INT})),
                         "expires_at": _nullable(_INT), "last_active_at": _INT, "metadata": {
                             "type": "object", "additionalProperties": _STR},
                         "embedding_model": _STR, "dimensions": _INT}),
    "VectorStoreList": _list_of(_ref("VectorStore")),
    "VectorStoreDeleted": _obj({"id": _STR, "object": {"const": "vector_store.deleted"}, "deleted": _BOOL}),
    "VectorStoreFile": _obj({"id": _STR, "object": {"const": "vector_store.file"}, "created_at": _INT,
                             "vector_store_id": _STR, "usage_bytes": _INT, "status": _STR,
                             "last_error": _nullable(_obj({"code": _STR, "message": _STR})),
                             "chunking_strategy": {"type": "object"}, "attributes": {"type": "object"},
                             "progress": _obj({"chunks_done": _INT, "chunks_total": _INT})}),
    "VectorStoreFileList": _list_of(_ref("VectorStoreFile")),
    "VectorStoreFileDeleted": _obj({"id": _STR, "object": {"const": "vector_store.file.deleted"},
                                    "deleted": _BOOL}),
    "VectorStoreFileBatch": _obj({"id": _STR, "object": {"const": "vector_store.files_batch"}, "created_at": _INT,
                                  "vector_store_id": _STR, "status": _STR, "file_counts": _COUNTS}),
    "SearchResults": _obj({"object": {"const": "vector_store.search_results.page"},
                           "search_query": {"anyOf": [_STR, {"type": "array", "items": _STR}]},
                           "data": {"type": "array", "items": _obj({
                               "file_id": _STR, "filename": _STR, "score": _NUM, "attributes": {"type": "object"},
                               "content": {"type": "array", "items": _obj({"type": _STR, "text": _STR})}})},
                           "has_more": _BOOL, "next_page": {"type": "null"}}),
    # batch_store._batch_json, and the body batches.routes takes
    "Batch": _obj({"id": _STR, "object": {"const": "batch"}, "endpoint": _STR, "input_file_id": _STR,
                   "completion_window": _STR,
                   "status": {"enum": ["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                                       "cancelling", "cancelled"]},
                   "output_file_id": _nullable(_STR), "error_file_id": _nullable(_STR), "created_at": _INT,
                   "request_counts": _obj({"total": _INT, "completed": _INT, "failed": _INT}),
                   "errors": _nullable({"type": "object"}),
                   "metadata": _nullable({"type": "object", "additionalProperties": _STR})},
                  {k: _nullable(_INT) for k in ("in_progress_at", "expires_at", "finalizing_at", "completed_at",
                                                 "failed_at", "expired_at", "cancelling_at", "cancelled_at")}),
    "BatchList": _list_of(_ref("Batch")),
    "CreateBatch": {**_obj({"input_file_id": {**_STR, "minLength": 1},
                            "endpoint": {"enum": ["/v1/completions", "/v1/chat/completions", "/v1/embeddings",
                                                  "/v1/responses"]},
                            "completion_window": {"const": "24h"}},
                           {"metadata": _nullable({"type": "object", "maxProperties": 16,
                                                   "additionalProperties": {**_STR, "maxLength": 512}})}),
                    "additionalProperties": False,
                    "description": "input_file_id: a purpose=batch file (JSONL, one request per line: custom_id, "
                                   "method POST, url = endpoint, body)"},
}

# responses_shape.Turn, responses.routes
RESPONSE_SCHEMAS.update({
    "Response": _obj({"id": _STR, "object": {"const": "response"}, "created_at": _INT,
                      "status": {"enum": ["completed", "incomplete", "failed", "in_progress", "queued",
                                          "cancelled"]},
                      "error": _nullable(_obj({"code": _STR, "message": _STR})),
                      "incomplete_details": _nullable(_obj({"reason": _STR})), "model": _STR,
                      "output": {"type": "array", "items": {"anyOf": [
                          _obj({"id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"},
                                "status": _STR, "content": {"type": "array", "items": _obj(
                                    {"type": {"const": "output_text"}, "text": _STR})}}),
                          _obj({"id": _STR, "type": {"const": "function_call"}, "call_id": _STR, "name": _STR,
                                "arguments": _STR, "status": _STR})]}},
                      "usage": _nullable(_obj({"input_tokens": _INT, "output_tokens": _INT,
                                               "total_tokens": _INT})),
                      "previous_response_id": _nullable(_STR), "store": _BOOL, "background": _BOOL}),
    "ResponseDeleted": _obj({"id": _STR, "object": {"const": "response"}, "deleted": _BOOL}),
    "ResponseInputItemList": _list_of(_obj({"id": _STR, "type": {"enum": ["message", "function_call",
                                                                          "function_call_output"]}})),
})

_EMBEDS_SOURCE = {"anyOf": [{"type": "string", "description": "base64 of a torch.save(tensor) or safetensors file"},
                            _obj({"id": {"type": "string", "minLength": 1,
                                         "description": "an id returned by POST /v1/prompt_embeds"}})]}

# The request fields typed ``Any`` in the models (their accepted shapes are checks, not types), as documented.
_FIELD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("CompletionRequest", "prompt_embeds"): {
        "description": "prompt embeddings ([rows, hidden] tensor) instead of or after a text prompt: one source "
                       "or a non-empty list of them (one prompt each)",
        "anyOf": [_EMBEDS_SOURCE, {"type": "array", "items": _EMBEDS_SOURCE, "minItems": 1}, {"type": "null"}]},
    ("CompletionRequest", "prompt_embeds_prefix"): {
        "description": "embedding rows placed before the prompt's", "anyOf": [_EMBEDS_SOURCE, {"type": "null"}]},
    ("CompletionRequest", "prompt"): {
        "description": "a string, a list of strings, a list of token ids or a list of token-id lists",
        "anyOf": [_STR, {"type": "array", "items": _STR}, {"type": "array", "items": _INT},
                  {"type": "array", "items": {"type": "array", "items": _INT}}, {"type": "null"}]},
    ("EmbedsPart", "data"): {"description": "this part's embedding rows (the prompt_embeds content part); or "
                                            "give `id`", **_EMBEDS_SOURCE},
    ("EmbedsPart", "id"): {"type": "string", "minLength": 1,
                           "description": "an id returned by POST /v1/prompt_embeds, instead of `data`"},
    ("ImagePart", "image_url"): {
        "description": "the image (docs/images.md): a data: URL of base64 PNG, JPEG or WebP, or an http(s) URL of a "
                       "host the preprocessor fetches from (--image-url-hosts); `detail` is accepted and ignored",
        **_obj({"url": {"type": "string", "minLength": 1}}, {"detail": {"enum": ["auto", "low", "high"]}})},
    ("PromptEmbedsUpload", "data"): {"type": "string",
                                     "description": "base64 of a torch.save(tensor) or safetensors file"},
    ("CompletionRequest", "best_of"): {"description": "only 1 (use n)", "anyOf": [{"const": 1}, {"type": "null"}]},
    ("ChatRequest", "functions"): {"description": "not supported: use tools",
                                   "anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]},
    ("ChatRequest", "modalities"): {"description": "text only",
                                    "anyOf": [{"const": ["text"]}, {"type": "null"}]},
    **{(model, name): {"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]}
       for model in ("CompletionRequest", "ChatRequest") for name in ("guided_regex", "guided_grammar")},
    **{(model, "guided_choice"): {"anyOf": [{"type": "array", "minItems": 1, "items": {"type": "string",
                                                                                       "minLength": 1}},
                                            {"type": "null"}]} for model in ("CompletionRequest", "ChatRequest")},
}

_TEXT_PART = _obj({"type": {"enum": ["input_text", "output_text"]}, "text": _STR})
_EMBEDS_PART = {**_obj({"type": {"const": "input_prompt_embeds"}},
                       {"data": {"type": "string", "description": "base64 of a torch.save(tensor) or safetensors "
                                                                  "file"},
                        "id": {"type": "string", "minLength": 1, "description": "an id returned by POST "
                                                                                "/v1/prompt_embeds"}}),
                "description": "prompt embeddings ([rows, hidden]) in place of text: `data` or `id`"}
_IMAGE_PART = {**_obj({"type": {"const": "input_image"}, "image_url": _STR}, {"detail": _STR}),
               "description": "an image as a data: URL (PNG, JPEG or WebP), or an http(s) URL of an allowed host"}
_INPUT_ITEM = {"anyOf": [
    _obj({"role": {"enum": ["user", "system", "developer", "assistant"]},
          "content": {"anyOf": [_STR, {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART, _EMBEDS_PART]}}]}},
         {"type": {"const": "message"}}),
    _obj({"type": {"const": "function_call"}, "call_id": _STR, "name": _STR, "arguments": _STR}),
    _obj({"type": {"const": "function_call_output"}, "call_id": _STR, "output": _STR})]}
_RESPONSES_FIELDS: dict[tuple[str, str], dict[str, Any]] = {
    ("ResponsesRequest", "input"): {"description": "a string (one user message) or a list of input items",
                                    "anyOf": [_STR, {"type": "array", "items": _INPUT_ITEM, "minItems": 1}]},
    ("ResponsesRequest", "text"): {"anyOf": [_obj({}, {"format": {"anyOf": [
        _obj({"type": {"enum": ["text", "json_object"]}}),
        _obj({"type": {"const": "json_schema"}, "schema": {"type": "object"}}, {"name": _STR, "strict": _BOOL})]}}),
        {"type": "null"}]},
    ("ResponsesRequest", "tools"): {"anyOf": [{"type": "array", "items": _obj(
        {"type": {"const": "function"}, "name": _STR}, {"description": _STR, "parameters": {"type": "object"},
                                                       "strict": _BOOL})}, {"type": "null"}]},
    ("ResponsesRequest", "tool_choice"): {"anyOf": [{"enum": ["none", "auto", "required"]},
                                                    _obj({"type": {"const": "function"}, "name": _STR}),
                                                    {"type": "null"}]},
    **{("ResponsesRequest", name): {"anyOf": [{"type": "null"}]} for name in ("reasoning", "top_logprobs", "prompt",
                                                                               "conversation")},
}
_FIELD_SCHEMAS.update(_RESPONSES_FIELDS)
# Responses fields checked by the chat path, documented as the chat field they are sent as.
_SAME_AS = {("ResponsesRequest", name): ("ChatRequest", name) for name in PASSTHROUGH} | {
    ("ResponsesRequest", "max_output_tokens"): ("ChatRequest", "max_completion_tokens")}

# What a body needs beside its fields' own types.
_BODY_RULES: dict[str, dict[str, Any]] = {
    "CompletionRequest": {"anyOf": [{"required": ["prompt"]}, {"required": ["prompt_embeds"]}],
                          "description": "`prompt`, `prompt_embeds` or both"},
}

REQUEST_MODELS: dict[str, type[msgspec.Struct]] = {
    "CompletionRequest": requests.CompletionRequest, "ChatRequest": requests.ChatRequest,
    "EmbeddingsRequest": requests.EmbeddingsRequest, "LoadLoraRequest": requests.LoadLoraRequest,
    "UnloadLoraRequest": requests.UnloadLoraRequest, "PromptEmbedsUpload": requests.PromptEmbedsUpload,
    "CreateVectorStore": vector_stores.CreateStore, "ModifyVectorStore": vector_stores.ModifyStore,
    "AddVectorStoreFile": vector_stores.AddFile, "UpdateVectorStoreFile": vector_stores.UpdateFile,
    "CreateFileBatch": vector_stores.CreateBatch, "SearchVectorStore": vector_stores.Search,
    "ResponsesRequest": ResponsesRequest,
}
"""The JSON bodies by the name the document gives them (the model's own name where it says less)."""


@dataclass(frozen=True)
class Operation:
    """What one (method, path) takes and answers. ``ok``: success status -> {media type: schema}; ``errors``: the
    error statuses it answers with beside the ones every route has (``_COMMON_ERRORS``)."""

    summary: str
    tag: str
    ok: dict[int, dict[str, dict[str, Any]]]
    body: str | None = None
    form: dict[str, Any] | None = None
    query: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: tuple[int, ...] = ()
    example: dict[str, Any] | None = None


def _json(name: str) -> dict[str, dict[str, Any]]:
    return {"application/json": _ref(name)}


_JSON_IN = (400, 413)  # a body that is not JSON, refused by its model, or over --max-body-bytes
_MESH = (400, 403, 404, 409, 501, 503)  # what a mesh service answers, mapped by errors.from_grpc
_COMMON_ERRORS = (401, 429, 500, 503)  # API key, tenant's share, a bug, the gateway's in-flight limit
_PAGE = {"after": _STR, "before": _STR, "limit": {"type": "integer", "minimum": 1, "maximum": 100},
         "order": {"enum": ["asc", "desc"]}}
# One server-sent event (the schema of each event of the stream, as schemathesis and OpenAPI 3.2's itemSchema read it).
_SSE = {"text/event-stream": _obj({"data": {"type": "string", "description": "a chunk's JSON (`object`: "
                                                                            "`text_completion` or "
                                                                            "`chat.completion.chunk`), or `[DONE]` "
                                                                            "last"}},
                                  {"event": _STR, "id": _STR})}

_RESPONSE_SSE = {"text/event-stream": _obj({"data": {"type": "string", "description": "one event's JSON: `type` "
                                                                                   "response.created ... "
                                                                                   "response.completed"}},
                                           {"event": _STR, "id": _STR})}

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("post", "/v1/responses"): Operation(
        "Create a response (Responses API; text and input_prompt_embeds parts, state by previous_response_id)",
        "responses", {200: {**_json("Response"), **_RESPONSE_SSE}}, body="ResponsesRequest", errors=_JSON_IN + _MESH,
        example={"model": "SmolLM2-135M-Instruct", "input": "Hello", "max_output_tokens": 8}),
    ("get", "/v1/responses/{id}"): Operation("Retrieve a stored response", "responses", {200: _json("Response")},
                                             errors=(404,)),
    ("delete", "/v1/responses/{id}"): Operation("Delete a stored response", "responses",
                                                {200: _json("ResponseDeleted")}, errors=(404,)),
    ("get", "/v1/responses/{id}/input_items"): Operation(
        "List a stored response's input items", "responses", {200: _json("ResponseInputItemList")},
        query=_PAGE, errors=(400, 404)),
    ("post", "/v1/responses/{id}/cancel"): Operation("Cancel a background response", "responses",
                                                     {200: _json("Response")}, errors=(400, 404)),
    ("post", "/v1/completions"): Operation(
        "Create a completion (text, token ids or prompt_embeds)", "inference",
        {200: {**_json("Completion"), **_SSE}}, body="CompletionRequest", errors=_JSON_IN + _MESH,
        example={"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}),
    ("post", "/v1/chat/completions"): Operation(
        "Create a chat completion (text, prompt_embeds and image_url content parts)", "inference",
        {200: {**_json("ChatCompletion"), **_SSE}}, body="ChatRequest", errors=_JSON_IN + _MESH,
        example={"model": "SmolLM2-135M-Instruct", "max_tokens": 8,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]}),
    ("post", "/v1/embeddings"): Operation("Create embeddings", "inference", {200: _json("EmbeddingList")},
                                          body="EmbeddingsRequest", errors=_JSON_IN + _MESH,
                                          example={"model": "all-MiniLM-L6-v2", "input": ["hello", "world"]}),
    ("get", "/v1/models"): Operation("List models (loaded LoRA adapters too)", "inference",
                                     {200: _json("ModelList")}, errors=_MESH),
    ("post", "/v1/prompt_embeds"): Operation("Upload a prompt_embeds tensor once, refer to it by id", "inference",
                                             {200: _json("PromptEmbedsObject")}, body="PromptEmbedsUpload",
                                             errors=_JSON_IN + _MESH),
    ("get", "/v1/prompt_embeds/{id}"): Operation("Whether an uploaded tensor is still held", "inference",
                                                 {200: _json("PromptEmbedsObject")}, errors=_MESH),
    ("delete", "/v1/prompt_embeds/{id}"): Operation("Delete an uploaded tensor", "inference",
                                                    {200: _json("PromptEmbedsObject")}, errors=_MESH),
    ("post", "/v1/load_lora_adapter"): Operation(
        "Load a LoRA adapter (admin key)", "admin",
        {200: {"text/plain": {"type": "string"}}}, body="LoadLoraRequest", errors=_JSON_IN + _MESH),
    ("post", "/v1/unload_lora_adapter"): Operation(
        "Unload a LoRA adapter (admin key)", "admin",
        {200: {"text/plain": {"type": "string"}}}, body="UnloadLoraRequest", errors=_JSON_IN + _MESH),
    ("post", "/sleep"): Operation("Put the workers to sleep (admin key)", "admin", {200: _json("Workers")},
                                  query={"level": {"enum": [1, 2], "default": 1}}, errors=_MESH),
    ("post", "/wake_up"): Operation("Wake the workers (admin key)", "admin", {200: _json("Workers")},
                                    errors=_MESH),
    ("get", "/is_sleeping"): Operation("Which workers sleep", "admin", {200: _json("Sleeping")}, errors=_MESH),
    ("get", "/health"): Operation(
        "Every service of the mesh; 503 when the preprocessor does not serve (open: no key)", "operations",
        {200: _json("Health"), 503: _json("Health")}),
    ("get", "/metrics"): Operation("Prometheus metrics", "operations", {200: {"text/plain": {"type": "string"}}}),
    ("get", "/openapi.json"): Operation("This document (open: no key)", "operations",
                                        {200: {"application/json": {"type": "object"}}}),
    ("get", "/docs"): Operation("This document as an HTML page (open: no key)", "operations",
                                {200: {"text/html": {"type": "string"}}}),
    ("post", "/v1/files"): Operation(
        "Upload a file (multipart/form-data)", "files", {200: _json("File")},
        form=_obj({"file": {"type": "string", "contentMediaType": "application/octet-stream"}, "purpose": _STR}),
        errors=_JSON_IN + _MESH),
    ("get", "/v1/files"): Operation("List files", "files", {200: _json("FileList")},
                                    query={"purpose": _STR, **{k: v for k, v in _PAGE.items() if k != "before"}},
                                    errors=_MESH),
    ("get", "/v1/files/{file_id}"): Operation("Retrieve a file", "files", {200: _json("File")}, errors=_MESH),
    ("delete", "/v1/files/{file_id}"): Operation("Delete a file", "files", {200: _json("FileDeleted")},
                                                 errors=_MESH),
    ("get", "/v1/files/{file_id}/content"): Operation(
        "A file's bytes (its media type)", "files", {200: {"*/*": {"type": "string"}}}, errors=_MESH),
    ("post", "/v1/batches"): Operation("Create a batch from a purpose=batch file", "batches",
                                       {200: _json("Batch")}, body="CreateBatch", errors=_JSON_IN + (404,),
                                       example={"input_file_id": "file-abc", "endpoint": "/v1/chat/completions",
                                                "completion_window": "24h"}),
    ("get", "/v1/batches"): Operation("List batches (newest first)", "batches", {200: _json("BatchList")},
                                      query={k: v for k, v in _PAGE.items() if k != "before"}, errors=(400,)),
    ("get", "/v1/batches/{batch_id}"): Operation("Retrieve a batch", "batches", {200: _json("Batch")},
                                                 errors=(404,)),
    ("post", "/v1/batches/{batch_id}/cancel"): Operation("Cancel a batch (cancelling, then cancelled)", "batches",
                                                         {200: _json("Batch")}, errors=(404,)),
    ("post", "/v1/vector_stores"): Operation("Create a vector store", "vector stores", {200: _json("VectorStore")},
                                             body="CreateVectorStore", errors=_JSON_IN + _MESH),
    ("get", "/v1/vector_stores"): Operation("List vector stores", "vector stores", {200: _json("VectorStoreList")},
                                            query=_PAGE, errors=_MESH),
    ("get", "/v1/vector_stores/{id}"): Operation("Retrieve a vector store", "vector stores",
                                                 {200: _json("VectorStore")}, errors=_MESH),
    ("post", "/v1/vector_stores/{id}"): Operation("Modify a vector store", "vector stores",
                                                  {200: _json("VectorStore")}, body="ModifyVectorStore",
                                                  errors=_JSON_IN + _MESH),
    ("delete", "/v1/vector_stores/{id}"): Operation("Delete a vector store", "vector stores",
                                                    {200: _json("VectorStoreDeleted")}, errors=_MESH),
    ("post", "/v1/vector_stores/{id}/files"): Operation(
        "Add a file to a vector store", "vector stores", {200: _json("VectorStoreFile")},
        body="AddVectorStoreFile", errors=_JSON_IN + _MESH),
    ("get", "/v1/vector_stores/{id}/files"): Operation(
        "List a vector store's files", "vector stores", {200: _json("VectorStoreFileList")},
        query={**_PAGE, "filter": {"enum": ["in_progress", "completed", "failed", "cancelled"]}}, errors=_MESH),
    ("get", "/v1/vector_stores/{id}/files/{file_id}"): Operation(
        "Retrieve a vector store file", "vector stores", {200: _json("VectorStoreFile")}, errors=_MESH),
    ("post", "/v1/vector_stores/{id}/files/{file_id}"): Operation(
        "Update a vector store file's attributes", "vector stores", {200: _json("VectorStoreFile")},
        body="UpdateVectorStoreFile", errors=_JSON_IN + _MESH),
    ("delete", "/v1/vector_stores/{id}/files/{file_id}"): Operation(
        "Remove a file from a vector store", "vector stores", {200: _json("VectorStoreFileDeleted")},
        errors=_MESH),
    ("post", "/v1/vector_stores/{id}/file_batches"): Operation(
        "Add files to a vector store in one batch", "vector stores", {200: _json("VectorStoreFileBatch")},
        body="CreateFileBatch", errors=_JSON_IN + _MESH),
    ("get", "/v1/vector_stores/{id}/file_batches/{batch_id}"): Operation(
        "Retrieve a file batch", "vector stores", {200: _json("VectorStoreFileBatch")}, errors=_MESH),
    ("post", "/v1/vector_stores/{id}/file_batches/{batch_id}/cancel"): Operation(
        "Cancel a file batch", "vector stores", {200: _json("VectorStoreFileBatch")}, errors=_MESH),
    ("get", "/v1/vector_stores/{id}/file_batches/{batch_id}/files"): Operation(
        "List a file batch's files", "vector stores", {200: _json("VectorStoreFileList")},
        query={**_PAGE, "filter": {"enum": ["in_progress", "completed", "failed", "cancelled"]}}, errors=_MESH),
    ("post", "/v1/vector_stores/{id}/search"): Operation(
        "Search a vector store", "vector stores", {200: _json("SearchResults")}, body="SearchVectorStore",
        errors=_JSON_IN + _MESH),
}

_UNDESCRIBED = Operation("(not described)", "undescribed", {})
_REASONS = {200: "OK", 400: "Bad request: the message and `param` name the field", 401: "Missing or wrong API key",
            403: "The key may not do this", 404: "Unknown route or object", 409: "Already exists",
            413: "Body over the gateway's limit", 429: "Rate limited (Retry-After)", 500: "Internal error",
            501: "Not implemented by this mesh (an engine without the capability, no vector store)",
            503: "Overloaded or a mesh service unavailable (Retry-After)"}
_PARAM = re.compile(r"{([^}:]+)(:[^}]*)?}")


def served_operations(app_routes: Iterable[BaseRoute]) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves (HEAD is GET's, and not listed), in the app's order."""
    out: list[tuple[str, str]] = []
    for r in app_routes:
        if not isinstance(r, Route):
            continue
        path = _PARAM.sub(r"{\1}", r.path)
        out.extend((m.lower(), path) for m in sorted(r.methods or ["GET"]) if m != "HEAD")
    return out


def _request_components() -> dict[str, dict[str, Any]]:
    models = list(REQUEST_MODELS.values())
    _, comps = msgspec.json.schema_components(models, ref_template=_REF)
    for name, model in REQUEST_MODELS.items():  # the document's names for the bodies
        if model.__name__ != name:
            comps[name] = comps.pop(model.__name__)
            comps[name]["title"] = name
    for (model, prop), schema in _FIELD_SCHEMAS.items():
        nullable = {"type": "null"} in schema.get("anyOf", ())
        comps[model]["properties"][prop] = {**schema, **({"default": None} if nullable else {})}
    for (model, prop), (other, same) in _SAME_AS.items():
        comps[model]["properties"][prop] = comps[other]["properties"][same]
    for model, rule in _BODY_RULES.items():
        comps[model].update(rule)
    return comps


def _operation(method: str, path: str, op: Operation) -> dict[str, Any]:
    params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
              for n, _ in _PARAM.findall(path)]
    params += [{"name": n, "in": "query", "required": False, "schema": s} for n, s in op.query.items()]
    responses: dict[str, Any] = {
        str(status): {"description": _REASONS.get(status, "OK"),
                      "content": {mt: {"schema": s} for mt, s in content.items()}}
        for status, content in op.ok.items()}
    for status in sorted({*op.errors, *_COMMON_ERRORS} - set(op.ok)):
        responses[str(status)] = {"description": _REASONS[status], "content": _json_content("ErrorResponse")}
    responses["default"] = {"description": "Any other error, in OpenAI's error shape",
                            "content": _json_content("ErrorResponse")}
    op_id = method + "_" + re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_")
    out: dict[str, Any] = {"summary": op.summary, "tags": [op.tag], "operationId": op_id, "responses": responses}
    if params:
        out["parameters"] = params
    if op.body:
        media: dict[str, Any] = {"schema": _ref(op.body), **({"example": op.example} if op.example else {})}
        out["requestBody"] = {"required": True, "content": {"application/json": media}}
    elif op.form:
        out["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": op.form}}}
    return out


def _json_content(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name)}}


def document(app_routes: Iterable[BaseRoute]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the routes an app serves."""
    paths: dict[str, dict[str, Any]] = {}
    for method, path in served_operations(app_routes):
        op = OPERATIONS.get((method, path), _UNDESCRIBED)
        paths.setdefault(path, {})[method] = _operation(method, path, op)
    return {
        "openapi": "3.1.0",
        "info": {"title": TITLE, "version": VERSION,
                 "description": "OpenAI-compatible REST API of the embedmesh gateway, with the prompt_embeds "
                                "extensions. Every route but /health, /openapi.json, /docs (and /metrics unless "
                                "--metrics-require-key) takes `Authorization: Bearer <key>` when keys are set."},
        "paths": paths,
        "components": {"schemas": {**_request_components(), **RESPONSE_SCHEMAS},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _page(doc: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><td><code>{m.upper()}</code></td><td><code>{html.escape(p)}</code></td>"
        f"<td>{html.escape(op['summary'])}</td><td>{', '.join(k for k in op['responses'] if k != 'default')}</td>"
        f"</tr>" for p, ops in doc["paths"].items() for m, op in ops.items())
    return ("<!doctype html><html><head><meta charset='utf-8'><title>" + html.escape(TITLE) + " API</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:.2em .8em;text-align:left;"
            "border-bottom:1px solid #ddd}</style></head><body><h1>" + html.escape(TITLE) + " API</h1>"
            "<p>The full document, with every request and response schema: <a href='/openapi.json'>/openapi.json"
            "</a> (OpenAPI 3.1; load it in any OpenAPI viewer).</p><table><tr><th>Method</th><th>Path</th>"
            "<th>What</th><th>Statuses</th></tr>" + rows + "</table></body></html>")


def routes(gw: Gateway) -> list[Route]:
    """``/openapi.json`` and ``/docs``, built once from the serving app's routes (``request.app``)."""
    cache: dict[str, bytes | str] = {}

    def doc(request: Request) -> dict[str, Any]:
        return document(request.app.routes)

    async def openapi_json(request: Request) -> Response:
        if "json" not in cache:
            cache["json"] = orjson.dumps(doc(request))
        return Response(cache["json"], media_type="application/json")

    async def docs(request: Request) -> Response:
        if "html" not in cache:
            cache["html"] = _page(doc(request))
        return HTMLResponse(cache["html"])

    return [Route("/openapi.json", openapi_json, methods=["GET"]), Route("/docs", docs, methods=["GET"])]
