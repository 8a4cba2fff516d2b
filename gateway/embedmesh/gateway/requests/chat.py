"""``POST /v1/chat/completions``: its body's model, its messages and content parts, tools and tool choice."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta

from embedmesh.gateway.requests.fields import (
    UINT32_MAX,
    UNKNOWN,
    Audio,
    Bool,
    FunctionCall,
    LogitBias,
    Logprobs,
    MinP,
    MinTokens,
    Model_,
    N,
    Penalty,
    Prediction,
    RepetitionPenalty,
    Seed,
    Stop,
    Store,
    Stream,
    Temperature,
    TopK,
    TopP,
    WebSearch,
    embeds_source,
    int_field,
    is_int,
    sampling_checks,
    schema_text,
    type_or_value,
    unsupported,
)
from embedmesh.gateway.requests.model import Model, Refusal, Say, parse_item
from embedmesh.inference.v1 import inference_pb2


# Chat messages ------------------------------------------------------------------------------------------------------
class TextPart(Model, kw_only=True, tag_field="type", tag="text"):
    text: Annotated[str, Say("is required for a text part", "missing")]


def _check_embeds_part(obj: Any) -> None:
    """-> ``data`` holds the source (decoded bytes, or the message naming an upload)."""
    if obj.id is not None:
        obj.data = embeds_source({"id": obj.id}, "")
    elif obj.data is None:
        raise Refusal("data", "is required for a prompt_embeds part (base64 of torch.save(tensor)), or give the id "
                              "of an upload", "missing")
    else:
        obj.data = embeds_source(obj.data, "data")


class EmbedsPart(Model, kw_only=True, tag_field="type", tag="prompt_embeds"):
    id: Any = None
    data: Any = None

    checks = {"data": _check_embeds_part}
    always = frozenset({"data"})


_IMAGE_URL = 'must be an object {"url": "data:image/png;base64,..."} (PNG, JPEG or WebP)'
_DETAILS = ("auto", "low", "high")


def _check_image_part(obj: Any) -> None:
    """-> ``image_url`` the URL string (the preprocessor decodes it, within its caps)."""
    v = obj.image_url
    if not isinstance(v, dict):
        raise Refusal("image_url", _IMAGE_URL, "missing" if v is None else "invalid_type")
    url = v.get("url")
    if not isinstance(url, str) or not url:
        raise Refusal("image_url.url", "is required: a data: URL (data:image/png;base64,...) or an http(s) URL",
                      "missing" if url is None else "invalid_type")
    detail = v.get("detail")
    if detail is not None and detail not in _DETAILS:
        raise Refusal("image_url.detail", f"must be one of {list(_DETAILS)}", "invalid_value")
    obj.image_url = url


class ImagePart(Model, kw_only=True, tag_field="type", tag="image_url"):
    image_url: Any = None

    checks = {"image_url": _check_image_part}
    always = frozenset({"image_url"})


def _part_message(v: Any, obj: Any) -> str:
    if not isinstance(v, dict):
        return "must be an object with a type"
    return (f"unsupported content part type {v.get('type')!r}; this server accepts 'text', 'prompt_embeds' and "
            "'image_url'")


Part = Annotated[TextPart | EmbedsPart | ImagePart,
                 Say(_part_message, lambda v, o: "unsupported_type" if isinstance(v, dict) else "invalid_type",
                     lambda v: ".type" if isinstance(v, dict) else "")]


def _check_tool_calls(obj: Any) -> None:
    """-> a list of ToolCall messages, or None."""
    calls = obj.tool_calls
    if calls is None:
        return
    if obj.role != "assistant" or not isinstance(calls, list):
        raise Refusal("tool_calls", "must be a list, on an assistant message", "invalid_value")
    out = []
    for j, call in enumerate(calls):
        where = f"tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise Refusal(f"{where}.function.name", "is required", "missing")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise Refusal(f"{where}.function.arguments", "must be a string of JSON", "invalid_type")
        cid = call.get("id", "")
        if not isinstance(cid, str):
            raise Refusal(f"{where}.id", "must be a string", "invalid_type")
        out.append(inference_pb2.ToolCall(id=cid, name=fn["name"], arguments=args))
    obj.tool_calls = out


def _check_tool_call_id(obj: Any) -> None:
    if obj.role == "tool":
        cid = obj.tool_call_id
        if not isinstance(cid, str) or not cid:
            raise Refusal("tool_call_id", "is required for a tool message: the id of the call it answers", "missing")


def _check_content(obj: Any) -> None:
    if obj.content is None and obj.role != "assistant":
        raise Refusal("content", "must be a string or a list of content parts", "invalid_type")


class Message(Model, kw_only=True):
    role: Annotated[str, Say("is required", "missing")]
    name: Annotated[str, Say("must be a string", "invalid_type")] | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    content: Annotated[str | list[Part], Say("must be a string or a list of content parts", "invalid_type")] | None \
        = None

    checks = {"tool_calls": _check_tool_calls, "tool_call_id": _check_tool_call_id, "content": _check_content}
    always = frozenset({"tool_call_id", "content"})


# Tools ---------------------------------------------------------------------------------------------------------------
def _check_parameters(obj: Any) -> None:
    """-> the schema's JSON text."""
    if obj.parameters is not None:
        obj.parameters = schema_text(obj.parameters, "parameters")


ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$"), Say("is required: 1-64 letters, digits, '_' or '-'",
                                                                      lambda v, o: "missing" if v is None
                                                                      else "invalid_value")]
