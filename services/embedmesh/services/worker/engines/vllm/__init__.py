"""The ``vllm`` engine: vLLM's AsyncLLM (``engine.py``), its KV events in the mesh's hashes (``kv_events.py``) and
its scheduler metrics (``metrics.py``). Runs in vLLM's own venv."""
