"""How many items a request's list-valued fields may hold, checked on the parsed JSON before any item is converted.

A body is parsed by ``orjson`` (bounded by ``max_body_bytes``), then converted item by item: each chat message and
content part into a typed model and a protobuf message, each tool's JSON schema checked, each base64 payload
decoded. The preprocessor refuses more than ``--max-messages`` messages, but only after the gateway did all of
that for every one of them (100,000 messages: the whole conversion, then the refusal). So every list whose items
cost work here is counted first — ``len`` of the raw JSON list, nothing else — and one past its bound is a 400
naming the field and the rule (``invalid_request_error`` with ``param``, as the openai SDK reads it), before the
first item is looked at:

====================================  ==========================  ===============================================
field                                 bound                       why this number
====================================  ==========================  ===============================================
chat ``messages``                     ``max_messages`` (2048)     the preprocessor's ``--max-messages`` default
responses ``input`` (items)           ``max_messages``            each item becomes a chat message
content parts (chat, responses)       ``MAX_PARTS`` (8192) total  a few parts per message at most
``tools``                             ``MAX_TOOLS`` (128)         OpenAI's own limit on a request's tools
``stop``                              ``MAX_STOP`` (16)           ``core/sampling.py`` (the preprocessor's rule)
``logit_bias`` (entries)              ``MAX_LOGIT_BIAS`` (300)    ``core/sampling.py`` (the preprocessor's rule)
completions ``prompt`` (list of       ``MAX_PROMPTS`` (2048)      a ceiling on the gateway's work; the
strings or token-id lists),                                       preprocessor's ``--max-prompts`` (64) is the
``prompt_embeds`` (list)                                          rule a client meets first
embeddings ``input`` (list of         ``MAX_EMBED_INPUTS``        OpenAI's cap, and the preprocessor's
strings or token-id lists)            (2048)
responses ``metadata`` (keys)         ``MAX_METADATA`` (16)       OpenAI's limits (keys 64 characters, values
                                                                  512); it is stored with the response
responses ``include``                 ``MAX_INCLUDE`` (16)        a handful of names exist
vector stores ``file_ids``, ``files``  ``MAX_FILES`` (500)        OpenAI's limit on a file batch
vector store search ``query`` (list)  ``MAX_QUERIES`` (16)        the vector store's own rule
vector stores ``metadata``,           16 keys                     the vector store's own rule
``attributes`` (keys)
====================================  ==========================  ===============================================

A list of token ids (one prompt, one embedding input) is one item: its length is the preprocessor's rule (the
context length), bounded here by the body's size. ``n`` is a number, not a list: the gateway does no work per
choice before the preprocessor's ``--max-n`` applies. Batch files count their lines on the raw bytes
(``batch_lines.py``); each line's body then meets the route's own bounds.
"""

from __future__ import annotations

from typing import Any

from embedmesh.core.sampling import MAX_LOGIT_BIAS, MAX_STOP
from embedmesh.gateway.errors import ApiError, bad_request

__all__ = ["Bounds", "MAX_PARTS", "MAX_TOOLS", "MAX_PROMPTS", "MAX_EMBED_INPUTS", "MAX_METADATA", "MAX_INCLUDE",
           "MAX_FILES", "MAX_QUERIES"]

MAX_PARTS = 8192
"""Content parts across all of a chat request's messages."""
MAX_TOOLS = 128
MAX_PROMPTS = 2048
MAX_EMBED_INPUTS = 2048
MAX_METADATA = 16
MAX_INCLUDE = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_FILES = 500
MAX_QUERIES = 16


def _too_many(param: str, bound: int, got: int, what: str) -> ApiError:
    return bad_request(param, f"may hold at most {bound} {what} (got {got})", "too_many")


def _count(body: dict[str, Any], name: str, bound: int, what: str, kind: type = list) -> None:
    value = body.get(name)
    if isinstance(value, kind) and len(value) > bound:
        raise _too_many(name, bound, len(value), what)


