"""Mailbox throughput: segments/s and MB/s through an in-process mailbox (message objects, no
serialisation) and across Ray processes (a producer actor puts into the `MailboxActor`, a consumer
actor gets and acks), with the msgspec codec the system uses against pickle. Paired rounds.
"""

from __future__ import annotations

import asyncio
import pickle
import statistics
import time

from asyncrl.bench.common import make_segment
from asyncrl.messages.mailbox import InProcessMailbox
from asyncrl.messages.ray_mailbox import RayMailbox
from asyncrl.messages.structs import Segment

BATCH = 32  # segments per put/get call, as the generator and assembler batch them


class PickleCodec:
    def encode(self, message) -> bytes:
        return pickle.dumps(message, protocol=5)

    def decode(self, data):
        return pickle.loads(data)


class PickleRayMailbox(RayMailbox):
    """The same mailbox actor and calls, with pickle in place of the msgspec codec."""

    @property
    def codec(self):
        return PickleCodec()

    def __reduce__(self):
        return (PickleRayMailbox, (self.actor, self.message_type))


def _renamed(segment: Segment, i: int) -> Segment:
    import msgspec

    return msgspec.structs.replace(segment, prompt_id=f"p-{i}", group_id=f"p-{i}")  # distinct ids (the mailbox dedups)


async def _in_process(segment: Segment, n: int) -> float:
    box = InProcessMailbox(capacity=4 * BATCH, lease_s=60)
    messages = [_renamed(segment, i) for i in range(n)]

    async def produce():
        for start in range(0, n, BATCH):
            await box.put(messages[start:start + BATCH])

    async def consume():
        got = 0
        while got < n:
            batch = await box.get(BATCH, timeout=10)
            await box.ack([m.msg_id for m in batch])
            got += len(batch)

    start = time.perf_counter()
    await asyncio.gather(produce(), consume())
    return time.perf_counter() - start


class Producer:
    def __init__(self, box, segment: Segment):
        self.box, self.segment = box, segment

    async def produce(self, offset: int, n: int) -> None:
        messages = [_renamed(self.segment, offset + i) for i in range(n)]
        for start in range(0, n, BATCH):
            await self.box.put(messages[start:start + BATCH])


class Consumer:
    def __init__(self, box):
        self.box = box

    async def consume(self, n: int) -> float:
        got, first = 0, None
        while got < n:
            batch = await self.box.get(BATCH, timeout=30)
            if first is None and batch:
                first = time.perf_counter()
            await self.box.ack([m.msg_id for m in batch])
            got += len(batch)
        return time.perf_counter()


def _across_ray(actors: dict, offset: int, n: int) -> float:
    import ray

    start = time.perf_counter()
    done = actors["consumer"].consume.remote(n)
    ray.get(actors["producer"].produce.remote(offset, n))
    ray.get(done)
    return time.perf_counter() - start


def run(quick: bool = False, sizes: dict[int, int] | None = None, rounds: int | None = None) -> dict:
    """`sizes`: segments sent per round for each segment length (new tokens)."""
    import ray

    from asyncrl.config import compose
    from asyncrl.run.placement import init_ray

    init_ray(compose(["model=tiny"]))
    rounds = rounds or (2 if quick else 7)
    sizes = sizes or ({256: 200, 8192: 50} if quick else {256: 2000, 8192: 500})
    results = {}
    for tokens, n in sizes.items():
        segment = make_segment(tokens)
        nbytes = len(pickle.dumps(segment, protocol=5))
        in_proc = [asyncio.run(_in_process(segment, n)) for _ in range(rounds)]
        systems = {}
        for name, cls in (("msgspec", RayMailbox), ("pickle", PickleRayMailbox)):
            box = cls.create(Segment, capacity=4 * BATCH, lease_s=60, dedup_window=10 * n * rounds)
            box = cls(box.actor, Segment)
            opts = {"num_cpus": 0}
            systems[name] = {"box": box,
                             "producer": ray.remote(Producer).options(**opts).remote(box, segment),
                             "consumer": ray.remote(Consumer).options(**opts).remote(box)}
            _across_ray(systems[name], 10**9, BATCH)  # warm up: actors started, codecs built
        times = {"msgspec": [], "pickle": []}
        for r in range(rounds):  # paired: msgspec, pickle, msgspec, ...
            for name in ("msgspec", "pickle"):
                times[name].append(_across_ray(systems[name], r * n, n))
        for parts in systems.values():
            for actor in (parts["producer"], parts["consumer"], parts["box"].actor):
                ray.kill(actor)
        row = {"segments": n, "segment_bytes": nbytes, "rounds": rounds,
               "in_process_segments_per_s": n / statistics.median(in_proc),
               "in_process_MB_per_s": n * nbytes / statistics.median(in_proc) / 1e6}
        for name, ts in times.items():
            row[f"ray_{name}_segments_per_s"] = n / statistics.median(ts)
            row[f"ray_{name}_MB_per_s"] = n * nbytes / statistics.median(ts) / 1e6
        row["ray_ratio_msgspec_over_pickle_median"] = statistics.median(p / m for m, p in zip(times["msgspec"], times["pickle"]))
        results[f"{tokens}_tokens"] = row
        print(tokens, row, flush=True)
    return results


def report(results: dict) -> str:
    lines = ["| segment | in-process seg/s (MB/s) | Ray msgspec seg/s (MB/s) | Ray pickle seg/s (MB/s) | msgspec / pickle |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name.replace('_', ' ')} ({r['segment_bytes']} B) | {r['in_process_segments_per_s']:.0f} "
                     f"({r['in_process_MB_per_s']:.0f}) | {r['ray_msgspec_segments_per_s']:.0f} "
                     f"({r['ray_msgspec_MB_per_s']:.0f}) | {r['ray_pickle_segments_per_s']:.0f} "
                     f"({r['ray_pickle_MB_per_s']:.0f}) | {r['ray_ratio_msgspec_over_pickle_median']:.2f}x |")
    return "\n".join(lines)
