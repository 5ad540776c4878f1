"""The control plane's ceiling, with no model: how many samples a second the parts between the
generators and the learner's optimizer can move, and which part saturates first.

Real: the prompts, segments (1 or N shards) and batches mailboxes, the prompt source (admission
budget, ledger, solve rates), the assembler (GRPO groups) and the reward router calling a real
verifier endpoint. Synthetic, since the question is the plumbing's, not the model's: producers that
take prompts and emit each sample as one finished `Segment` of `tokens` tokens at a set total rate
(instead of generators), and a learner that only does a learner's bookkeeping per batch (take, ack,
report the trained samples to the ledger, announce a version; no optimizer step).

For each offered rate it reports the samples trained per second and every actor's CPU share over
the measuring window (psutil): the busiest one is the first bottleneck.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from asyncrl.bench.common import machine  # noqa: F401  (the JSON's machine block)
from asyncrl.messages.structs import FinishReason, Segment, TrainBatch, float32_array, int32_array

GROUP_SIZE, PROMPTS_PER_STEP = 8, 16


class SyntheticProducer:
    """Takes prompts and emits each of their samples as one finished segment, `rate` a second."""

    def __init__(self, prompts, segments, rate: float, tokens: int, seed: int):
        self.prompts, self.segments, self.rate, self.tokens = prompts, segments, rate, tokens
        self.rng = np.random.default_rng(seed)
        self.emitted = 0
        self.version = 0  # the weights a generator would hold: its tokens' version (the staleness bound)
        self._running = False

    def set_version(self, version: int) -> None:
        self.version = max(self.version, version)

    def segment(self, request, idx: int) -> Segment:
        ids = self.rng.integers(3, 30, self.tokens).astype(np.int32)
        return Segment(prompt_id=request.prompt_id, sample_idx=idx, window=0, group_id=request.prompt_id,
                       group_size=request.group_size, prompt_token_ids=request.prompt_token_ids,
                       prior_response_ids=int32_array([]), prior_versions=int32_array([]), new_token_ids=ids,
                       new_logprobs=float32_array(-self.rng.random(self.tokens)), new_versions=int32_array([self.version] * self.tokens),
                       finished=True, finish_reason=FinishReason.EOS, data_source=request.data_source,
                       ground_truth=request.ground_truth, seed=request.seed + idx)

    async def run(self) -> None:
        self._running = True
        start = time.monotonic()
        while self._running:
            requests = await self.prompts.get(4, timeout=0.2)
            for request in requests:
                await self.segments.put([self.segment(request, i) for i in request.samples])
                self.emitted += len(request.samples)
                await self.prompts.ack([request.prompt_id])
                # Pace to the offered rate.
                ahead = self.emitted / self.rate - (time.monotonic() - start)
                if ahead > 0:
                    await asyncio.sleep(ahead)

    def stop(self) -> None:
        self._running = False

    def pid(self) -> int:
        import os

        return os.getpid()

    def stats(self) -> dict:
        return {"emitted": self.emitted}


class BookkeepingLearner:
    """A learner's per-batch bookkeeping with no model: take a batch, report its samples trained to
    the ledger, acknowledge it, announce the next version."""

    def __init__(self, batches, prompt_source, assembler, producers):
        self.batches, self.prompt_source, self.assembler = batches, prompt_source, assembler
        self.producers = producers  # told each version, as a broadcast would
        self.version = self.trained = 0
        self._running = False

    async def run(self) -> None:
        self._running = True
        while self._running:
            got: list[TrainBatch] = await self.batches.get(1, timeout=0.5)
            for batch in got:
                ids = [s.segment.sample_id for s in batch.rows if s.segment.finished]
                await self.prompt_source.record.remote(ids, "trained", "")
                await self.batches.ack([batch.batch_id])
                self.trained += len(ids)
                self.version += 1
                self.prompt_source.set_versions.remote(self.version, self.version)
                self.assembler.set_versions.remote(self.version, self.version)
                for producer in self.producers:
                    producer.set_version.remote(self.version)

    def stop(self) -> None:
        self._running = False

    def pid(self) -> int:
        import os

        return os.getpid()

    def stats(self) -> dict:
        return {"trained": self.trained, "version": self.version}


def _measure(actors: dict, learner, assembler, seconds: float) -> tuple[int, float, dict[str, float]]:
    """After a warm-up (the first batch through), the samples trained in `seconds` and each actor's
    share of a core meanwhile."""
    import psutil
    import ray

    processes = {name: psutil.Process(ray.get(a.pid.remote())) for name, a in actors.items()}
    deadline = time.monotonic() + 300  # warm up: actors started, the first batch through
    while ray.get(learner.stats.remote())["trained"] == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no batch through the control plane in 300 s: {ray.get(assembler.stats.remote())}")
        time.sleep(0.5)
    time.sleep(min(5.0, seconds / 3))
    before = {name: p.cpu_times() for name, p in processes.items()}
    trained0, start = ray.get(learner.stats.remote())["trained"], time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    trained = ray.get(learner.stats.remote())["trained"] - trained0
    cpu = {}
    for name, p in processes.items():
        after = p.cpu_times()
        cpu[name] = (after.user + after.system - before[name].user - before[name].system) / elapsed
    return trained, elapsed, cpu


def one_rate(rate: float, shards: int, seconds: float, tokens: int, producers: int) -> dict:
    import ray

    from asyncrl.config import compose
    from asyncrl.messages.ray_mailbox import RayMailbox, ShardedMailbox
    from actors.assembler import AssemblerActor
    from actors.prompt_source import PromptSourceActor
    from actors.reward_endpoint import reward_endpoint_actors
    from asyncrl.run.placement import spawn
    from asyncrl.run.status import mailbox_actors
    from asyncrl.messages.structs import PromptRequest

    config = compose(["model=tiny", "task=tiny", "algorithm=grpo", f"algorithm.group_size={GROUP_SIZE}",
                      f"trainer.prompts_per_step={PROMPTS_PER_STEP}", "algorithm.max_staleness_versions=8"])
    prompts = RayMailbox.create(PromptRequest, capacity=512, lease_s=600)
    segments = (ShardedMailbox.create(Segment, shards, 2048, 600, key_attr="sample_id") if shards > 1
                else RayMailbox.create(Segment, capacity=2048, lease_s=600))
    batches = RayMailbox.create(TrainBatch, capacity=4, lease_s=600)
    endpoints = reward_endpoint_actors(config.reward, config.model, config.task.reward)
    prompt_source = spawn(PromptSourceActor, model=config.model, task=config.task, algorithm=config.algorithm,
                          prompts_per_step=PROMPTS_PER_STEP, seed=config.trainer.seed, prompts=prompts)
    assembler = spawn(AssemblerActor, model=config.model, algorithm=config.algorithm, engine=config.engine,
                      reward=config.reward, prompts_per_step=PROMPTS_PER_STEP, segments=segments, batches=batches,
                      endpoints=endpoints, ledger=prompt_source)
    makers = [ray.remote(SyntheticProducer).options(num_cpus=0).remote(prompts, segments, rate / producers, tokens, i)
              for i in range(producers)]
    learner = ray.remote(BookkeepingLearner).options(num_cpus=0).remote(batches, prompt_source, assembler, makers)
    actors = {"prompt_source": prompt_source, "assembler": assembler, "learner_bookkeeping": learner,
              **{f"reward-{n}": a for n, a in endpoints.items()},
              **{f"producer-{i}": p for i, p in enumerate(makers)},
              **{"mailbox-prompts": prompts.actor, "mailbox-batches": batches.actor},
              **{f"mailbox-segments-{i}": a for i, a in enumerate(mailbox_actors(segments))}}
    loops = [a.run.remote() for a in (assembler, learner, prompt_source, *makers)]
    trained, elapsed, cpu = _measure(actors, learner, assembler, seconds)
    ledger = ray.get(prompt_source.ledger.remote())
    for a in (assembler, learner, prompt_source, *makers):
        a.stop.remote()
    ray.wait(loops, num_returns=len(loops), timeout=10)
    for a in actors.values():
        ray.kill(a)
    # The producers as one figure, and the segments mailbox shards as one.
    grouped: dict[str, float] = {}
    for name, share in cpu.items():
        key = "producers" if name.startswith("producer-") else "mailbox-segments" if name.startswith("mailbox-segments") else name
        grouped[key] = grouped.get(key, 0.0) + share
    busiest = max((k for k in grouped if k != "producers"), key=grouped.get)
    return {"offered_samples_per_s": rate, "segment_shards": shards, "tokens_per_segment": tokens,
            "trained_samples_per_s": trained / elapsed, "cpu_share": grouped, "busiest": busiest,
            "busiest_cpu_share": grouped[busiest], "ledger_problems": ledger["problems"]}


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    from asyncrl.config import compose
    from asyncrl.run.placement import init_ray

    init_ray(compose(["model=tiny"]))
    rates = [500, 2000] if quick else [250, 500, 1000, 2000, 4000]
    seconds = 6.0 if quick else 20.0
    out = {"group_size": GROUP_SIZE, "prompts_per_step": PROMPTS_PER_STEP, "rows": []}
    for shards in ([1] if quick else [1, 4]):
        for rate in rates:
            row = one_rate(rate, shards, seconds, tokens=64, producers=4)
            print(row, flush=True)
            out["rows"].append(row)
    return out


def report(result: dict) -> str:
    lines = ["| segment shards | offered samples/s | trained samples/s | busiest part (CPU share of a core) | assembler | prompt source (ledger) | segments mailbox | reward endpoint |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c = r["cpu_share"]
        reward = sum(v for k, v in c.items() if k.startswith("reward-"))
        lines.append(f"| {r['segment_shards']} | {r['offered_samples_per_s']:.0f} | {r['trained_samples_per_s']:.0f} | "
                     f"{r['busiest']} ({r['busiest_cpu_share']:.2f}) | {c.get('assembler', 0):.2f} | "
                     f"{c.get('prompt_source', 0):.2f} | {c.get('mailbox-segments', 0):.2f} | {reward:.2f} |")
    return "\n".join(lines)
