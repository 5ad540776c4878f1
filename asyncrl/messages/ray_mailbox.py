"""Mailboxes across processes: a Ray actor holds the queue (`MailboxActor`, the shared core of
`asyncrl.messages.mailbox` over encoded bytes); `RayMailbox` is its client, picklable, encoding messages with
msgspec before they leave the process; `ShardedMailbox` spreads one mailbox over several actors
for many producers. The guarantees are `asyncrl.messages.mailbox`'s."""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Generic, Iterable, Sequence

from asyncrl.messages.mailbox import AsyncMailboxBase, M, MailboxStats
from asyncrl.messages.structs import Codec


class MailboxActor(AsyncMailboxBase[bytes]):
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
        capacity_bytes: int = 0,
    ) -> "RayMailbox[M]":
        """`placement`: Ray options placing the actor (a scheduling strategy); `capacity_bytes`: a
        bound on the encoded bytes it holds as well as on its messages (0: none)."""
        import ray

        options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1000, **(placement or {})}
        if name is not None:
            options["name"] = name
        actor = ray.remote(MailboxActor).options(**options).remote(capacity, lease_s, dedup_window, capacity_bytes)
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

    async def nack(self, msg_ids: Iterable[str], consumer: str = "") -> int:
        return await self.actor.nack.remote(list(msg_ids), consumer)

    async def renew(self, msg_ids: Iterable[str], consumer: str = "") -> list[str]:
        return await self.actor.renew.remote(list(msg_ids), consumer)

    async def release(self, consumer: str) -> int:
        return await self.actor.release.remote(consumer)

    def release_calls(self, consumer: str) -> list:
        """`release(consumer)` for a caller outside an event loop (the generator pool's thread): the
        calls under way, to wait on as it waits on its other calls."""
        return [self.actor.release.remote(consumer)]

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
               key_attr: str = "msg_id", placement: dict | None = None, capacity_bytes: int = 0) -> "ShardedMailbox[M]":
        per_shard, bytes_per_shard = max(1, -(-capacity // shards)), -(-capacity_bytes // shards)
        return cls([RayMailbox.create(message_type, per_shard, lease_s, placement=placement,
                                      capacity_bytes=bytes_per_shard) for _ in range(shards)], key_attr)

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

    async def _route(self, method: str, msg_ids: Iterable[str], *args) -> int:
        by_shard: dict[int, list[str]] = collections.defaultdict(list)
        for msg_id in msg_ids:
            shard = self._delivered_by.pop(msg_id, None)
            if shard is not None:
                by_shard[shard].append(msg_id)
        counts = await asyncio.gather(*(getattr(self.shards[i], method)(ids, *args) for i, ids in by_shard.items()))
        return sum(counts)

    async def ack(self, msg_ids: Iterable[str]) -> int:
        return await self._route("ack", msg_ids)

    async def nack(self, msg_ids: Iterable[str], consumer: str = "") -> int:
        return await self._route("nack", msg_ids, consumer)

    async def renew(self, msg_ids: Iterable[str], consumer: str = "") -> list[str]:
        by_shard: dict[int, list[str]] = collections.defaultdict(list)
        for msg_id in msg_ids:
            shard = self._delivered_by.get(msg_id)
            if shard is not None:
                by_shard[shard].append(msg_id)
        held = await asyncio.gather(*(self.shards[i].renew(ids, consumer) for i, ids in by_shard.items()))
        return [msg_id for part in held for msg_id in part]

    async def release(self, consumer: str) -> int:
        return sum(await asyncio.gather(*(shard.release(consumer) for shard in self.shards)))

    def release_calls(self, consumer: str) -> list:
        return [call for shard in self.shards for call in shard.release_calls(consumer)]

    async def stats(self) -> MailboxStats:
        return sum_stats(await asyncio.gather(*(shard.stats() for shard in self.shards)))

    async def drain_unacked(self) -> list[M]:
        return [m for part in await asyncio.gather(*(s.drain_unacked() for s in self.shards)) for m in part]


def sum_stats(parts: Sequence[MailboxStats]) -> MailboxStats:
    """Counters of several mailboxes (a sharded one) as one."""
    fields = MailboxStats.__struct_fields__
    return MailboxStats(**{f: sum(getattr(p, f) for p in parts) for f in fields})