ToolType = Annotated[Literal["function"], Say('must be "function"')]


class Function(Model, kw_only=True):
    name: ToolName
    description: Annotated[str, Say("must be a string", "invalid_type")] = ""
    parameters: Any = None
    strict: Bool | None = None

    checks = {"parameters": _check_parameters}


class Tool(Model, kw_only=True):
    type: ToolType = "function"
    function: Annotated[Function, Say("is required", "missing")]


class _FunctionName(Model, kw_only=True):
    name: ToolName


class _ToolName(Model, kw_only=True):
    """A tool up to its function's name: a name given twice is refused before the rest of that tool is read."""

    type: ToolType = "function"
    function: Annotated[_FunctionName, Say("is required", "missing")]


_NOT_A_TOOL = Say('must be "function"')


def _check_tools(obj: Any) -> None:
    """-> a list of Tool."""
    tools = obj.tools
    if not isinstance(tools, list):
        raise Refusal("tools", 'must be a list of {"type": "function", "function": {...}}', "invalid_type")
    names: set[str] = set()
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise Refusal(f"{where}.type", 'must be "function"')
        name = parse_item(_ToolName, t, where, _NOT_A_TOOL).function.name
        if name in names:
            raise Refusal(f"{where}.function.name", f"{name!r} is given twice", "invalid_value")
        names.add(name)
        out.append(parse_item(Tool, t, where, _NOT_A_TOOL))
    obj.tools = out


_CHOICE = "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"


def _check_tool_choice(obj: Any) -> None:
    """-> ("mode", "none"/"auto"/"required"), ("function", name) or None."""
    choice = obj.tool_choice
    if choice is None:
        return
    names = [t.function.name for t in obj.tools or ()]
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise Refusal("tool_choice", _CHOICE, "invalid_value")
        if choice != "none" and not names:
            raise Refusal("tool_choice", f"{choice!r} needs tools", "invalid_value")
        obj.tool_choice = ("mode", choice)
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise Refusal("tool_choice", _CHOICE, "invalid_value")
    if name not in names:
        raise Refusal("tool_choice", f"names the function {name!r}, which is not among the tools", "invalid_value")
    obj.tool_choice = ("function", name)


def _check_chat_max_tokens(obj: Any) -> None:
    """``max_tokens`` counts only without ``max_completion_tokens`` (which replaces it in OpenAI's chat API)."""
    v = obj.max_tokens
    if obj.max_completion_tokens is None and v is not None and (not is_int(v) or not 1 <= v <= UINT32_MAX):
        raise Refusal("max_tokens", "must be an integer >= 1", "invalid_value" if is_int(v) else "invalid_type")


def _check_top_logprobs(obj: Any) -> None:
    if obj.top_logprobs is not None and obj.logprobs is not True:
        raise Refusal("top_logprobs", "needs logprobs: true", "invalid_value")


_CHAT_UNSUPPORTED = {
    "functions": unsupported("functions", bool, "is not supported by this server: use tools (the functions API is "
                                                 "deprecated)"),
    "modalities": unsupported("modalities", lambda v: v not in (None, ["text"]), "is not supported by this server: "
                                                                                  "it generates text only"),
}


class ChatRequest(Model, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/chat/completions``. After ``parse``: as ``CompletionRequest`` for the sampling fields;
    ``tool_choice`` ("mode", m), ("function", name) or None; each tool's ``function.parameters`` the schema's JSON
    text; each message's ``tool_calls`` ToolCall messages and each prompt_embeds part's ``data`` its source."""

    unknown = UNKNOWN
    model: Model_
    store: Store | None = None
    min_p: MinP | None = None
    functions: Any = None
    function_call: FunctionCall = None
    audio: Audio = None
    modalities: Any = None
    prediction: Prediction = None
    web_search_options: WebSearch = None
    n: N | None = None
    stream: Bool | None = None
    stream_options: Stream | None = None
    max_completion_tokens: int_field(1, UINT32_MAX, "must be an integer >= 1", type_or_value) | None = None
    max_tokens: Any = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    ignore_eos: Bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MinTokens | None = None
    logit_bias: LogitBias | None = None
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    logprobs: Annotated[bool, Say("must be a boolean (use top_logprobs for alternatives)", "invalid_type")] | None \
        = None
    top_logprobs: Logprobs | None = None
    tools: Any = None
    tool_choice: Any = None
    messages: Annotated[list[Annotated[Message, Say("must be an object with role and content", "invalid_type")]],
                        Meta(min_length=1), Say("must be a non-empty list of messages")]
    user: Any = None
    metadata: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None

    checks = {**_CHAT_UNSUPPORTED, "max_tokens": _check_chat_max_tokens, **sampling_checks(),
              "top_logprobs": _check_top_logprobs, "tools": _check_tools, "tool_choice": _check_tool_choice}
    always = frozenset({"guided_grammar"})

