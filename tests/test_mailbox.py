import asyncio
import time

import msgspec
import pytest

from asyncrl.messages.mailbox import InProcessMailbox, MailboxCore
from asyncrl.messages.ray_mailbox import RayMailbox
from asyncrl.messages.structs import PromptRequest, int32_array


class Msg(msgspec.Struct, frozen=True):
    msg_id: str
    value: int = 0


def msgs(*ids):
    return [Msg(str(i), i) for i in ids]


def run(coro):
    return asyncio.run(coro)


def test_core_lease_expiry_and_ack():
    core = MailboxCore(capacity=3, lease_s=10.0)
    assert core.offer("a", 1) and core.offer("b", 2) and core.offer("c", 3)
    assert core.offer("d", 4) is None  # full
    assert core.offer("a", 1) is False  # duplicate
    assert [m for m, _ in core.take(2, now=0.0)] == ["a", "b"]
    assert core.take(5, now=5.0) == [("c", 3)]
    # a and b expire at t=10 and come back first, in order.
    assert [m for m, _ in core.take(5, now=10.0)] == ["a", "b"]
    assert core.ack(["a", "b", "c"]) == 3
    assert len(core) == 0
    assert core.offer("a", 1) is False  # acked ids stay deduplicated
    stats = core.stats()
    assert stats.redelivered_total == 2 and stats.duplicates_dropped == 2 and stats.acked_total == 3


def test_core_dedup_window_is_bounded():
    core = MailboxCore(capacity=10, lease_s=1.0, dedup_window=2)
    for i in range(3):
        core.offer(str(i), i)
    core.ack([m for m, _ in core.take(3, now=0.0)])
    assert core.offer("0", 0) is True  # forgotten: oldest beyond the window
    assert core.offer("2", 2) is False


def test_fifo_order_and_get_timeout():
    async def main():
        box = InProcessMailbox(capacity=100)
        await box.put(msgs(*range(10)))
        got = await box.get(4)
        got += await box.get(100)
        assert [m.value for m in got] == list(range(10))
        t0 = time.monotonic()
        assert await box.get(1, timeout=0.05) == []
        assert time.monotonic() - t0 >= 0.04

    run(main())


def test_backpressure_put_waits_until_ack():
    async def main():
        box = InProcessMailbox(capacity=2)
        await box.put(msgs(1, 2))
        blocked = asyncio.create_task(box.put(msgs(3)))
        await asyncio.sleep(0.05)
        assert not blocked.done()  # full: queued + leased count against capacity
        got = await box.get(2)
        await asyncio.sleep(0.05)
        assert not blocked.done()  # leased messages still occupy the mailbox
        await box.ack([m.msg_id for m in got])
        assert await asyncio.wait_for(blocked, 1.0) == 1
        with pytest.raises(TimeoutError):
            await box.put(msgs(4, 5), timeout=0.05)

    run(main())


def test_a_put_blocked_by_a_full_mailbox_shows_what_it_placed_to_a_waiting_getter():
    """A put of several messages that fills the mailbox partway waits for room; the messages it
    placed before waiting reach a getter already waiting (it would otherwise wait for the whole
    put, which waits for an ack that may come only after the getter's work)."""

    async def main():
        box = InProcessMailbox(capacity=3, lease_s=60)
        await box.put(msgs(1, 2))
        assert [m.msg_id for m in await box.get(2)] == ["1", "2"]  # leased: one slot left
        waiting = asyncio.ensure_future(box.get(5, timeout=10.0))
        await asyncio.sleep(0.01)
        putting = asyncio.ensure_future(box.put(msgs(3, 4)))  # "3" fills the box; "4" waits for room
        got = await asyncio.wait_for(waiting, 5.0)
        assert [m.msg_id for m in got] == ["3"] and not putting.done()
        await box.ack(["1"])
        assert await asyncio.wait_for(putting, 5.0) == 2

    run(main())


def test_killed_consumer_messages_come_back():
    async def main():
        box = InProcessMailbox(capacity=10, lease_s=0.2)
        await box.put(msgs(1, 2, 3))

        async def doomed_consumer():
            await box.get(2)
            await asyncio.sleep(60)  # dies before ack

        task = asyncio.create_task(doomed_consumer())
        await asyncio.sleep(0.05)
        task.cancel()
        survivor = await box.get(10, timeout=2.0)
        assert [m.value for m in survivor] == [3]
        redelivered = await box.get(10, timeout=2.0)  # waits for the lease to expire
        assert sorted(m.value for m in redelivered) == [1, 2]
        assert (await box.stats()).redelivered_total == 2

    run(main())


