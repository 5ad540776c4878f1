"""Does a mailbox's memory level off? Its core alone, in one process, through millions of messages.

    python load_tests/mailbox_memory.py                 # 3,000,000 messages, ~4 minutes

The `MailboxActor` body the Ray mailboxes run, driven as a generator drives it: puts of 16 messages
with fresh ids, a get, the ack, and a get that times out on the empty box. Prints the resident
memory every 300,000 messages: the acknowledged-id window (100,000 ids) fills, then the dict behind it
keeps its size while the allocator settles, so memory follows the count of messages, not time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid

from asyncrl.messages.ray_mailbox import MailboxActor


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def churn(messages: int, every: int) -> list[tuple[int, float]]:
    box = MailboxActor(capacity=64, lease_s=60.0)
    payload = b"x" * 600  # about a prompt's encoded size
    marks, sent = [(0, round(resident_mb(), 1))], 0
    while sent < messages:
        await box.put([(f"{uuid.uuid4().hex}-{i}", payload) for i in range(16)], timeout=1)
        got = await box.get(16, timeout=0.01)
        await box.ack([msg_id for msg_id, _ in got])
        await box.get(4, timeout=0.001)  # times out: the box is empty
        sent += 16
        if sent % every < 16:
            marks.append((sent, round(resident_mb(), 1)))
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=3_000_000)
    parser.add_argument("--every", type=int, default=300_000)
    args = parser.parse_args()
    start = time.time()
    marks = asyncio.run(churn(args.messages, args.every))
    print(json.dumps({"messages_vs_resident_mb": marks, "seconds": round(time.time() - start)}))


if __name__ == "__main__":
    main()
