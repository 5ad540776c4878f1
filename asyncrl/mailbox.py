"""Bounded mailboxes with leases, acknowledgement and deduplication.

A mailbox is owned by its consumer. The guarantees, stated once here and enforced by
`MailboxCore` (both implementations share it):

* **Backpressure.** `capacity` bounds queued + leased messages; `put` waits while full.
* **At-least-once delivery.** `get` *leases* messages; a message not acknowledged within
  `lease_s` goes back to the front of the queue and is delivered again. A consumer that dies
  between `get` and `ack` therefore loses nothing.
* **Deduplication by message id.** A put whose id is queued, leased, or acknowledged within the
  last `dedup_window` ids (100,000 by default) is dropped, so a producer that retries a put never makes a duplicate.
  With consumers that process a message before acknowledging it, each message is delivered to
  processing once in the absence of lease expiry, and the consumer-side dedup of the id
  (the assembler, the learner) turns a redelivery after a slow consumer into exactly-once.
* **Order.** FIFO among first deliveries; redelivered messages jump to the front.
* **Lease owners.** A `get` may name its consumer; `release(consumer)` gives back at once every
  message that consumer holds (a generator that died or left): its work is delivered again now,
  not when the leases expire.

Implementations behind one interface (`Mailbox`): `InProcessMailbox` (asyncio, one process),
`RayMailbox` (a client of a `MailboxActor`; messages cross the process boundary as msgspec bytes,
never pickled user objects) and `ShardedMailbox` (several `RayMailbox` shards as one, for many
producers).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Generic, Iterable, Protocol, Sequence, TypeVar

import msgspec

from asyncrl.schema import Codec

T = TypeVar("T")
M = TypeVar("M")


class MailboxStats(msgspec.Struct, kw_only=True):
    queued: int
    leased: int
    capacity: int
    put_total: int
    duplicates_dropped: int
    delivered_total: int
    redelivered_total: int
    acked_total: int


class RecentIds:
    """A set that remembers only the newest `window` ids: deduplication with bounded memory on a
    run of days (a redelivery or retry arrives within minutes, far inside the window)."""

    def __init__(self, window: int = 200_000):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __contains__(self, msg_id: str) -> bool:
        return msg_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, msg_id: str) -> None:
        self._ids[msg_id] = None
        self._ids.move_to_end(msg_id)
        while len(self._ids) > self.window:
            self._ids.popitem(last=False)


class MailboxCore(Generic[T]):
    """The mailbox state machine; synchronous and clock-injected so it is testable alone."""

    def __init__(self, capacity: int, lease_s: float, dedup_window: int = 100_000):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.capacity = capacity
        self.lease_s = lease_s
        self.dedup_window = dedup_window
        self._queue: collections.deque[tuple[str, T]] = collections.deque()
        self._queued_ids: set[str] = set()
        self._leased: dict[str, tuple[T, float]] = {}  # id -> (item, lease deadline)
        self._owners: dict[str, str] = {}  # leased id -> the consumer that named itself in `get`
        self._acked = RecentIds(dedup_window)
        self._stats = collections.Counter()

    def __len__(self) -> int:
        return len(self._queue) + len(self._leased)

    @property
    def full(self) -> bool:
        return len(self) >= self.capacity

    def is_duplicate(self, msg_id: str) -> bool:
        return msg_id in self._queued_ids or msg_id in self._leased or msg_id in self._acked

    def offer(self, msg_id: str, item: T) -> bool | None:
        """Enqueue. Returns True if accepted, False if a duplicate (dropped), None if full."""
        if self.is_duplicate(msg_id):
            self._stats["duplicates_dropped"] += 1
            return False
        if self.full:
            return None
        self._queue.append((msg_id, item))
        self._queued_ids.add(msg_id)
        self._stats["put_total"] += 1
        return True

    def expire_leases(self, now: float) -> int:
        """Return expired leases to the front of the queue (oldest first). Returns how many."""
        expired = [(mid, item) for mid, (item, deadline) in self._leased.items() if deadline <= now]
        for mid, item in reversed(expired):
            del self._leased[mid]
            self._owners.pop(mid, None)
            self._queue.appendleft((mid, item))
            self._queued_ids.add(mid)
            self._stats["redelivered_total"] += 1
        return len(expired)

    def take(self, max_n: int, now: float, consumer: str = "") -> list[tuple[str, T]]:
        self.expire_leases(now)
        taken = []
        while self._queue and len(taken) < max_n:
            mid, item = self._queue.popleft()
            self._queued_ids.discard(mid)
            self._leased[mid] = (item, now + self.lease_s)
            if consumer:
                self._owners[mid] = consumer
            taken.append((mid, item))
        self._stats["delivered_total"] += len(taken)
        return taken

    def release(self, consumer: str) -> int:
        """Give back every message `consumer` holds (it died or left): delivered again at once."""
        return self.nack([mid for mid, owner in self._owners.items() if owner == consumer and mid in self._leased])

    def ack(self, msg_ids: Iterable[str]) -> int:
        """Acknowledge leased messages; unknown ids (already acked, expired-and-requeued) are ignored
        except that a queued message acknowledged late is removed from the queue: the consumer that
        held the expired lease did finish it."""
        n = 0
        for mid in msg_ids:
            self._owners.pop(mid, None)
            if mid in self._leased:
                del self._leased[mid]
            elif mid in self._queued_ids:
                self._queued_ids.discard(mid)
                self._queue = collections.deque((m, it) for m, it in self._queue if m != mid)
            else:
                continue
            self._remember_acked(mid)
            n += 1
        self._stats["acked_total"] += n
        return n

    def nack(self, msg_ids: Iterable[str]) -> int:
        """Give leased messages back at once (the consumer could not process them)."""
        returned = [(mid, self._leased.pop(mid)[0]) for mid in msg_ids if mid in self._leased]
        for mid, _ in returned:
            self._owners.pop(mid, None)
        for mid, item in reversed(returned):
            self._queue.appendleft((mid, item))
            self._queued_ids.add(mid)
        self._stats["redelivered_total"] += len(returned)
        return len(returned)

    def next_lease_deadline(self) -> float | None:
        return min((deadline for _, deadline in self._leased.values()), default=None)

    def drain_unacked(self) -> list[tuple[str, T]]:
        """Everything not yet acknowledged (leased first, then queued), for checkpoints."""
        return [(mid, item) for mid, (item, _) in self._leased.items()] + list(self._queue)

    def stats(self) -> MailboxStats:
        return MailboxStats(
            queued=len(self._queue),
            leased=len(self._leased),
            capacity=self.capacity,
            put_total=self._stats["put_total"],
            duplicates_dropped=self._stats["duplicates_dropped"],
            delivered_total=self._stats["delivered_total"],
            redelivered_total=self._stats["redelivered_total"],
            acked_total=self._stats["acked_total"],
        )

    def _remember_acked(self, msg_id: str) -> None:
        self._acked.add(msg_id)


class Mailbox(Protocol[M]):
    """The interface every mailbox implements. Messages carry their id in `.msg_id`."""

    async def put(self, messages: Sequence[M], timeout: float | None = None) -> int:
        """Enqueue, waiting while full. Returns how many were accepted (duplicates are dropped).
        Raises TimeoutError if `timeout` passes before all are placed (those placed stay placed)."""

    async def get(self, max_n: int, timeout: float | None = None, consumer: str = "") -> list[M]:
        """Lease up to `max_n` messages; waits up to `timeout` s for the first one ([] on timeout).
        `consumer`: who holds the leases (`release` gives them back)."""

    async def ack(self, msg_ids: Iterable[str]) -> int: ...

    async def nack(self, msg_ids: Iterable[str]) -> int: ...

    async def release(self, consumer: str) -> int: ...

    async def stats(self) -> MailboxStats: ...


class _AsyncMailboxBase(Generic[T]):
    """asyncio waiting around a `MailboxCore`; shared by the in-process mailbox and the Ray actor."""

    def __init__(self, capacity: int, lease_s: float = 60.0, dedup_window: int = 100_000):
        self._core: MailboxCore[T] = MailboxCore(capacity, lease_s, dedup_window)
        self._changed = asyncio.Condition()

    async def _put_items(self, items: Sequence[tuple[str, T]], timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        accepted = 0
        async with self._changed:
            for mid, item in items:
                while True:
                    result = self._core.offer(mid, item)
                    if result is not None:
                        accepted += int(result)
                        break
                    await self._wait(deadline, what="put")
            self._changed.notify_all()
        return accepted

    async def _get_items(self, max_n: int, timeout: float | None, consumer: str = "") -> list[tuple[str, T]]:
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        deadline = None if timeout is None else time.monotonic() + timeout
        async with self._changed:
            while True:
                taken = self._core.take(max_n, time.monotonic(), consumer)
                if taken:
                    return taken
                try:
                    await self._wait(deadline, what="get")
                except TimeoutError:
                    return []

    async def _wait(self, deadline: float | None, what: str) -> None:
        """Wait for a change, or until the next lease expires (so redelivery needs no timer task)."""
        now = time.monotonic()
        wake = self._core.next_lease_deadline()
        limit = deadline if wake is None else (wake if deadline is None else min(wake, deadline))
        if deadline is not None and now >= deadline:
            raise TimeoutError(f"mailbox {what} timed out")
        try:
            await asyncio.wait_for(self._changed.wait(), None if limit is None else max(limit - now, 0.0))
        except (asyncio.TimeoutError, TimeoutError):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"mailbox {what} timed out") from None

    async def ack(self, msg_ids: Iterable[str]) -> int:
        async with self._changed:
            n = self._core.ack(list(msg_ids))
            self._changed.notify_all()
            return n

    async def nack(self, msg_ids: Iterable[str]) -> int:
        async with self._changed:
            n = self._core.nack(list(msg_ids))
            self._changed.notify_all()
            return n

    async def release(self, consumer: str) -> int:
        async with self._changed:
            n = self._core.release(consumer)
            self._changed.notify_all()
            return n

    async def stats(self) -> MailboxStats:
        return self._core.stats()

    async def drain_unacked(self) -> list[tuple[str, T]]:
        return self._core.drain_unacked()


class InProcessMailbox(_AsyncMailboxBase[M]):
    """Mailbox of message objects inside one asyncio process."""

    async def put(self, messages: Sequence[M], timeout: float | None = None) -> int:
        return await self._put_items([(m.msg_id, m) for m in messages], timeout)

    async def get(self, max_n: int, timeout: float | None = None, consumer: str = "") -> list[M]:
        return [item for _, item in await self._get_items(max_n, timeout, consumer)]


class MailboxActor(_AsyncMailboxBase[bytes]):
    """Body of the cross-process mailbox: a Ray async actor storing encoded messages (bytes).

    Create with `ray.remote(MailboxActor).options(max_concurrency=...)`, or `RayMailbox.create`.
    """

    async def put(self, items: list[tuple[str, bytes]], timeout: float | None = None) -> int:
        return await self._put_items(items, timeout)

    async def get(self, max_n: int, timeout: float | None = None, consumer: str = "") -> list[tuple[str, bytes]]:
        return await self._get_items(max_n, timeout, consumer)

    def ready(self) -> bool:
        return True

    def pid(self) -> int:
        import os

        return os.getpid()


class RayMailbox(Generic[M]):
    """Client of a `MailboxActor`; picklable, so it can be handed to any actor.

    Messages are msgspec-encoded here, before they leave the process, and decoded on `get`.
    """

    def __init__(self, actor: Any, message_type: type[M]):
        self.actor = actor
        self.message_type = message_type
        self._codec: Codec[M] | None = None

    @classmethod
    def create(
        cls,
        message_type: type[M],
        capacity: int,
        lease_s: float = 60.0,
        name: str | None = None,
        dedup_window: int = 100_000,
        placement: dict | None = None,
    ) -> "RayMailbox[M]":
        """`placement`: Ray options placing the actor (a scheduling strategy)."""
        import ray

        options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1000, **(placement or {})}
        if name is not None:
            options["name"] = name
        actor = ray.remote(MailboxActor).options(**options).remote(capacity, lease_s, dedup_window)
        ray.get(actor.ready.remote())
        return cls(actor, message_type)

    def __reduce__(self):
        return (RayMailbox, (self.actor, self.message_type))

    @property
    def codec(self) -> Codec[M]:
        if self._codec is None:
            self._codec = Codec(self.message_type)
        return self._codec

    async def put(self, messages: Sequence[M], timeout: float | None = None) -> int:
        items = [(m.msg_id, self.codec.encode(m)) for m in messages]
        return await self.actor.put.remote(items, timeout)

    async def get(self, max_n: int, timeout: float | None = None, consumer: str = "") -> list[M]:
        items = await self.actor.get.remote(max_n, timeout, consumer)
        return [self.codec.decode(data) for _, data in items]

    async def ack(self, msg_ids: Iterable[str]) -> int:
        return await self.actor.ack.remote(list(msg_ids))

    async def nack(self, msg_ids: Iterable[str]) -> int:
        return await self.actor.nack.remote(list(msg_ids))

    async def release(self, consumer: str) -> int:
        return await self.actor.release.remote(consumer)

    async def stats(self) -> MailboxStats:
        return await self.actor.stats.remote()

    async def drain_unacked(self) -> list[M]:
        return [self.codec.decode(data) for _, data in await self.actor.drain_unacked.remote()]


class ShardedMailbox(Generic[M]):
    """One logical mailbox over several `RayMailbox` shards (one actor each): a mailbox actor
    handles a few thousand messages a second (`docs/benchmarks.md`), so many generators share the
    load of several. A message goes to the shard of its `key_attr` (a segment's sample id: the
    windows of one sample stay in one shard, in order); `get` takes from whichever shards have
    messages, keeping at most one get outstanding per shard (what a later call harvests: messages
    it leased are never lost, and expire back to their shard if not taken); an ack goes to the
    shard that delivered the message. Same guarantees as one mailbox, per shard."""

    def __init__(self, shards: list[RayMailbox[M]], key_attr: str = "msg_id"):
        if not shards:
            raise ValueError("a sharded mailbox needs at least one shard")
        self.shards = shards
        self.key_attr = key_attr
        self._inflight: dict[int, asyncio.Future] = {}
        self._delivered_by: dict[str, int] = {}  # message id -> the shard it came from (until acked)

    @classmethod
    def create(cls, message_type: type[M], shards: int, capacity: int, lease_s: float = 60.0,
               key_attr: str = "msg_id", placement: dict | None = None) -> "ShardedMailbox[M]":
        per_shard = max(1, -(-capacity // shards))
        return cls([RayMailbox.create(message_type, per_shard, lease_s, placement=placement) for _ in range(shards)],
                   key_attr)

    def __reduce__(self):
        return (ShardedMailbox, (self.shards, self.key_attr))

    @property
    def actors(self) -> list[Any]:
        return [shard.actor for shard in self.shards]

    @property
    def codec(self) -> Codec[M]:
        return self.shards[0].codec

    def shard_of(self, message: M) -> int:
        import zlib

        return zlib.crc32(str(getattr(message, self.key_attr)).encode()) % len(self.shards)

    async def put(self, messages: Sequence[M], timeout: float | None = None) -> int:
        by_shard: dict[int, list[M]] = collections.defaultdict(list)
        for message in messages:
            by_shard[self.shard_of(message)].append(message)
        counts = await asyncio.gather(*(self.shards[i].put(part, timeout) for i, part in by_shard.items()))
        return sum(counts)

    async def get(self, max_n: int, timeout: float | None = None, consumer: str = "") -> list[M]:
        per_shard = max(1, max_n // len(self.shards))
        for i, shard in enumerate(self.shards):
            if i not in self._inflight:
                self._inflight[i] = asyncio.ensure_future(shard.actor.get.remote(per_shard, timeout, consumer))
        if not any(f.done() for f in self._inflight.values()):
            await asyncio.wait(list(self._inflight.values()), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        out = []
        for i, future in list(self._inflight.items()):
            if future.done():
                del self._inflight[i]
                for msg_id, data in future.result():
                    self._delivered_by[msg_id] = i
                    out.append(self.codec.decode(data))
        return out

    async def _route(self, method: str, msg_ids: Iterable[str]) -> int:
        by_shard: dict[int, list[str]] = collections.defaultdict(list)
        for msg_id in msg_ids:
            shard = self._delivered_by.pop(msg_id, None)
            if shard is not None:
                by_shard[shard].append(msg_id)
        counts = await asyncio.gather(*(getattr(self.shards[i], method)(ids) for i, ids in by_shard.items()))
        return sum(counts)

    async def ack(self, msg_ids: Iterable[str]) -> int:
        return await self._route("ack", msg_ids)

    async def nack(self, msg_ids: Iterable[str]) -> int:
        return await self._route("nack", msg_ids)

    async def release(self, consumer: str) -> int:
        return sum(await asyncio.gather(*(shard.release(consumer) for shard in self.shards)))

    async def stats(self) -> MailboxStats:
        return sum_stats(await asyncio.gather(*(shard.stats() for shard in self.shards)))

    async def drain_unacked(self) -> list[M]:
        return [m for part in await asyncio.gather(*(s.drain_unacked() for s in self.shards)) for m in part]


def sum_stats(parts: Sequence[MailboxStats]) -> MailboxStats:
    """Counters of several mailboxes (a sharded one) as one."""
    fields = MailboxStats.__struct_fields__
    return MailboxStats(**{f: sum(getattr(p, f) for p in parts) for f in fields})
