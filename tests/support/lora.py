"""LoRA adapters the tests make with peft (no hub): a random one for the packaged SmolLM2, whose non-zero B changes
the model's output, and one made for another base model, whose shapes cannot fit SmolLM2."""

from __future__ import annotations

from pathlib import Path


def save_smol_adapter(folder: Path, seed: int = 0) -> Path:
    """A rank-8 adapter on q_proj/v_proj of the default model, random weights (``seed``), saved to ``folder``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from embedmesh.models import ensure_default_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(ensure_default_model())
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    model.save_pretrained(str(folder))
    return folder


def save_other_base_adapter(folder: Path) -> Path:
    """An adapter made for a tiny Llama of hidden size 64 (SmolLM2's is 576), saved to ``folder``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=30,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=49152))
    get_peft_model(tiny, LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).save_pretrained(str(folder))
    return folder
