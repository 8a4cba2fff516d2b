"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: vLLM's bodies."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from embedmesh.gateway.requests.model import Model, Refusal, Say

_NonEmpty = Annotated[str, Meta(min_length=1), Say("is required (a non-empty string)",
                                                   lambda v, o: "missing" if v is None else "invalid_type")]


def _check_workers(obj: Any) -> None:
    """Any falsy value means every worker ([])."""
    workers = obj.workers or []
    if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
        raise Refusal("workers", "must be a list of worker ids (see /health)", "invalid_type")
    obj.workers = workers


class LoadLoraRequest(Model, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``/v1/load_lora_adapter`` body (``load_inplace`` accepted and ignored)."""

    unknown = "is not a parameter of this route"
    workers: Any = None
    lora_name: _NonEmpty
    lora_path: _NonEmpty
    load_inplace: Any = None

    checks = {"workers": _check_workers}
    always = frozenset({"workers"})


class UnloadLoraRequest(Model, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``/v1/unload_lora_adapter`` body (``lora_int_id`` accepted and ignored)."""

    unknown = "is not a parameter of this route"
    lora_name: _NonEmpty
    lora_int_id: Any = None
