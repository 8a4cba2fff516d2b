"""The hf-embed engine's options (``engines/hf_embed/config.py``): threads only, shared with hf."""

from __future__ import annotations

import pytest

from embedmesh.services.worker.engines.hf.config import HFOptions
from embedmesh.services.worker.engines.hf_embed.config import HFEmbedOptions


def test_threads_only_declared_as_hf_declares_it() -> None:
    assert HFEmbedOptions() == HFEmbedOptions(threads=2)
    (info,) = HFEmbedOptions.options()
    assert info == next(o for o in HFOptions.options() if o.field == "threads")


def test_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="threads must be >= 1"):
        HFEmbedOptions(threads=0)