def _parts(body: dict[str, Any], name: str) -> None:
    """The content parts of all of ``body[name]``'s messages (items) together, counted by ``len`` alone."""
    items = body.get(name)
    if not isinstance(items, list):
        return
    parts = 0
    for i, m in enumerate(items):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts += len(content)
            if parts > MAX_PARTS:
                raise bad_request(f"{name}[{i}].content", f"the {name} may hold at most {MAX_PARTS} content parts "
                                  f"in all (got {parts} up to this one)", "too_many")


def _metadata_lengths(metadata: Any) -> None:
    """A stored response's metadata (at most ``MAX_METADATA`` keys by now): OpenAI's key and value lengths."""
    if not isinstance(metadata, dict):
        return
    for k, v in metadata.items():
        if len(k) > MAX_METADATA_KEY or (isinstance(v, str) and len(v) > MAX_METADATA_VALUE):
            raise bad_request("metadata", f"keys are at most {MAX_METADATA_KEY} characters and values at most "
                              f"{MAX_METADATA_VALUE}", "too_long")


def _sampling(body: dict[str, Any]) -> None:
    """The sampling lists both completion routes (and responses) carry."""
    _count(body, "stop", MAX_STOP, "stop strings")
    _count(body, "logit_bias", MAX_LOGIT_BIAS, "token ids", dict)
    _count(body, "tools", MAX_TOOLS, "tools")


class Bounds:
    """The bounds of one gateway (``max_messages`` from its config; the rest are the module's constants)."""

    def __init__(self, max_messages: int) -> None:
        self.max_messages = max_messages

    def chat(self, body: Any) -> None:
        """A /v1/chat/completions body (a parsed JSON object, or anything: only dicts are counted)."""
        if not isinstance(body, dict):
            return
        _count(body, "messages", self.max_messages, "messages (the gateway's --max-messages)")
        _sampling(body)
        _parts(body, "messages")

    def completion(self, body: Any) -> None:
        """A /v1/completions body."""
        if not isinstance(body, dict):
            return
        _sampling(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            _count(body, "prompt", MAX_PROMPTS, "prompts")
        _count(body, "prompt_embeds", MAX_PROMPTS, "prompt embeddings")

    def embeddings(self, body: Any) -> None:
        """A /v1/embeddings body."""
        if not isinstance(body, dict):
            return
        value = body.get("input")
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            _count(body, "input", MAX_EMBED_INPUTS, "inputs")

    def responses(self, body: Any) -> None:
        """A /v1/responses body."""
        if not isinstance(body, dict):
            return
        _count(body, "input", self.max_messages, "input items (the gateway's --max-messages)")
        _parts(body, "input")
        _sampling(body)
        _count(body, "metadata", MAX_METADATA, "keys", dict)
        _metadata_lengths(body.get("metadata"))
        _count(body, "include", MAX_INCLUDE, "names")

    def vector_store(self, body: Any) -> None:
        """A vector store body (create, file batch, search): per file, query and key the gateway converts."""
        if not isinstance(body, dict):
            return
        _count(body, "file_ids", MAX_FILES, "file ids")
        _count(body, "files", MAX_FILES, "files")
        _count(body, "query", MAX_QUERIES, "queries")
        _count(body, "metadata", MAX_METADATA, "keys", dict)
        _count(body, "attributes", MAX_METADATA, "keys", dict)

    def conversation(self, messages: int, new: int) -> None:
        """A /v1/responses turn: the chat messages it makes (``messages``, stored history and instructions
        included; ``new`` of them this turn's) are within ``max_messages`` too."""
        if messages > self.max_messages:
            raise bad_request("input", f"the conversation would hold {messages} messages ({new} from this input, "
                              f"the rest stored or instructions); at most {self.max_messages} (the gateway's "
                              "--max-messages): start a new conversation", "too_many")
