"""The preprocessor's per-request bounds, checked before any work: a model name past 256 characters (TOO_LONG, naming
``model``), a client request id past 256 (it is echoed as the response's id), more chat messages than
``max_messages`` (TOO_MANY, before any message is read or rendered) and more image parts than ``max_images``
(TOO_MANY_IMAGES naming the first part past the bound, before any image is decoded or encoded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from embedmesh.services.preprocessor.service import (
    ChatMessageRequest,
    ChatPartRequest,
    ChatRequest,
    CompletionRequest,
    InferenceDomain,
    Limits,
)
from embedmesh.vision.decode import ImageLimits
from embedmesh.vision.stage import VisionStage
from tests.unit.services.preprocessor.test_service import _refused, _sampling
from tests.unit.services.preprocessor.test_service import domain as domain  # noqa: F401 (the fixture)
from tests.unit.services.preprocessor.test_service import folder as folder  # noqa: F401 (the fixture)
from tests.unit.vision.test_stage import CountingEncoder, png, url


def _text(text: str = "") -> ChatMessageRequest:
    return ChatMessageRequest("user", [ChatPartRequest(text=text)])


class _Renders:
    """A chat template that counts renders (none may happen for a refused request)."""

    def __init__(self, template: Any) -> None:
        self.template = template
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        self.calls += 1
        return getattr(self.template, name)


async def test_a_20000_character_model_name_is_too_long_naming_model(domain: InferenceDomain) -> None:
    for job in (domain.completion_job(CompletionRequest("m" * 20000, _sampling(), texts=["hi"])),
                domain.chat_job(ChatRequest("m" * 20000, _sampling(), [_text("hi")]))):
        err = await _refused(job)
        assert (err.field, err.reason) == ("model", "TOO_LONG") and "20000" in err.message
    with pytest.raises(Exception) as e:
        domain.embedding_model("e" * 257)
    assert (e.value.field, e.value.reason) == ("model", "TOO_LONG")  # type: ignore[attr-defined]
    err = await _refused(domain.completion_job(CompletionRequest("m" * 256, _sampling(), texts=["hi"])))
    assert err.reason == "MODEL_NOT_FOUND"  # at the bound: looked up (and not served)


async def test_a_100_kb_request_id_is_too_long_and_256_is_echoed(domain: InferenceDomain) -> None:
    for job in (domain.completion_job(CompletionRequest("base", _sampling(), texts=["hi"], request_id="r" * 100_000)),
                domain.chat_job(ChatRequest("base", _sampling(), [_text("hi")], request_id="r" * 100_000))):
        err = await _refused(job)
        assert (err.field, err.reason) == ("request_id", "TOO_LONG")
    job = await domain.chat_job(ChatRequest("base", _sampling(max_tokens=2), [_text("hi")], request_id="r" * 256))
    assert job.request_id == "r" * 256


async def test_more_messages_than_the_bound_are_refused_before_any_render(domain: InferenceDomain) -> None:
    domain.limits = Limits(max_n=4, max_prompts=3, max_embeds_bytes=1 << 20, max_messages=5)
    renders = _Renders(domain.models.default[1])
    domain.models.default = (domain.models.default[0], renders)  # type: ignore[assignment]
    err = await _refused(domain.chat_job(ChatRequest("base", _sampling(max_tokens=2), [_text()] * 6)))
    assert (err.field, err.reason) == ("messages", "TOO_MANY") and "5" in err.message and "6" in err.message
    assert renders.calls == 0
    job = await domain.chat_job(ChatRequest("base", _sampling(max_tokens=2), [_text("a")] * 5))
    assert job.prompts and renders.calls > 0


async def test_the_default_bound_is_2048_messages(domain: InferenceDomain) -> None:
    assert domain.limits.max_messages == 2048
    err = await _refused(domain.chat_job(ChatRequest("base", _sampling(max_tokens=2), [_text()] * 100_000)))
    assert (err.field, err.reason) == ("messages", "TOO_MANY")


async def test_more_images_than_the_bound_are_refused_before_any_encode(domain: InferenceDomain) -> None:
    encoders: list[CountingEncoder] = []

    def factory(folder: Path) -> CountingEncoder:
        encoders.append(CountingEncoder(folder))
        return encoders[-1]

    domain.limits = Limits(max_n=4, max_prompts=3, max_embeds_bytes=1 << 20, max_images=3)
    domain.vision = VisionStage(domain.cache, limits=ImageLimits(), folder_of=lambda model: Path("/m"),
                                factory=factory)
    image = ChatPartRequest(image=url(png(1)))
    two = ChatMessageRequest("user", [ChatPartRequest(text="look"), image, image])
    err = await _refused(domain.chat_job(ChatRequest("base", _sampling(max_tokens=4), [two, two])))
    assert (err.field, err.reason) == ("messages[1].content[2]", "TOO_MANY_IMAGES") and "3" in err.message
    assert sum(e.calls for e in encoders) == 0
    job = await domain.chat_job(ChatRequest("base", _sampling(max_tokens=4), [two, _text("x")]))
    assert job.prompts and sum(e.calls for e in encoders) >= 1


async def test_an_unknown_role_is_refused_before_an_earlier_messages_image_is_encoded(domain: InferenceDomain) -> None:
    encoders: list[CountingEncoder] = []

    def factory(folder: Path) -> CountingEncoder:
        encoders.append(CountingEncoder(folder))
        return encoders[-1]

    domain.vision = VisionStage(domain.cache, limits=ImageLimits(), folder_of=lambda model: Path("/m"),
                                factory=factory)
    image = ChatMessageRequest("user", [ChatPartRequest(image=url(png(2)))])
    bad = ChatMessageRequest("r" * 20000, [ChatPartRequest(text="hi")])
    err = await _refused(domain.chat_job(ChatRequest("base", _sampling(max_tokens=4), [image, bad])))
    assert (err.field, err.reason) == ("messages[1].role", "UNKNOWN_ROLE")
    assert sum(e.calls for e in encoders) == 0


def test_the_servicer_counts_messages_before_converting_any(domain: InferenceDomain,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from embedmesh.core.errors import InvalidArgument
    from embedmesh.core.transport.received import Received
    from embedmesh.inference.v1 import inference_pb2
    from embedmesh.services.preprocessor import servicer

    converted: list[int] = []
    monkeypatch.setattr(servicer, "_chat_request", lambda params, received: converted.append(len(params.messages)))
    domain.limits = Limits(max_n=4, max_prompts=3, max_embeds_bytes=1 << 20, max_messages=5)
    params = inference_pb2.ChatParams(model="base", messages=[inference_pb2.ChatMessage(role="user")] * 6)
    with pytest.raises(InvalidArgument) as info:
        servicer.InferenceServicer._chat_request(SimpleNamespace(domain=domain), params,  # type: ignore[arg-type]
                                                 Received(params))
    assert (info.value.field, info.value.reason) == ("messages", "TOO_MANY")
    assert converted == []
    del params.messages[5]
    servicer.InferenceServicer._chat_request(SimpleNamespace(domain=domain), params,  # type: ignore[arg-type]
                                             Received(params))
    assert converted == [5]
