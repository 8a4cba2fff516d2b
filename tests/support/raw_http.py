"""Reading a server's answer off a raw HTTP/1.1 connection (an ``asyncio`` stream), for tests that speak to the
gateway's protocol over bare sockets, where an HTTP client would hide what the protocol does."""

from __future__ import annotations

import asyncio


async def read_answer(reader: asyncio.StreamReader, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    """One answer with a ``Content-Length`` body: (status, headers by lower-case name, body); each read waits
    ``timeout`` seconds at most."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout)
    return int(lines[0].split()[1]), headers, body
