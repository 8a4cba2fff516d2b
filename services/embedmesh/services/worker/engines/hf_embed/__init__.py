"""The ``hf-embed`` engine: a sentence-transformers embedding model run with transformers (``engine.py``); its input
rules are shared with sglang in ``engines/embed_inputs.py``."""
