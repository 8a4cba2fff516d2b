"""The batch input file's checks: JSONL, the four keys, unique custom_id, known urls, bounds before parsing; and
the run order by shared prefix."""

from __future__ import annotations

import json

import pytest

from embedmesh.gateway.batch_lines import parse, prefix_key, run_order
from embedmesh.gateway.errors import ApiError


def line(cid: str, url: str = "/v1/completions", **body: object) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body or {"model": "m", "prompt": "x"}})


def refused(data: bytes, max_lines: int = 100) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(data, max_lines=max_lines)
    assert e.value.status == 400 and e.value.param == "file"
    return e.value


def test_a_good_file_gives_its_lines_in_file_order_and_blank_lines_are_skipped() -> None:
    data = "\n".join([line("a"), "", line("b", "/v1/chat/completions", model="m", messages=[]), ""]).encode()
    got = parse(data, max_lines=10)
    assert [(x.number, x.custom_id, x.url) for x in got] == [(1, "a", "/v1/completions"),
                                                            (3, "b", "/v1/chat/completions")]
    assert json.loads(got[1].body) == {"model": "m", "messages": []}
    assert not got[0].stream


@pytest.mark.parametrize(("text", "number", "words"), [
    ("{not json", 2, "not valid JSON"),
    ("[1, 2]", 2, "must be a JSON object"),
    (json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}), 2, "method must be"),
    (json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/models", "body": {}}), 2, "url must be one of"),
    (json.dumps({"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}}), 2, "custom_id must"),
    (json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": "x"}), 2, "body must"),
    (json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {}, "x": 1}), 2,
     "unknown key 'x'"),
])
def test_a_bad_line_is_a_400_naming_that_line(text: str, number: int, words: str) -> None:
    err = refused((line("a") + "\n" + text + "\n" + line("c")).encode())
    assert err.message.startswith(f"line {number}: ") and words in err.message, err.message


def test_a_file_that_is_not_utf8_names_the_line_of_the_first_bad_byte() -> None:
    err = refused(line("a").encode() + b"\n" + line("b").encode() + b"\n\xff\xfe")
    assert err.message.startswith("line 3: ") and "UTF-8" in err.message


def test_a_duplicate_custom_id_names_both_lines() -> None:
    err = refused("\n".join([line("a"), line("b"), line("a")]).encode())
    assert err.code == "duplicate_custom_id" and err.message.startswith("line 3: ") and "line 1" in err.message


def test_the_line_count_is_bounded_before_parsing_and_an_empty_file_refused() -> None:
    # 11 lines of garbage: refused for their count, not for the first bad line (nothing was parsed).
    assert refused(b"x\n" * 10 + b"x", max_lines=10).code == "too_many_lines"
    assert len(parse(("\n".join(line(str(i)) for i in range(10)) + "\n").encode(), max_lines=10)) == 10
    assert refused(b"\n \n").code == "empty_file"


def test_urls_the_gateway_does_not_serve_are_refused() -> None:
    with pytest.raises(ApiError, match="url must be one of /v1/completions"):
        parse(line("a", "/v1/responses", model="m", input="x").encode(), max_lines=5, urls=("/v1/completions",))


def test_a_streaming_body_is_marked_to_fail_alone() -> None:
    assert parse(line("a", model="m", prompt="x", stream=True).encode(), max_lines=5)[0].stream


def test_lines_that_share_a_prefix_run_next_to_each_other_file_order_among_equals() -> None:
    prompts = ["B long shared 1", "A other", "B long shared 2", "A other", "C"]
    lines = parse("\n".join(line(str(i), model="m", prompt=p) for i, p in enumerate(prompts)).encode(), max_lines=9)
    order = run_order(lines)
    by_rank = [prompts[i] for i in sorted(range(len(lines)), key=lambda i: order[i])]
    assert by_rank == ["A other", "A other", "B long shared 1", "B long shared 2", "C"]
    assert order[1] < order[3]  # equal prefixes keep file order


def test_the_prefix_is_what_the_endpoint_prompts_with() -> None:
    chat = prefix_key("/v1/chat/completions", {"model": "m", "messages": [{"role": "system", "content": "S"}]})
    assert chat.startswith("m\x00") and '"content":"S"' in chat
    assert "hello" in prefix_key("/v1/embeddings", {"model": "m", "input": "hello"})
    assert prefix_key("/v1/completions", {"model": 3, "prompt": 2**70}) == "\x00"
