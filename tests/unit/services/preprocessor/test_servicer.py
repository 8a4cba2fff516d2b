"""The servicer's proto <-> domain conversion (servicer.py): prompt_embeds named as clients number them, the
bytes cut out of the request (a ``transport.Received``) taken as they are, chat parts and tools carried unchecked to
the domain, and results written back field for field; admission (``--max-inflight``) refuses at once past its bound."""

from __future__ import annotations

import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.core.sampling import TEMPERATURE_RANGE, SamplingParams
from embedmesh.core.transport.received import Received
from embedmesh.inference.v1 import inference_pb2
from embedmesh.services.preprocessor.pipeline import Usage
from embedmesh.services.preprocessor.service import Choice, Completion, Stream
from embedmesh.services.preprocessor.servicer import (
    Admission,
    _chat_request,
    _completion_request,
    _response,
    _stream_message,
)
from embedmesh.services.preprocessor.tools import ToolCall
from embedmesh.tensor.v1 import tensor_pb2


def test_completion_params_become_a_completion_request() -> None:
    tensor = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=[1, 2], data=b"\0" * 8)
    params = inference_pb2.CompletionParams(
        model="m", prompts=["a"], prompt_token_ids=[inference_pb2.TokenIds(ids=[1, 2])], echo=True,
        prompt_embeds=[inference_pb2.PromptEmbeds(tensor=tensor),
                       inference_pb2.PromptEmbeds(encoded=tensor_pb2.EncodedTensor()),
                       inference_pb2.PromptEmbeds(cache_id="emb-1"), inference_pb2.PromptEmbeds()])
    received = memoryview(b"serialized bytes")
    request = _completion_request(params, Received(params, {"prompt_embeds[1]": received}))
    assert (request.model, request.n, list(request.texts), request.echo) == ("m", None, ["a"], True)
    assert [list(t) for t in request.token_prompts] == [[1, 2]]
    first, encoded, upload, empty = request.embeds
    assert first.tensor is not None and first.tensor.header == tensor and first.array is None  # read later
    assert first.tensor.data is None and first.tensor.arriving is None  # its bytes came inside the message
    assert encoded.encoded is received  # the view of the received request, not a copy
    assert upload.cache_id == "emb-1"
    assert (empty.tensor, empty.encoded, empty.array, empty.cache_id) == (None, None, None, "")
    assert request.prefix is None
    with_n = _completion_request(inference_pb2.CompletionParams(model="m", n=3), Received(None))
    assert with_n.n == 3


def test_sampling_is_resolved_and_range_checked_at_the_servicer() -> None:
    """The domain gets the plain ``SamplingParams`` (defaults applied); a range is refused here, before the model
    is looked up, with the same field, reason and words as before."""
    params = inference_pb2.CompletionParams(model="m", sampling=common_pb2.SamplingParams(max_tokens=5, top_k=3))
    request = _completion_request(params, Received(params))
    assert request.sampling == SamplingParams(max_tokens=5, top_k=3)
    chat = _chat_request(inference_pb2.ChatParams(model="m"), Received(None))
    assert chat.sampling == SamplingParams()
    bad = common_pb2.SamplingParams(temperature=-1)
    for convert in (lambda: _completion_request(inference_pb2.CompletionParams(model="nope", sampling=bad),
                                                Received(None)),
                    lambda: _chat_request(inference_pb2.ChatParams(model="nope", sampling=bad), Received(None))):
        with pytest.raises(InvalidArgument) as e:
            convert()
        assert (str(e.value), e.value.field, e.value.reason) == (TEMPERATURE_RANGE, "temperature", "OUT_OF_RANGE")


def test_max_tokens_zero_is_allowed_with_echo_only() -> None:
    zero = common_pb2.SamplingParams(max_tokens=0)
    echo = _completion_request(inference_pb2.CompletionParams(model="m", echo=True, sampling=zero), Received(None))
    assert echo.sampling.max_tokens == 0
    for params in (inference_pb2.CompletionParams(model="m", sampling=zero), inference_pb2.ChatParams(sampling=zero)):
        with pytest.raises(InvalidArgument) as e:
            if isinstance(params, inference_pb2.ChatParams):
                _chat_request(params, Received(None))
            else:
                _completion_request(params, Received(None))
        assert (str(e.value), e.value.field, e.value.reason) == ("max_tokens must be >= 1", "max_tokens",
                                                                 "OUT_OF_RANGE")


