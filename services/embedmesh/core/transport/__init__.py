"""A request's header and its tensors' bytes, in one message or in pieces: the one place that knows how.

``wire``    protobuf bytes written and read field by field, so a prompt's rows are copied once when sent and not at
            all when received (``Received``: the message without its tensors' bytes, and those bytes as views of the
            received buffer, by field path)
``pieces``  a header followed by its tensors' bytes in pieces (``InferenceService.Generate``, the worker's
            ``GenerateMany`` rows frames): laid out once, aligned, checked as they land, usable while they arrive
``tensor``  ``WireTensor``: one tensor as a request carried it — header, bytes, and whether they are still arriving
            — the explicit value the services hand on (no context variable, no lookup by address)

Every size that picks a path lives here (``thresholds``); services hand their request parsers to ``Server.add``,
so nothing in this package names a service's RPC.
"""
