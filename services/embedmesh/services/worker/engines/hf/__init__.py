"""The ``hf`` engine: a transformers causal LM on the CPU with continuous batching (``engine.py``), per-row logits
processors (``logits.py``) and incremental detokenization (``detok.py``)."""
