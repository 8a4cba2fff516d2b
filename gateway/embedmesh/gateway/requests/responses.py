"""``POST /v1/responses``: the shape of a Responses body, checked here only as far as the chat path does not check it.

A Responses request is carried out as a chat completion (``responses.py``): this model checks what only the
Responses API has — ``input`` as a string or a list of items (messages with ``input_text`` / ``output_text`` /
``input_prompt_embeds`` parts, ``function_call`` and ``function_call_output`` items), ``instructions``, the flat
function ``tools``, ``tool_choice``, ``text.format``, ``store``, ``background``, ``previous_response_id`` — and
passes every sampling field through untouched: ``ChatRequest`` checks those (and the prompt_embeds parts' base64)
once the body is rewritten as a chat body, and the route renames the chat field in a refusal back to the
Responses field (``max_completion_tokens`` → ``max_output_tokens``, ``messages[i]`` → ``input[k]``).

After ``parse``: ``input`` is a list of normalized items (``Item`` dicts: a string input is one user message);
``tools`` the chat tools; ``tool_choice`` chat's form; ``text`` the chat ``response_format`` (or None).
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from embedmesh.gateway.requests.fields import UNKNOWN, Bool, Model_
from embedmesh.gateway.requests.model import Model, Refusal, Say

__all__ = ["ResponsesRequest", "PASSTHROUGH", "ROLES"]

ROLES = ("user", "system", "developer", "assistant")
MAX_ITEMS = 4096
"""Input items one request may carry (each becomes a chat message; the preprocessor bounds the tokens)."""

PASSTHROUGH = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "min_tokens", "logit_bias", "stop", "ignore_eos")
"""Sampling fields sent to the chat path as they are (it checks them); ``max_output_tokens`` is sent as
``max_completion_tokens``."""

_TEXT_TYPES = ("input_text", "output_text")
_PART_TYPES = "'input_text', 'output_text', 'input_image' or 'input_prompt_embeds'"


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise Refusal(param, "must be a string", "invalid_type" if value is not None else "missing")
    return value


def _part(part: Any, where: str) -> dict[str, Any]:
    """One content part -> its normalized dict (the embeddings' source stays raw: the chat path decodes it)."""
    if not isinstance(part, dict):
        raise Refusal(where, "must be an object with a type", "invalid_type")
    kind = part.get("type")
    if kind in _TEXT_TYPES:
        return {"type": kind, "text": _text(part.get("text"), f"{where}.text")}
    if kind == "input_prompt_embeds":
        out: dict[str, Any] = {"type": kind}
        if part.get("id") is not None:
            if not isinstance(part["id"], str) or not part["id"]:
                raise Refusal(f"{where}.id", "must be the id returned by POST /v1/prompt_embeds", "invalid_value")
            out["id"] = part["id"]
        elif part.get("data") is None:
            raise Refusal(f"{where}.data", "is required for an input_prompt_embeds part (base64 of "
                                           "torch.save(tensor)), or give the id of an upload", "missing")
        else:
            out["data"] = part["data"]
        return out
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise Refusal(f"{where}.file_id", "is not supported by this server: send the image as image_url (a "
                                              "data: URL)", "unsupported_parameter")
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise Refusal(f"{where}.image_url", "is required: a data: URL (data:image/png;base64,...) or an "
                                                "http(s) URL", "missing" if url is None else "invalid_type")
        return {"type": kind, "image_url": url}  # decoded by the preprocessor, within its caps (as chat's)
    if kind in ("input_file", "input_audio"):
        raise Refusal(f"{where}.type", f"{kind!r} is not supported by this server: it takes text, images and "
                                       "prompt embeddings", "unsupported_parameter")
    raise Refusal(f"{where}.type", f"unsupported content part type {kind!r}; this server accepts {_PART_TYPES}",
                  "unsupported_type")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise Refusal(f"{where}.role", f"must be one of {', '.join(map(repr, ROLES))}",
                      "missing" if role is None else "invalid_value")
    content = item.get("content")
    if isinstance(content, str):
        return {"type": "message", "role": role, "content": content}
    if not isinstance(content, list):
        raise Refusal(f"{where}.content", "must be a string or a list of content parts",
                      "missing" if content is None else "invalid_type")
    if len(content) > MAX_ITEMS:
        raise Refusal(f"{where}.content", f"may hold at most {MAX_ITEMS} parts", "invalid_value")
    return {"type": "message", "role": role,
            "content": [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]}


def _call_id(item: dict[str, Any], where: str) -> str:
    cid = item.get("call_id")
    if not isinstance(cid, str) or not cid:
        raise Refusal(f"{where}.call_id", "is required: the id of the function call",
                      "missing" if cid is None else "invalid_value")
    return cid


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise Refusal(where, "must be an input item (an object)", "invalid_type")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        return _message(item, where)
    if kind == "function_call":
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise Refusal(f"{where}.name", "is required: the function's name", "missing")
        return {"type": kind, "call_id": _call_id(item, where), "name": name,
                "arguments": _text(item.get("arguments"), f"{where}.arguments")}
    if kind == "function_call_output":
        cid = _call_id(item, where)
        return {"type": kind, "call_id": cid, "output": _text(item.get("output"), f"{where}.output")}
    raise Refusal(f"{where}.type", f"unsupported input item type {kind!r}; this server accepts 'message', "
                                   "'function_call' and 'function_call_output'",
                  "missing" if kind is None else "unsupported_type")


def _check_input(obj: Any) -> None:
    """-> a list of normalized items."""
    value = obj.input
    if isinstance(value, str):
        obj.input = [{"type": "message", "role": "user", "content": value}]
        return
    if not isinstance(value, list) or not value:
        raise Refusal("input", "must be a string or a non-empty list of input items", "invalid_type")
    if len(value) > MAX_ITEMS:
        raise Refusal("input", f"may hold at most {MAX_ITEMS} items", "invalid_value")
    obj.input = [_item(x, f"input[{k}]") for k, x in enumerate(value)]


def _check_text(obj: Any) -> None:
    """-> the chat ``response_format`` (None for plain text)."""
    text = obj.text
    if not isinstance(text, dict):
        raise Refusal("text", 'must be an object like {"format": {"type": "text"}}', "invalid_type")
    fmt = text.get("format")
    if fmt is None:
        obj.text = None
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        obj.text = None
    elif kind == "json_object":
        obj.text = {"type": "json_object"}
    elif kind == "json_schema":
        if "schema" not in fmt:
            raise Refusal("text.format.schema", "is required: the JSON schema the output must follow", "missing")
        name = fmt.get("name", "output")
        if not isinstance(name, str):
            raise Refusal("text.format.name", "must be a string", "invalid_type")
        obj.text = {"type": "json_schema", "json_schema": {"name": name, "schema": fmt["schema"],
                                                           "strict": fmt.get("strict")}}
    else:
        raise Refusal("text.format", 'must be {"type": "text"}, {"type": "json_object"} or {"type": '
                                     '"json_schema", "name": ..., "schema": {...}}', "invalid_value")


def _check_tools(obj: Any) -> None:
    """-> chat tools ({"type": "function", "function": {...}}); the chat path checks names and schemas."""
    tools = obj.tools
    if not isinstance(tools, list):
        raise Refusal("tools", 'must be a list of {"type": "function", "name": ..., "parameters": {...}}',
                      "invalid_type")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise Refusal(f"tools[{i}].type", f"must be \"function\" (this server runs no built-in tools, got "
                                              f"{kind!r})", "unsupported_parameter" if kind else "invalid_value")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    obj.tools = out


_CHOICE = "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}"


def _check_tool_choice(obj: Any) -> None:
    """-> chat's form; the chat path checks that the function is among the tools."""
    choice = obj.tool_choice
    if isinstance(choice, str):
        return
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise Refusal("tool_choice", _CHOICE, "invalid_value")
    obj.tool_choice = {"type": "function", "function": {"name": choice["name"]}}


def _check_background(obj: Any) -> None:
    if obj.background and obj.store is False:
        raise Refusal("background", "needs store: true (a background response is read back by its id)",
                      "invalid_value")
    if obj.background and obj.stream:
        raise Refusal("background", "cannot be combined with stream on this server: create it in the background "
                                    "and retrieve it, or stream it", "unsupported_parameter")


def _unsupported(name: str, why: str) -> Any:
    def check(obj: Any) -> None:
        if getattr(obj, name) not in (None, {}, [], False):
            raise Refusal(name, f"is not supported by this server{why}", "unsupported_parameter")
    return check


Text = Annotated[str, Say("must be a string", "invalid_type")]


class ResponsesRequest(Model, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/responses`` (module docstring)."""

    unknown = UNKNOWN
    model: Model_
    input: Annotated[Any, Say("is required: a string or a list of input items", "missing")]
    instructions: Text | None = None
    previous_response_id: Annotated[str, Meta(min_length=1), Say("must be the id of a stored response",
                                                                 "invalid_value")] | None = None
    store: Bool | None = None
    stream: Bool | None = None
    background: Bool | None = None
    max_output_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    seed: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    logit_bias: Any = None
    stop: Any = None
    ignore_eos: Any = None
    text: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Bool | None = None
    metadata: Annotated[dict[str, str], Say("must be an object of string values", "invalid_type")] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    service_tier: Text | None = None
    truncation: Annotated[str, Meta(pattern="^(auto|disabled)$"), Say("must be 'auto' or 'disabled'")] | None = None
    include: Annotated[list[str], Say("must be a list of strings", "invalid_type")] | None = None
    stream_options: Annotated[dict[str, Any], Say("must be an object", "invalid_type")] | None = None
    reasoning: Any = None
    max_tool_calls: Annotated[int, Meta(ge=1), Say("must be an integer >= 1")] | None = None
    top_logprobs: Any = None
    prompt: Any = None
    conversation: Any = None

    checks = {"input": _check_input, "background": _check_background, "text": _check_text, "tools": _check_tools,
              "tool_choice": _check_tool_choice,
              "reasoning": _unsupported("reasoning", ": its models do not reason (leave it out)"),
              "top_logprobs": _unsupported("top_logprobs", " on /v1/responses (use /v1/chat/completions)"),
              "prompt": _unsupported("prompt", " (no stored prompt templates)"),
              "conversation": _unsupported("conversation", ": use previous_response_id")}
    always = frozenset({"input"})
