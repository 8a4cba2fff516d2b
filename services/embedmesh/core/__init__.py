"""Pieces every embedmesh service shares: server bootstrap, errors, tensors, logging."""