def test_chat_params_become_a_chat_request() -> None:
    params = inference_pb2.ChatParams(model="m", messages=[
        inference_pb2.ChatMessage(role="user", parts=[
            inference_pb2.ChatContentPart(text="hi"),
            inference_pb2.ChatContentPart(prompt_embeds=inference_pb2.PromptEmbeds(cache_id="emb-1"))]),
        inference_pb2.ChatMessage(role="assistant", tool_calls=[inference_pb2.ToolCall(name="f", arguments="{}")]),
    ], tools=[inference_pb2.Tool(name="f")], tool_choice=inference_pb2.ToolChoice(mode="required"))
    request = _chat_request(params, Received(params))
    user, assistant = request.messages
    assert user.parts[0].text == "hi" and user.parts[1].embeds is not None
    assert user.parts[1].embeds.cache_id == "emb-1"
    assert list(assistant.tool_calls) == [("f", "{}")]
    assert (request.tools.tools, request.tools.choice, request.tools.mode) == ((("f", "", ""),), "mode", "required")


def test_image_parts_become_image_sources() -> None:
    params = inference_pb2.ChatParams(model="m", messages=[inference_pb2.ChatMessage(role="user", parts=[
        inference_pb2.ChatContentPart(image=inference_pb2.ImageInput(url="data:image/png;base64,AAAA")),
        inference_pb2.ChatContentPart(image=inference_pb2.ImageInput(data=b"\x89PNG")),
        inference_pb2.ChatContentPart(image=inference_pb2.ImageInput())])])
    url, raw, empty = _chat_request(params, Received(params)).messages[0].parts
    assert url.image is not None and url.image.url == "data:image/png;base64,AAAA" and url.image.data is None
    assert raw.image is not None and raw.image.data == b"\x89PNG" and raw.image.url == ""
    assert empty.image is not None and empty.image.url == "" and empty.image.data is None  # refused as BAD_URL
    assert all(p.embeds is None and p.text == "" for p in (url, raw, empty))


def test_results_are_written_back_field_for_field() -> None:
    lp = common_pb2.TokenLogprob(token_id=1, logprob=-1.0)
    call = inference_pb2.ToolCall(id="call_1", name="f", arguments="{}")
    result = Completion("id", "m", [Choice(0, "t", [1], common_pb2.FINISH_REASON_STOP, [lp], [lp],
                                           [ToolCall("call_1", "f", "{}")])], Usage(3, 1))
    out = _response(inference_pb2.CompleteResponse, result)
    assert out == inference_pb2.CompleteResponse(
        id="id", model="m", usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4),
        choices=[inference_pb2.Choice(index=0, text="t", token_ids=[1], finish_reason=common_pb2.FINISH_REASON_STOP,
                                      logprobs=[lp], prompt_logprobs=[lp], tool_calls=[call])])
    stream = Stream("id", "m", None)  # type: ignore[arg-type]
    delta = _stream_message(inference_pb2.StreamCompleteResponse, stream, Choice(2, "x", (5,)))
    assert delta.SerializeToString() == inference_pb2.StreamCompleteResponse(
        id="id", model="m", index=2, text="x", token_ids=[5]).SerializeToString()
    usage = _stream_message(inference_pb2.StreamChatResponse, stream, Usage(1, 2))
    assert usage.usage.total_tokens == 3 and usage.id == "id"


def test_the_in_flight_bound_refuses_at_once_with_a_retry_delay() -> None:
    admission = Admission(2)
    with admission.slot("Generate"), admission.slot("Generate"):
        with pytest.raises(Unavailable) as e, admission.slot("Generate"):
            pass
        assert e.value.reason == "OVERLOADED" and e.value.retry_after_seconds == 1.0
    assert admission.inflight == 0
    with admission.slot("Generate"):
        assert admission.inflight == 1
