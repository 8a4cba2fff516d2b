"""``POST /v1/prompt_embeds``: an upload's body."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from embedmesh.gateway.requests.fields import base64_bytes
from embedmesh.gateway.requests.model import Model, Say


def _check_upload_data(obj: Any) -> None:
    """-> the decoded bytes of the tensor file."""
    obj.data = base64_bytes(obj.data, "data")


class PromptEmbedsUpload(Model, kw_only=True):
    """``POST /v1/prompt_embeds``: ``data`` base64 of torch.save(tensor) or of a safetensors file (after ``parse``:
    its bytes), ``ttl_seconds`` an integer >= 1 or absent (the server's maximum is the preprocessor's rule). Other
    fields are ignored."""

    data: Any = None
    ttl_seconds: Annotated[int, Meta(ge=1), Say("must be an integer >= 1")] | None = None

    checks = {"data": _check_upload_data}
    always = frozenset({"data"})