def test_duplicate_puts_are_delivered_once():
    async def main():
        box = InProcessMailbox(capacity=10)
        assert await box.put(msgs(1, 1, 2)) == 2
        got = await box.get(10)
        assert await box.put(msgs(1)) == 0  # leased
        await box.ack([m.msg_id for m in got])
        assert await box.put(msgs(2)) == 0  # acknowledged
        assert await box.get(10, timeout=0.05) == []

    run(main())


def test_many_producers_and_consumers():
    async def main():
        box = InProcessMailbox(capacity=8, lease_s=30)
        seen = []

        async def producer(p):
            for i in range(50):
                # Every message put twice (a retrying producer): still delivered once.
                await box.put([Msg(f"{p}-{i}", i)] * 2)

        async def consumer():
            while True:
                got = await box.get(3, timeout=0.3)
                if not got:
                    return
                seen.extend(m.msg_id for m in got)
                await box.ack([m.msg_id for m in got])

        await asyncio.gather(*(producer(p) for p in range(4)), *(consumer() for _ in range(3)))
        assert len(seen) == 200 and len(set(seen)) == 200

    run(main())


# --- across processes --------------------------------------------------------------------------


def _prompt(i):
    return PromptRequest(prompt_id=f"p{i}", prompt_token_ids=int32_array([i + 1]), group_size=2)


def test_ray_mailbox_across_processes(ray_session):
    ray = ray_session
    box = RayMailbox.create(PromptRequest, capacity=4, lease_s=30)

    @ray.remote(num_cpus=0)
    def produce(box, start):
        import asyncio

        async def go():
            return await box.put([_prompt(i) for i in range(start, start + 6)])

        return asyncio.run(go())

    async def consume(n):
        out = []
        deadline = time.monotonic() + 60
        while len(out) < n and time.monotonic() < deadline:
            got = await box.get(3, timeout=10)
            out += got
            await box.ack([m.msg_id for m in got])
        return out

    refs = [produce.remote(box, 0), produce.remote(box, 6)]
    got = asyncio.run(consume(12))
    assert sum(ray.get(refs)) == 12  # both producers finished despite capacity 4 (backpressure)
    assert sorted(m.prompt_id for m in got) == sorted(f"p{i}" for i in range(12))
    assert all(m.prompt_token_ids.dtype.name == "int32" for m in got)


def test_ray_consumer_killed_between_get_and_ack(ray_session):
    ray = ray_session
    box = RayMailbox.create(PromptRequest, capacity=10, lease_s=1.0)
    asyncio.run(box.put([_prompt(i) for i in range(3)]))

    @ray.remote(num_cpus=0)
    class Consumer:
        async def take_and_hang(self, box):
            got = await box.get(2)
            return [m.prompt_id for m in got]

    consumer = Consumer.remote()
    taken = ray.get(consumer.take_and_hang.remote(box))
    assert taken == ["p0", "p1"]
    ray.kill(consumer)  # dies holding the lease, never acks

    async def drain():
        out = []
        deadline = time.monotonic() + 10
        while len(out) < 3 and time.monotonic() < deadline:
            got = await box.get(10, timeout=2)
            out += got
            await box.ack([m.msg_id for m in got])
        return out

    got = asyncio.run(drain())
    assert sorted(m.prompt_id for m in got) == ["p0", "p1", "p2"]
    stats = asyncio.run(box.stats())
    assert stats.redelivered_total == 2 and stats.acked_total == 3


