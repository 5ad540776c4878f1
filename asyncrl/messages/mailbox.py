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
* **Renewal.** A consumer still working on a message renews its lease (`renew`), so work that
  takes longer than `lease_s` (a long chain of thought, a slow tool) is not delivered to a second
  consumer while the first goes on. A lease that expired meanwhile is taken back if no one else took
  the message; one another consumer took is lost to the renewer (it is not in the answer).

Implementations behind one interface (`Mailbox`): `InProcessMailbox` (asyncio, one process) here;
across processes `asyncrl.messages.ray_mailbox`: `RayMailbox` (a client of a `MailboxActor`; messages cross
the process boundary as msgspec bytes, never pickled user objects) and `ShardedMailbox` (several
`RayMailbox` shards as one, for many producers).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Callable, Generic, Iterable, Protocol, Sequence, TypeVar

import msgspec

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
    renewed_total: int = 0
    bytes: int = 0  # of the messages held (queued and leased), where they are encoded bytes
    bytes_peak: int = 0  # the most it has held
    capacity_bytes: int = 0  # 0: no bound on bytes


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


def _size(item) -> int:
    """A message's bytes where it is held encoded (across processes); 0 for an object in process."""
    return len(item) if isinstance(item, (bytes, bytearray, memoryview)) else 0


class MailboxCore(Generic[T]):
    """The mailbox state machine; synchronous and clock-injected so it is testable alone."""

    def __init__(self, capacity: int, lease_s: float, dedup_window: int = 100_000, capacity_bytes: int = 0):
        """`capacity_bytes`: a bound on the bytes held as well as the messages (0: none); a message
        larger than it alone is accepted into an empty mailbox, so nothing waits for ever."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self._bytes = 0
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
        """Enqueue. Returns True if accepted, False if a duplicate (dropped), None if full (of
        messages, or of bytes: this one would pass `capacity_bytes` and others are held)."""
        if self.is_duplicate(msg_id):
            self._stats["duplicates_dropped"] += 1
            return False
        size = _size(item)
        if self.full or (self.capacity_bytes and len(self) and self._bytes + size > self.capacity_bytes):
            return None
        self._bytes += size
        self._stats["bytes_peak"] = max(self._stats["bytes_peak"], self._bytes)
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

    def renew(self, msg_ids: Iterable[str], now: float, consumer: str = "") -> list[str]:
        """Extend the leases `consumer` holds on `msg_ids` to `now + lease_s`. A message whose lease
        expired and that waits in the queue again is leased back to `consumer`. Returns the ids it
        holds now; the others (acknowledged, or leased by another consumer) are not its to renew."""
        held = []
        taken_back = set()
        for mid in msg_ids:
            if mid in self._leased:
                if self._owners.get(mid, "") != consumer:
                    continue
                item = self._leased[mid][0]
            elif mid in self._queued_ids:
                taken_back.add(mid)
                continue
            else:
                continue
            self._leased[mid] = (item, now + self.lease_s)
            held.append(mid)
        if taken_back:
            back = [(mid, item) for mid, item in self._queue if mid in taken_back]
            self._queue = collections.deque((mid, item) for mid, item in self._queue if mid not in taken_back)
            for mid, item in back:
                self._queued_ids.discard(mid)
                self._leased[mid] = (item, now + self.lease_s)
                if consumer:
                    self._owners[mid] = consumer
                held.append(mid)
        self._stats["renewed_total"] += len(held)
        return held

    def ack(self, msg_ids: Iterable[str]) -> int:
        """Acknowledge leased messages; unknown ids (already acked, expired-and-requeued) are ignored
        except that a queued message acknowledged late is removed from the queue: the consumer that
        held the expired lease did finish it."""
        n = 0
        for mid in msg_ids:
            self._owners.pop(mid, None)
            if mid in self._leased:
                self._bytes -= _size(self._leased.pop(mid)[0])
            elif mid in self._queued_ids:
                self._queued_ids.discard(mid)
                self._bytes -= sum(_size(it) for m, it in self._queue if m == mid)
                self._queue = collections.deque((m, it) for m, it in self._queue if m != mid)
            else:
                continue
            self._remember_acked(mid)
            n += 1
        self._stats["acked_total"] += n
        return n

    def nack(self, msg_ids: Iterable[str], consumer: str = "") -> int:
        """Give leased messages back at once (the consumer could not process them). With `consumer`,
        only those it holds: a lease it lost to another consumer is not its to give back."""
        returned = [(mid, self._leased.pop(mid)[0]) for mid in msg_ids
                    if mid in self._leased and (not consumer or self._owners.get(mid, "") == consumer)]
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
            renewed_total=self._stats["renewed_total"],
            bytes=self._bytes,
            bytes_peak=self._stats["bytes_peak"],
            capacity_bytes=self.capacity_bytes,
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

    async def nack(self, msg_ids: Iterable[str], consumer: str = "") -> int: ...

    async def renew(self, msg_ids: Iterable[str], consumer: str = "") -> list[str]:
        """Extend `consumer`'s leases on `msg_ids` (`MailboxCore.renew`); the ids it holds now."""

    async def release(self, consumer: str) -> int: ...

    async def drain_unacked(self) -> list[M]:
        """Every message not yet acknowledged, leased or queued (the learner's checkpoint keeps them)."""

    async def stats(self) -> MailboxStats: ...


