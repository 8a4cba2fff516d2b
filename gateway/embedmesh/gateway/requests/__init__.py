"""The REST routes' JSON bodies as typed models (msgspec ``Struct``s), and ``parse``, the one way a refused body
becomes an OpenAI 400 naming its ``param``.

- ``model``: the models' base, ``Say``/``Refusal``, ``parse`` and the walk that finds a body's first refusal
- ``fields``: the field types, wordings and checks several route areas share (sampling, output constraints, base64)
- one module per route area: ``completion``, ``chat``, ``embedding``, ``adapter`` (LoRA), ``upload``
  (the vector-store bodies are in ``gateway/vector_stores.py``)
"""

from embedmesh.gateway.requests.adapter import LoadLoraRequest, UnloadLoraRequest
from embedmesh.gateway.requests.chat import ChatRequest, ImagePart, TextPart
from embedmesh.gateway.requests.completion import CompletionRequest
from embedmesh.gateway.requests.embedding import EmbeddingsRequest
from embedmesh.gateway.requests.fields import IGNORED_FIELDS, decode_base64
from embedmesh.gateway.requests.model import Model, Refusal, Say, known_fields, parse, parse_item
from embedmesh.gateway.requests.upload import PromptEmbedsUpload

__all__ = [
    "Say",
    "Refusal",
    "Model",
    "parse",
    "parse_item",
    "CompletionRequest",
    "ChatRequest",
    "ImagePart",
    "TextPart",
    "EmbeddingsRequest",
    "LoadLoraRequest",
    "UnloadLoraRequest",
    "PromptEmbedsUpload",
    "decode_base64",
    "known_fields",
    "IGNORED_FIELDS",
]
