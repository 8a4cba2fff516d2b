"""Chat prompts with prompt-embeddings content parts.

The model's chat template is rendered with a per-request placeholder where each embeddings part stands; the
rendered text is split at the placeholders, the text pieces are tokenized, and each placeholder becomes that
tensor's rows. The engine sees one sequence: ids, rows, ids, ...

Parts of one message are joined with a newline, as vLLM joins them, so a conversation moved from vLLM renders to
the same prompt. The documented placeholder ``<|prompt_embeds|>`` typed in a text part is refused (it would look
like an embeddings slot); the placeholder actually used carries a random nonce, so no text can forge one (a slot
written with another nonce is text). A conversation without embeddings parts has no slots: its rendering is
tokenized whole, with no nonce drawn and no search for slots.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from embedmesh.core.embeds import ModelSpec
from embedmesh.core.errors import InvalidArgument
from embedmesh.services.preprocessor.prompts import Piece, Prompt, Tokenizer, check_prompt
from embedmesh.services.preprocessor.tools import ToolSpec

__all__ = ["PLACEHOLDER", "ChatPart", "ChatMessage", "ChatTemplate", "build_chat_prompt", "check_role", "ROLES"]

PLACEHOLDER = "<|prompt_embeds|>"
"""The documented name of an embeddings slot; refused inside text parts."""

ROLES = ("system", "user", "assistant", "tool", "developer")

_SLOT = re.compile(r"<\|embedmesh:([0-9a-f]{16}):(\d+)\|>")
"""An embeddings slot as ``build_chat_prompt`` writes it (nonce, index); one with another request's nonce is text.
Compiled once: a pattern holding the nonce was compiled per request (~55 us, most of a short chat's rendering)."""


def check_role(i: int, role: str) -> None:
    """Message ``i``'s role is one the templates render (UNKNOWN_ROLE naming ``messages[i].role``)."""
    if role not in ROLES:
        raise InvalidArgument(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}",
                              field=f"messages[{i}].role", reason="UNKNOWN_ROLE")


@dataclass(frozen=True)
class ChatPart:
    """A text part, or an embeddings part already validated into rows of the model dtype (exactly one is set)."""

    text: str | None = None
    embeds: np.ndarray | None = None


@dataclass(frozen=True)
class ChatMessage:
    role: str
    parts: tuple[ChatPart, ...]
    name: str = ""


class ChatTemplate:
    """The model's Jinja chat template, rendered in a sandbox the way transformers renders it."""

    def __init__(self, folder: Path) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").exists():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        source = config.get("chat_template")
        if (folder / "chat_template.jinja").exists():
            source = (folder / "chat_template.jinja").read_text()
        if not source:
            raise ValueError(f"{folder} has no chat template (chat_template.jinja or tokenizer_config.json)")

        def raise_exception(message: str) -> None:
            raise InvalidArgument(f"messages: {message}", field="messages", reason="TEMPLATE_REJECTED")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self.knows_tools = "tools" in source
        """Whether the template renders a ``tools`` list itself (else tools are described in the system message)."""
        self._special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        extra = {"tools": tools} if tools else {}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self._special, **extra)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def build_chat_prompt(
    messages: list[ChatMessage],
    *,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    spec: ModelSpec,
    max_tokens: int,
    tools: ToolSpec | None = None,
) -> Prompt:
    """Validate the conversation, render it, and return the prompt as ids and embedding rows in order."""
    if not messages:
        raise InvalidArgument("messages must hold at least one message", field="messages", reason="EMPTY")
    nonce = ""  # drawn at the first embeddings part
    slots: list[np.ndarray] = []
    rendered_messages: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        check_role(i, m.role)
        texts: list[str] = []
        for j, part in enumerate(m.parts):
            field = f"messages[{i}].content[{j}]" if len(m.parts) > 1 or part.embeds is not None \
                else f"messages[{i}].content"
            if part.embeds is not None:
                rows = part.embeds
                nonce = nonce or secrets.token_hex(8)
                texts.append(f"<|embedmesh:{nonce}:{len(slots)}|>")
                slots.append(rows)
            else:
                text = part.text or ""
                if PLACEHOLDER in text:
                    raise InvalidArgument(
                        f"{field}: text contains the reserved placeholder {PLACEHOLDER}; send embeddings as a "
                        f'{{"type": "prompt_embeds"}} part instead',
                        field=field, reason="PLACEHOLDER_IN_TEXT",
                    )
                texts.append(text)
        entry = {"role": m.role, "content": "\n".join(texts)}
        if m.name:
            entry["name"] = m.name
        rendered_messages.append(entry)
    openai_tools = None
    if tools is not None:
        if template.knows_tools:
            openai_tools = [t.openai() for t in tools.tools]
        elif rendered_messages[0]["role"] == "system":
            first = rendered_messages[0]
            rendered_messages[0] = {**first, "content": f"{first['content']}\n\n{tools.system_text()}"}
        else:
            rendered_messages.insert(0, {"role": "system", "content": tools.system_text()})
    rendered = template.render(rendered_messages, tools=openai_tools)
    if not slots:
        pieces: list[Piece] = [tokenizer.encode(rendered, add_special_tokens=False)] if rendered else []
    else:
        pieces = _split_at_slots(rendered, nonce, slots, tokenizer)
    return check_prompt(Prompt(tuple(p for p in pieces if len(p))), spec, "messages", max_tokens)


def _split_at_slots(rendered: str, nonce: str, slots: list[np.ndarray], tokenizer: Tokenizer) -> list[Piece]:
    """The rendering's text pieces tokenized, and each of this request's slots replaced by its rows, in order."""
    pieces: list[Piece] = []
    pos = 0
    used = 0
    for match in _SLOT.finditer(rendered):
        if match.group(1) != nonce:  # another nonce: text (cannot overlap one of ours: it holds no "<" past its 1st)
            continue
        if match.start() > pos:
            pieces.append(tokenizer.encode(rendered[pos:match.start()], add_special_tokens=False))
        pieces.append(slots[int(match.group(2))])
        used += 1
        pos = match.end()
    if pos < len(rendered):
        pieces.append(tokenizer.encode(rendered[pos:], add_special_tokens=False))
    if used != len(slots):
        raise InvalidArgument("messages: the chat template dropped an embeddings part (a role it does not render?)",
                              field="messages", reason="EMBEDS_NOT_RENDERED")
    return pieces
