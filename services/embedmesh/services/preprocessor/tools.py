"""Tool calling for chat: the tools a request offers, how the prompt shows them to the model, the constraint that
makes a required call always parse, and the parser that turns the model's output into OpenAI ``tool_calls``.

One format, done fully ("hermes", the format Qwen/Hermes-style templates and vLLM's ``hermes`` parser use): the model
writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A chat template that knows tools receives them as
``tools`` (transformers' convention); one that does not (the default SmolLM2) gets them described in the system
message. With ``tool_choice`` "required" or a named function the output is constrained to the call's JSON (a JSON
schema enforced by the engine), so it always parses: the parser then reads the whole output as that one call.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from embedmesh.core import json_depth
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import Structured
from embedmesh.inference.v1 import inference_pb2

__all__ = ["Tool", "ToolSpec", "ToolRequest", "ToolCall", "tool_request_from_proto", "check_tools",
           "tools_from_proto", "PARSERS", "ToolParser", "call_text", "tool_response_text"]

PARSERS = ("hermes",)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[Tool, ...]
    mode: str
    """"auto", "required" or "function" (then ``function`` names it)."""
    function: str = ""

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "function")

    def constraint(self) -> Structured | None:
        """The JSON schema a required or named call's output must match."""
        if not self.constrained:
            return None
        chosen = [t for t in self.tools if self.mode == "required" or t.name == self.function]
        options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return Structured("json_schema", json.dumps(schema, sort_keys=True))

    def system_text(self) -> str:
        lines = ["You can call functions. The functions available, as JSON schemas:"]
        lines += [json.dumps(t.openai()["function"], ensure_ascii=False) for t in self.tools]
        lines.append('To call one, answer with <tool_call>{"name": <function name>, "arguments": <arguments '
                     "object>}</tool_call> and nothing else.")
        return "\n".join(lines)


@dataclass(frozen=True)
class ToolRequest:
    """The tools and tool_choice of a chat request as sent, not checked yet (``check_tools`` checks them)."""

    tools: tuple[tuple[str, str, str], ...] = ()
    """(name, description, parameters as JSON text) per tool, in request order."""
    choice: str | None = None
    """Which tool_choice was set: "mode", "function", or None (unset)."""
    mode: str = "auto"
    function: str = ""


@dataclass(frozen=True)
class ToolCall:
    """A call the model made, as ``ToolParser`` read it from the output (the servicer writes it as the proto)."""

    id: str
    name: str
    arguments: str
    """The arguments object as JSON text."""


def tool_request_from_proto(params: inference_pb2.ChatParams) -> ToolRequest:
    """Read the request's tools and tool_choice (nothing is refused here)."""
    kind = params.tool_choice.WhichOneof("kind") if params.HasField("tool_choice") else None
    mode = params.tool_choice.mode if kind == "mode" else ("function" if kind == "function" else "auto")
    return ToolRequest(tools=tuple((t.name, t.description, t.parameters_json) for t in params.tools), choice=kind,
                       mode=mode, function=params.tool_choice.function if kind == "function" else "")


def check_tools(request: ToolRequest) -> ToolSpec | None:
    """The request's tools, checked (a gRPC client is checked like a REST one); None when no call may be made."""
    tools: list[Tool] = []
    seen: set[str] = set()
    for i, (name, description, parameters_json) in enumerate(request.tools):
        if not _NAME.match(name):
            raise InvalidArgument(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'",
                                  field=f"tools[{i}].function.name", reason="INVALID_NAME")
        if name in seen:
            raise InvalidArgument(f"tools[{i}].function.name {name!r} is given twice",
                                  field=f"tools[{i}].function.name", reason="DUPLICATE")
        seen.add(name)
        try:
            parameters = (json_depth.loads(parameters_json) if parameters_json
                          else {"type": "object", "properties": {}})
        except ValueError as e:
            raise InvalidArgument(f"tools[{i}].function.parameters is not valid JSON ({e})",
                                  field=f"tools[{i}].function.parameters", reason="INVALID_SCHEMA") from None
        if not isinstance(parameters, dict):
            raise InvalidArgument(f"tools[{i}].function.parameters must be a JSON schema object",
                                  field=f"tools[{i}].function.parameters", reason="INVALID_SCHEMA")
        tools.append(Tool(name, description, parameters))
    kind, mode = request.choice, request.mode
    if mode not in ("none", "auto", "required", "function"):
        raise InvalidArgument(f"tool_choice must be 'none', 'auto', 'required' or a function, got {mode!r}",
                              field="tool_choice", reason="INVALID_VALUE")
    if not tools:
        if kind is not None and mode != "none":
            raise InvalidArgument("tool_choice needs tools", field="tool_choice", reason="NO_TOOLS")
        return None
    if mode == "none":
        return None
    function = request.function
    if function and function not in seen:
        raise InvalidArgument(f"tool_choice names {function!r}, which is not among the tools",
                              field="tool_choice", reason="UNKNOWN_FUNCTION")
    return ToolSpec(tuple(tools), mode, function)


def tools_from_proto(params: inference_pb2.ChatParams) -> ToolSpec | None:
    """``check_tools`` of the request's tools as sent."""
    return check_tools(tool_request_from_proto(params))


def call_text(name: str, arguments: str) -> str:
    """How a past call appears in the prompt (assistant history)."""
    try:
        args: Any = json_depth.loads(arguments) if arguments else {}
    except ValueError:  # not JSON, or nested past MAX_JSON_DEPTH: shown as the text it is
        args = arguments
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "</tool_call>"


def tool_response_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def _new_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolParser:
    """Output text -> (remaining text, calls) in the hermes format."""

    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.names = {t.name for t in spec.tools}

    def _call(self, raw: str) -> ToolCall | None:
        try:
            obj = json_depth.loads(raw)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json_depth.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(_new_id(), obj["name"], json.dumps(args, ensure_ascii=False))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.spec.constrained:
            call = self._call(text.strip())
            return ("", [call]) if call is not None else (text, [])
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        for m in self._BLOCK.finditer(text):
            call = self._call(m.group(1))
            if call is None:
                continue
            kept.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        return ("".join(kept).strip() if calls else text), calls
