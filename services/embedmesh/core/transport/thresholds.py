"""Every size at which a request's tensors change path between two processes of the mesh, in one place.

A threshold here changes speed only, never what a request means: each path gives the same answer (tests send
requests just below and just above each one). What each is set by:

===================  =========  =============================================================================
name                 value      picks
===================  =========  =============================================================================
ZERO_COPY_MIN        4 KiB      a received message of at least this size has its tensors' bytes cut out as
                                views of the received buffer (``wire.split_*``); below it protobuf's parser is
                                as fast (the cut is Python)
PIECE_BYTES          1 MiB      bytes of rows per piece of a pieces stream or per ``rows`` frame: each piece is
                                copied while it is still in cache, and no message limit needs raising
SHARED_STREAM_MAX    256 KiB    preprocessor -> worker: a request of at most this size is one start frame on the
                                worker's long-lived ``GenerateMany`` stream; a bigger one gets a ``GenerateMany``
                                call of its own (on the shared stream it would hold up every other generation
                                while it is written)
WORKER_PIECES_MIN    1 MiB      preprocessor -> worker: a prompt with at least this many bytes of rows goes on its
                                own call as a start frame whose tensors carry no bytes, then ``rows`` frames
FORWARD_MIN          8 MiB      a completion's one prompt tensor of at least this size, sent as rows after its
                                header, goes on to its worker while it still arrives (checked piece by piece);
                                smaller ones are assembled first
ROUTE_BYTES          4 MiB      rows still arriving are routed on the block hashes of their first rows up to
                                this many bytes (the whole prompt when smaller)
UNARY_ANSWER_MAX     1 MiB      a caller (gateway, bench client) reads a whole answer under this size as a unary
                                call; above it as a stream (unary reads of big answers were slower and slowed
                                later uploads on the channel)
===================  =========  =============================================================================

The clients (``clients/python``, ``clients/typescript``) are separate packages and keep their own copies of
``PIECE_BYTES`` and their pieces threshold; the gateway's pieces threshold is its ``pieces_min_bytes`` setting.
"""

from __future__ import annotations

__all__ = ["ZERO_COPY_MIN", "PIECE_BYTES", "SHARED_STREAM_MAX", "WORKER_PIECES_MIN", "FORWARD_MIN", "ROUTE_BYTES",
           "UNARY_ANSWER_MAX"]

ZERO_COPY_MIN = 4 << 10
PIECE_BYTES = 1 << 20
SHARED_STREAM_MAX = 256 << 10
WORKER_PIECES_MIN = 1 << 20
FORWARD_MIN = 8 << 20
ROUTE_BYTES = 4 << 20
UNARY_ANSWER_MAX = 1 << 20
