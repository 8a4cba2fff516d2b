"""The ``sglang`` engine: SGLang's offline Engine for embeddings and generation (``engine.py``). Runs in SGLang's own
venv."""
