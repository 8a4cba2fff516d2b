"""Run in the vLLM venv by test_vllm_worker_kv.py: vLLM's real ``ZmqEventPublisher`` against our subscriber.

Batches published before the subscriber connects are missed (ZMQ PUB drops them), so the first batch it sees has
a sequence number above 0: it must replay the missed ones from vLLM's ROUTER socket and translate every batch in
order. A second phase publishes with a one-batch replay buffer, so a gap cannot be filled: the mapping resets
(Cleared) and translation goes on. Prints one JSON line with what the sink received.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time


async def _phase(tmp: str, name: str, buffer_steps: int) -> list[list[object]]:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    from embedmesh.services.worker.engines.base import TokenSegment
    from embedmesh.services.worker.engines.vllm.kv_events import KvEventTranslator, VllmKvEventSubscriber

    got: list[list[object]] = []
    t = KvEventTranslator(4, lambda evs: got.append([type(e).__name__ for e in evs]))
    ids = tuple(range(1, 25))
    t.track("r", [TokenSegment(ids)], sent_tokens=ids)
    pub = ZmqEventPublisher(0, endpoint=f"ipc://{tmp}/{name}-ev", replay_endpoint=f"ipc://{tmp}/{name}-rp",
                            buffer_steps=buffer_steps, topic="kv")

    def batch(i: int) -> KVEventBatch:
        parent = None if i == 0 else f"h{i - 1}".encode()
        return KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=[f"h{i}".encode()], parent_block_hash=parent, token_ids=list(ids[4 * i:4 * i + 4]),
            block_size=4, lora_id=None, medium="GPU", lora_name=None)])

    for i in range(3):  # nobody listens yet: these reach only the replay buffer
        pub.publish(batch(i))
    time.sleep(0.5)
    sub = VllmKvEventSubscriber(t, f"ipc://{tmp}/{name}-ev", f"ipc://{tmp}/{name}-rp", topic="kv")
    sub.start()
    await asyncio.sleep(0.5)  # the subscription reaches the publisher
    for i in range(3, 6):
        pub.publish(batch(i))
    deadline = time.monotonic() + 10
    while t.counters["batches"] < (6 if buffer_steps > 3 else 3) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    await sub.close()
    pub.shutdown()
    return [got, t.counters["gaps"], t.counters["lost"], t.block_count]  # type: ignore[list-item]


async def _main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        filled = await _phase(tmp, "a", 100)
        lost = await _phase(tmp, "b", 1)
    print(json.dumps({"filled": filled, "lost": lost}))


if __name__ == "__main__":
    asyncio.run(_main())
    sys.stdout.flush()
