"""The hf engine's forward passes (on the CPU, or a CUDA device with ``device``): the model loaded, prompts turned
into embeddings, a prefill of new sequences together (after their cached prefixes, ``kv_blocks.py``), one decode step
of the running batch, and the batch's KV cache (new rows merged in, ended rows dropped).
It returns logits; choosing tokens from them is ``sampler.py``'s.

Batch invariants (kept by ``merge`` and ``drop``):
- ``cache`` layers hold (B, heads, T, head_dim); row i of every layer, ``mask[i]`` and ``rows[i]`` are one sequence.
- ``mask[i, t] == 1`` where position t holds a real token of row i; padding is on the left.
- Every row has exactly one sampled token not yet fed to the model (``rows[i].pending``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embedmesh.core.logs import get_logger
from embedmesh.services.worker.engines.base import ModelInfo, TokenSegment
from embedmesh.services.worker.engines.hf.sequence import Seq

__all__ = ["HFEngineConfig", "ModelRunner", "Prefill"]

log = get_logger(__name__)


@dataclass(frozen=True)
class HFEngineConfig:
    model_path: Path
    """Local Hugging Face folder (config.json, safetensors, tokenizer.json)."""
    served_name: str
    """Name clients pass as ``model``."""
    max_batch_size: int = 8
    """Most sequences decoded together."""
    threads: int = 2
    """torch intra-op threads."""
    dtype: str = "float32"
    """Compute dtype: float32 (exact on CPU), bfloat16 or float16."""
    device: str = "cpu"
    """Where the model runs: "cpu", or a torch CUDA device ("cuda", "cuda:1"). Sampling stays on the CPU (a
    step's last logits are copied back, one row per sequence)."""
    block_size: int = 16
    """Positions per KV block: the worker's --block-size, the one the router hashes prompts with."""
    prefix_cache_blocks: int = 0
    """Blocks the prefix cache keeps (``prefix_cache.py``); 0 = off."""


@dataclass
class Prefill:
    """A prefill's result: the new rows' cache and mask (to merge into the running batch), the sequences in row
    order, and the logits of every kept position (the last only, unless a row asked for prompt log-probabilities;
    the prompts are left-padded to ``length``)."""

    cache: Any
    mask: Any
    seqs: list[Seq]
    logits: Any
    length: int


class ModelRunner:
    """The model and the passes run on it. ``model`` is the transformers model until the first LoRA adapter is
    loaded, then the peft model wrapping it (``lora.py`` swaps it); each pass runs the module ``net`` it is given."""

    def __init__(self, config: HFEngineConfig) -> None:
        self.config = config
        self.model: Any = None
        self.tokenizer: Any = None
        self.embed: Any = None
        self.torch: Any = None
        self.dtype: Any = None
        self.device: Any = None
        self.eos_ids: set[int] = set()
        self.info: ModelInfo | None = None
        """Set once the model is loaded."""

    def load(self, on_layer: Callable[[], None]) -> None:
        """Load the model and tokenizer; ``on_layer`` is called after every decoder layer run (progress)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(self.config.threads)
        t0 = time.monotonic()
        dtype = getattr(torch, self.config.dtype)
        cfg = AutoConfig.from_pretrained(self.config.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.config.model_path, dtype=dtype).eval()
        self.device = torch.device(self.config.device)
        self.model.to(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model_path)
        self.embed = self.model.get_input_embeddings()
        self.torch = torch
        self.dtype = dtype
        self._count_layer_progress(on_layer)
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else cfg.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        self.info = ModelInfo(
            model=self.config.served_name,
            engine="hf",
            hidden_size=int(cfg.hidden_size),
            max_context_tokens=int(getattr(cfg, "max_position_embeddings", 2048)),
            dtype=self.config.dtype,
            vocab_size=int(self.embed.weight.shape[0]),
            max_batch_size=self.config.max_batch_size,
        )
        seconds = round(time.monotonic() - t0, 2)
        log.info("model loaded", extra={"path": str(self.config.model_path), "seconds": seconds})

    def _count_layer_progress(self, on_layer: Callable[[], None]) -> None:
        """Count every decoder layer run as progress, so a long prefill is not mistaken for a stall."""
        layers = next((m for m in self.model.modules() if isinstance(m, self.torch.nn.ModuleList)), None)

        def tick(*_: Any) -> None:
            on_layer()

        for layer in layers or ():
            layer.register_forward_hook(tick)

    def prompt_embeds(self, s: Seq) -> Any:
        """The prompt as one (tokens, hidden) tensor: token ids through the model's embedding layer, rows as given.
        So a prompt given as ``embed_tokens(ids)`` and the same prompt as ids run the identical computation."""
        torch = self.torch
        parts = []
        for seg in s.request.segments:
            if isinstance(seg, TokenSegment):
                ids = torch.tensor(seg.ids, dtype=torch.long, device=self.device)
                parts.append(self.embed(ids))
            else:
                rows = seg.rows
                if rows.dtype == np.uint16:  # bf16 bits
                    t = torch.from_numpy(rows.astype(np.int16, copy=True)).view(torch.bfloat16)
                else:
                    t = torch.from_numpy(np.array(rows, copy=True))
                parts.append(t.to(self.device, self.dtype))
        if s.request.resumed:  # a migrated stream's tokens, after the prompt
            parts.append(self.embed(torch.tensor(s.request.resumed, dtype=torch.long, device=self.device)))
        return torch.cat(parts, dim=0)

    def prefill(self, embeds: list[Any], ready: list[Seq], net: Any, forward_args: dict[str, Any],
                pasts: list[list[Any]] | None = None) -> Prefill:
        """Prefill ``ready`` together (left-padded ``inputs_embeds``); sets each one's position. ``pasts``: each
        row's cached prefix blocks (``kv_blocks.py``); a row with some runs only the positions after them, against
        a cache that starts with them. Without any, the cache starts empty."""
        torch = self.torch
        from transformers import DynamicCache

        offsets = [0] * len(ready)
        if pasts and any(pasts):
            from embedmesh.services.worker.engines.hf.kv_blocks import build_past

            new_cache, past_mask, offsets = build_past(torch, pasts, self.device)
            embeds = [e[offsets[i]:] for i, e in enumerate(embeds)]
        else:
            new_cache, past_mask = DynamicCache(), None
        length = max(e.shape[0] for e in embeds)
        hidden = embeds[0].shape[1]
        batch = torch.zeros(len(ready), length, hidden, dtype=self.dtype, device=self.device)
        new_mask = torch.zeros(len(ready), length, dtype=torch.long, device=self.device)
        for i, e in enumerate(embeds):
            batch[i, length - e.shape[0]:] = e
            new_mask[i, length - e.shape[0]:] = 1
        positions = (new_mask.cumsum(-1) - 1).clamp(min=0)
        if past_mask is not None:
            positions = positions + torch.tensor(offsets, dtype=torch.long, device=self.device)[:, None]
            new_mask = torch.cat([past_mask, new_mask], dim=1)
        scored = any(s.request.sampling.prompt_logprobs is not None for s in ready)
        out = net(
            inputs_embeds=batch, attention_mask=new_mask, position_ids=positions, past_key_values=new_cache,
            use_cache=True, logits_to_keep=0 if scored else 1, **forward_args,
        )
        for i, s in enumerate(ready):
            s.position = offsets[i] + embeds[i].shape[0]
        return Prefill(new_cache, new_mask, ready, out.logits, length)

    def decode(self, cache: Any, mask: Any, rows: list[Seq], net: Any, forward_args: dict[str, Any]
               ) -> tuple[Any, Any, Any]:
        """One decode step of the batch: each row's pending token in -> (cache, mask, last logits)."""
        torch = self.torch
        ids = torch.tensor([[s.pending] for s in rows], dtype=torch.long, device=self.device)
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long, device=self.device)], dim=1)
        positions = torch.tensor([[s.position] for s in rows], dtype=torch.long, device=self.device)
        out = net(
            inputs_embeds=self.embed(ids), attention_mask=mask, position_ids=positions, past_key_values=cache,
            use_cache=True, **forward_args,
        )
        for s in rows:
            s.position += 1
        return cache, mask, out.logits[:, -1, :].float()

    def cat_mask(self, a: Any, b: Any) -> Any:
        torch = self.torch
        t = max(a.shape[1], b.shape[1])
        pad = lambda m: torch.nn.functional.pad(m, (t - m.shape[1], 0))  # noqa: E731
        return torch.cat([pad(a), pad(b)], dim=0)

    def merge(self, cache: Any, mask: Any, new_cache: Any, new_mask: Any) -> Any:
        """``new_cache``'s rows appended to ``cache``'s, both left-padded to the longer one."""
        torch = self.torch
        t = max(mask.shape[1], new_mask.shape[1])
        for old_layer, new_layer in zip(cache.layers, new_cache.layers, strict=True):
            for name in ("keys", "values"):
                a, b = getattr(old_layer, name), getattr(new_layer, name)
                a = torch.nn.functional.pad(a, (0, 0, t - a.shape[2], 0))
                b = torch.nn.functional.pad(b, (0, 0, t - b.shape[2], 0))
                setattr(old_layer, name, torch.cat([a, b], dim=0))
        return cache

    def drop(self, cache: Any, mask: Any, rows: list[Seq]) -> tuple[Any, Any, list[Seq]]:
        """The batch without its ended rows (``done``), and without the columns that are padding in every row
        left."""
        torch = self.torch
        keep = [i for i, s in enumerate(rows) if not s.done]
        if len(keep) == len(rows):
            return cache, mask, rows
        if not keep:
            return None, None, []
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = mask[idx]
        # Columns that are padding in every remaining row are dead weight: trim them.
        first = int((mask.sum(0) > 0).nonzero()[0])
        mask = mask[:, first:]
        for layer in cache.layers:
            layer.keys = layer.keys[idx, :, first:]
            layer.values = layer.values[idx, :, first:]
        return cache, mask, [rows[i] for i in keep]
