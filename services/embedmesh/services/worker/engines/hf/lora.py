"""The hf engine's LoRA adapters (peft): loading one into the model (the first load wraps the model in a peft
model), unloading one once no running sequence uses it, and what a forward pass needs to give each row its own
adapter (peft's mixed-adapter batches: one continuous batch holds base-model rows and rows of any loaded adapters).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.logs import get_logger
from embedmesh.services.worker.engines.base import load_once
from embedmesh.services.worker.engines.hf.runner import ModelRunner
from embedmesh.services.worker.engines.hf.sequence import Seq

__all__ = ["LoraAdapters"]

log = get_logger(__name__)


class LoraAdapters:
    """Adapters loaded into ``runner.model``; ``model_lock`` is held while the model changes (the engine thread
    holds it for each step, so the model never changes mid-pass); ``in_use(name)`` says whether a running sequence
    still uses an adapter."""

    def __init__(self, runner: ModelRunner, model_lock: threading.Lock, in_use: Callable[[str], bool]) -> None:
        self._runner = runner
        self._model_lock = model_lock
        self._in_use = in_use
        self._loras: dict[str, str] = {}
        """Loaded LoRA adapters: name -> folder (peft format)."""
        self._loading: dict[str, asyncio.Future[bool]] = {}
        self._unloading: set[str] = set()
        self._peft = False
        """Whether ``runner.model`` is a peft model (after the first adapter load)."""
        self._plain: Any = None
        """The transformers model the peft model wraps."""

    def serves(self, name: str) -> bool:
        """Whether a new request may use adapter ``name`` (loaded, and not being unloaded)."""
        return name in self._loras and name not in self._unloading

    async def load(self, name: str, path: str) -> bool:
        """Load once: concurrent calls for one name share the first call's result. A folder that is not an
        adapter of this model is refused naming ``path``, and nothing of it stays loaded."""
        if name in self._loras:
            return False

        async def load() -> None:
            if not (Path(path) / "adapter_config.json").is_file():
                raise InvalidArgument(f"path: no adapter_config.json in {path!r}: not a peft adapter folder",
                                      field="path", reason="NOT_AN_ADAPTER")
            await asyncio.to_thread(self._load_adapter, name, path)
            self._loras[name] = path

        return await load_once(self._loading, name, load)

    def _load_adapter(self, name: str, path: str) -> None:
        r = self._runner
        with self._model_lock:
            try:
                if not self._peft:
                    from peft import PeftModel

                    self._plain = r.model  # the transformers model (peft injects its layers into it)
                    r.model = PeftModel.from_pretrained(r.model, path, adapter_name=name).eval()
                    self._peft = True
                else:
                    r.model.load_adapter(path, adapter_name=name)
                if r.model.active_adapter not in r.model.peft_config:
                    r.model.set_adapter(name)  # the active one was unloaded; peft needs a live one to consult
                r.model.eval()
            except Exception as e:  # noqa: BLE001 - a bad folder is the caller's error; leave nothing behind
                if self._peft and name in getattr(r.model, "peft_config", {}):
                    with contextlib.suppress(Exception):
                        r.model.delete_adapter(name)
                log.warning("LoRA load failed", extra={"adapter": name, "error": str(e)[:300]})
                raise InvalidArgument(f"path: the adapter in {path!r} cannot be loaded on this model "
                                      f"({type(e).__name__}: {str(e)[:200]})", field="path",
                                      reason="ADAPTER_MISMATCH") from None

    async def unload(self, name: str) -> bool:
        """Refuse new requests for ``name`` at once; let running ones finish; then free it."""
        if name not in self._loras or name in self._unloading:
            return False
        self._unloading.add(name)
        try:
            while self._in_use(name):
                await asyncio.sleep(0.05)
            await asyncio.to_thread(self._delete_adapter, name)
            self._loras.pop(name, None)
            return True
        finally:
            self._unloading.discard(name)

    def _delete_adapter(self, name: str) -> None:
        with self._model_lock:
            model = self._runner.model
            model.delete_adapter(name)
            left = list(model.peft_config)
            if left and model.active_adapter not in left:
                model.set_adapter(left[0])

    def loaded(self) -> dict[str, str]:
        """Name -> folder of the adapters requests may use."""
        return {n: p for n, p in self._loras.items() if n not in self._unloading}

    def forward_args(self, rows: list[Seq]) -> dict[str, Any]:
        """Forward-pass arguments giving each row its own adapter, or nothing before the first adapter is loaded."""
        if not self._peft or not self._runner.model.peft_config:
            return {}
        return {"adapter_names": [s.request.lora_adapter or "__base__" for s in rows]}

    def net(self) -> Any:
        """The module a forward pass runs: the peft model while adapters are loaded, else the (base) model."""
        if self._peft and not self._runner.model.peft_config:
            return self._plain  # every adapter unloaded: peft has no active adapter to consult
        return self._runner.model
