"""Waits sound at any ratio of lease or liveness bound to the work they cover.

A mailbox whose consumer holds each message longer than its lease, with producers waiting for room,
delivers everything and never spins; a window longer than the pool's liveness bound is live while
it decodes.

Found by a run: `cluster.lease_s=0.3` with the learner's steps longer than that stalled at step 7
with `batches: queued 1, leased 1`. The assembler's put waited for room; its wake-up was the lease's
deadline, already past and expired by nothing but a take, so it woke at once, again and again,
holding the mailbox's event loop (100% of a core) while the learner's get never ran."""

import asyncio
import os
import time

import numpy as np
import pytest
import ray

from asyncrl.messages.ray_mailbox import RayMailbox
from asyncrl.messages.structs import PromptRequest


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _message(i: int) -> PromptRequest:
    return PromptRequest(prompt_id=f"m{i}", prompt_token_ids=np.asarray([1, 2, 3], dtype=np.int32), group_size=1)


@pytest.mark.parametrize(("lease_s", "hold_s", "producers"),
                         [(0.02, 0.2, 1), (0.02, 0.2, 3), (0.3, 0.5, 2), (0.3, 0.05, 2), (5.0, 0.2, 2)])
def test_a_consumer_slower_than_its_lease_gets_everything_and_the_mailbox_does_not_spin(
        ray_session, lease_s, hold_s, producers):
    box = RayMailbox.create(PromptRequest, capacity=2, lease_s=lease_s)
    pid = ray.get(box.actor.pid.remote())
    total = 4 * producers

    async def produce(first: int) -> None:
        for i in range(first, first + 4):
            await box.put([_message(i)])

    async def consume() -> set:
        done: set = set()
        while len(done) < total:
            for message in await box.get(1, timeout=1.0, consumer="learner"):
                await asyncio.sleep(hold_s)  # longer than the lease (but for 5 s)
                await box.ack([message.msg_id])
                done.add(message.msg_id)
        return done

    async def main():
        return await asyncio.wait_for(asyncio.gather(consume(), *(produce(4 * p) for p in range(producers))), 60)

    cpu, start = _cpu_s(pid), time.monotonic()
    done, *_ = asyncio.run(main())
    wall, used = time.monotonic() - start, _cpu_s(pid) - cpu
    assert done == {f"m{i}" for i in range(total)}
    assert used < 0.5 * wall + 0.5, f"the mailbox used {used:.1f} s of CPU in {wall:.1f} s"
    ray.kill(box.actor)


def test_a_window_longer_than_the_liveness_bound_is_live_while_it_decodes():
    """A generator's liveness (`engine_call_s` in its stats) is the time since its engine's last
    decode step, not since its window began: a long window on a slow machine is not healed as hung
    (a run whose windows outlasted `cluster.generator_timeout_s` healed its generator for ever). A
    call that makes no progress still ages."""
    from asyncrl.config import compose
    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.generation import EngineCalls, build_generator_engine, sequence_input

    config = compose(["model=tiny"])
    engine, _ = build_generator_engine(config.model, config.engine)
    calls, seen = EngineCalls(), []

    def slow_step() -> bool:  # after each decode step: a slow machine's step, and what the pool would read
        time.sleep(0.03)
        seen.append(calls.oldest_s(engine.last_step_at))
        return False

    async def main():
        async with calls.call("window"):
            started = time.monotonic()
            params = SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0), (2, -100.0)))  # no EOS
            await asyncio.to_thread(engine.generate_window_sync, [sequence_input([5, 6, 7], 1, 60)], 60, params,
                                    None, slow_step)
            window_s = time.monotonic() - started
            await asyncio.sleep(0.6)  # no progress now
            return window_s, calls.oldest_s(engine.last_step_at)

    window_s, stalled = asyncio.run(main())
    assert window_s > 1.5 and len(seen) == 60
    assert max(seen) < 0.5, max(seen)  # each look just after a step: fresh, however long the window ran
    assert stalled >= 0.6


def test_a_mailbox_bounds_the_bytes_it_holds_and_still_passes_one_message_larger_than_that():
    """`cluster.mailbox_bytes`: with room for many messages but 3 KB of bytes, a fourth 1 KB message
    waits until one is acknowledged; a 10 KB message passes once the mailbox is empty."""
    from asyncrl.messages.mailbox import MailboxCore

    core = MailboxCore(capacity=100, lease_s=10.0, capacity_bytes=3000)
    assert all(core.offer(f"m{i}", b"x" * 1000) for i in range(3))
    assert core.offer("m3", b"x" * 1000) is None and core.stats().bytes == 3000
    (mid, _), = core.take(1, now=0.0)
    core.ack([mid])
    assert core.offer("m3", b"x" * 1000) is True
    assert core.offer("big", b"x" * 10_000) is None  # others are held
    for mid, _ in core.take(10, now=0.0):
        core.ack([mid])
    assert core.offer("big", b"x" * 10_000) is True and core.stats().bytes == 10_000
    with pytest.raises(ValueError, match="capacity_bytes"):
        MailboxCore(capacity=1, lease_s=1.0, capacity_bytes=-1)