def test_a_sharded_mailbox_keeps_a_samples_windows_together_and_loses_nothing(ray_session):
    """Four shards as one mailbox: every message delivered once, acks reach the shard that delivered
    them, a sample's windows share a shard (in order), and a lease never acknowledged comes back."""
    import asyncio

    from asyncrl.messages.ray_mailbox import ShardedMailbox
    from asyncrl.messages.structs import FinishReason, Segment, float32_array, int32_array

    def seg(prompt, sample, turn):
        return Segment(prompt_id=prompt, sample_idx=sample, window=turn, group_id=prompt, group_size=4,
                       prompt_token_ids=int32_array([1]), prior_response_ids=int32_array([]),
                       prior_versions=int32_array([]), new_token_ids=int32_array([turn]),
                       new_logprobs=float32_array([0.0]), new_versions=int32_array([0]), finished=turn == 1,
                       finish_reason=FinishReason.EOS if turn == 1 else FinishReason.WINDOW)

    async def main():
        box = ShardedMailbox.create(Segment, shards=4, capacity=400, lease_s=1.0, key_attr="sample_id")
        sent = [seg(f"p{p}", s, t) for p in range(10) for s in range(4) for t in range(2)]
        assert await box.put(sent) == 80 and await box.put(sent[:5]) == 0  # duplicates dropped
        assert len({box.shard_of(m) for m in sent}) == 4
        assert all(box.shard_of(seg(f"p{p}", s, 0)) == box.shard_of(seg(f"p{p}", s, 1)) for p in range(10) for s in range(4))
        got, order, acked = [], {}, set()
        while len(got) < 80:
            part = await box.get(16, timeout=1.0)
            got += part
            for m in part:
                order.setdefault(m.sample_id, []).append(m.window)
            if part and len(got) < 60:
                await box.ack([m.msg_id for m in part])
                acked |= {m.msg_id for m in part}
        assert sorted(m.msg_id for m in got) == sorted(m.msg_id for m in sent)
        assert all(turns == [0, 1] for turns in order.values())  # a sample's windows in order
        unacked = {m.msg_id for m in got} - acked
        await asyncio.sleep(1.2)  # their leases expire: delivered again, nothing lost
        again = []
        while len(again) < len(unacked):
            again += await box.get(32, timeout=1.0)
        assert {m.msg_id for m in again} == unacked
        await box.ack([m.msg_id for m in again])
        stats = await box.stats()
        assert stats.acked_total == 80 and stats.queued == 0 and stats.leased == 0 and stats.duplicates_dropped == 5

    asyncio.run(main())


def test_release_gives_back_what_one_consumer_holds_at_once():
    """A consumer that died or left: its leases go back now, not at lease expiry; another's stay."""
    async def main():
        box = InProcessMailbox(10, lease_s=3600)
        await box.put(msgs(0, 1, 2, 3))
        mine = await box.get(2, consumer="gen-a")
        theirs = await box.get(1, consumer="gen-b")
        assert await box.release("gen-a") == 2
        again = await box.get(10, consumer="gen-c")
        assert sorted(m.msg_id for m in again) == sorted([m.msg_id for m in mine] + ["3"])
        assert (await box.stats()).leased == 4 and await box.release("gen-a") == 0
        await box.ack([m.msg_id for m in theirs])  # acked ones are no one's to give back
        assert await box.release("gen-b") == 0

    asyncio.run(main())


def test_a_renewed_lease_outlives_lease_s_and_one_lost_to_another_consumer_is_not_renewed():
    """Issue 44 (2): work longer than a lease (a long chain of thought) renews it, so the message
    is not delivered to a second consumer; one that expired meanwhile and waits in the queue is
    taken back; one another consumer took is not the renewer's (nor its to give back)."""
    core = MailboxCore(capacity=10, lease_s=10.0)
    for mid in "abc":
        core.offer(mid, mid)
    assert [m for m, _ in core.take(3, now=0.0, consumer="gen-a")] == ["a", "b", "c"]
    assert core.renew(["a", "b"], now=8.0, consumer="gen-a") == ["a", "b"]  # c is not renewed
    assert core.take(5, now=15.0, consumer="gen-b") == [("c", "c")]  # c expired at 10: redelivered
    assert core.take(5, now=17.9, consumer="gen-b") == []  # a and b held until 18
    assert core.renew(["c"], now=16.0, consumer="gen-a") == []  # gen-b holds c now
    assert core.nack(["c"], consumer="gen-a") == 0 and core.stats().leased == 3
    assert [m for m, _ in core.take(5, now=18.0, consumer="gen-b")] == ["a", "b"]  # renewals stopped
    core.expire_leases(now=40.0)  # everything expires; gen-a still works on a: it takes it back
    assert core.renew(["a"], now=40.0, consumer="gen-a") == ["a"]
    assert sorted(m for m, _ in core.take(5, now=41.0, consumer="gen-c")) == ["b", "c"]
    assert core.stats().renewed_total == 3
