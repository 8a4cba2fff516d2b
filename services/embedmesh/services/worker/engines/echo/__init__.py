"""The ``echo`` engine: no model, answers at once (``engine.py``); the smallest example of an engine."""