class AsyncMailboxBase(Generic[T]):
    """asyncio waiting around a `MailboxCore`; shared by the in-process mailbox and the Ray actor."""

    def __init__(self, capacity: int, lease_s: float = 60.0, dedup_window: int = 100_000, capacity_bytes: int = 0):
        self._core: MailboxCore[T] = MailboxCore(capacity, lease_s, dedup_window, capacity_bytes)
        self._changed = asyncio.Condition()

    async def _put_items(self, items: Sequence[tuple[str, T]], timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        accepted = 0
        placed = False  # since this put last told the others
        async with self._changed:
            for mid, item in items:
                while True:
                    result = self._core.offer(mid, item)
                    if result is not None:
                        accepted += int(result)
                        placed = True
                        break
                    # Full: the items placed so far are visible to the waiting getters first. Only
                    # news is told: putters woken by a putter that placed nothing told each other
                    # again, a loop between two waiting producers.
                    if placed:
                        self._changed.notify_all()
                        placed = False
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
        """Wait for a change; a getter also until the next lease expires (so redelivery needs no
        timer task). A putter waits for changes only: an expired lease frees no room (the message
        goes back to the queue), and a wake-up at a deadline already past, which nothing but a take
        expires, was a loop that held the mailbox's event loop (a run stalled with a short lease)."""
        now = time.monotonic()
        wake = self._core.next_lease_deadline() if what == "get" else None
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

    async def nack(self, msg_ids: Iterable[str], consumer: str = "") -> int:
        async with self._changed:
            n = self._core.nack(list(msg_ids), consumer)
            self._changed.notify_all()
            return n

    async def renew(self, msg_ids: Iterable[str], consumer: str = "") -> list[str]:
        async with self._changed:
            return self._core.renew(list(msg_ids), time.monotonic(), consumer)

    async def release(self, consumer: str) -> int:
        async with self._changed:
            n = self._core.release(consumer)
            self._changed.notify_all()
            return n

    async def stats(self) -> MailboxStats:
        return self._core.stats()

    async def drain_unacked(self) -> list[tuple[str, T]]:
        return self._core.drain_unacked()


class InProcessMailbox(AsyncMailboxBase[M]):
    """Mailbox of message objects inside one asyncio process."""

    async def put(self, messages: Sequence[M], timeout: float | None = None) -> int:
        return await self._put_items([(m.msg_id, m) for m in messages], timeout)

    async def get(self, max_n: int, timeout: float | None = None, consumer: str = "") -> list[M]:
        return [item for _, item in await self._get_items(max_n, timeout, consumer)]

    async def drain_unacked(self) -> list[M]:
        return [item for _, item in await super().drain_unacked()]


async def keep_leases(mailbox: Mailbox, held: Callable[[], list[str]], consumer: str, every_s: float,
                      counters: dict) -> None:
    """Renew, every `every_s` until cancelled, the leases `consumer` holds on the ids `held()`
    returns (work that outlives a lease); counts `leases_renewed` and `leases_lost` (taken by
    another consumer meanwhile) in `counters`."""
    while True:
        await asyncio.sleep(every_s)
        ids = held()
        if ids:
            renewed = await mailbox.renew(ids, consumer=consumer)
            counters["leases_renewed"] += len(renewed)
            counters["leases_lost"] += len(set(ids) - set(renewed))
