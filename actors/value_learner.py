"""Value learner: owns the value model (critic), trains it on finished trajectories at its own pace,
and answers value requests for (E)GAE (the role, its builder, its Ray shell).

* Trains only on **finished** trajectories (all windows), with targets from the critic λ
  (1.0 = Monte-Carlo), `critic.batch_trajectories` per step, whenever that many have arrived
  (`critic.mix_batches` at a time, dealt across their groups).
* Serves `V(s_t)` from a serving copy refreshed after each step, so a request never waits for a
  training step and never sees half-updated weights; each answer carries the value version.
* Warm-up (VC-PPO value pretraining): until `critic.warmup` ends, `ready` is false
  and the assembler (which asks) trains no policy rows, so the policy stays the frozen initial one.
* With a reference policy (the PPO baseline's KL in the reward), also scores rows' tokens under
  it (`reference_logprobs`): the reward of every token then needs it, as the value does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import os
import time

import msgspec
import numpy as np
import torch

from actors.base import RoleShell, TrainingLoop
from asyncrl.algo.warmup import warmup_finished
from asyncrl.config import AlgorithmConfig, CriticConfig, ModelConfig, SamplingConfig
from asyncrl.learning.rank import learner_precision
from asyncrl.learning.routing import route_shape
from asyncrl.learning.scoring import response_logprobs
from asyncrl.learning.tensors import build_optimizer
from asyncrl.learning.value import ExplainedVarianceWindow, center_value_head, dealt_batches, predict_values, value_step
from asyncrl.messages.mailbox import Mailbox, RecentIds
from asyncrl.messages.structs import ScoredTrajectory
from asyncrl.models.loading import load_model, load_tokenizer, value_model_from_checkpoint, value_model_from_policy
from asyncrl.models.vision import freeze_vision_tower
from asyncrl.storage import checkpoint_parts
from asyncrl.storage.checkpoint_transfer import WriterClient, local_copy, write_part


class ValueLearner(TrainingLoop):
    def __init__(self, value_model, trajectories: Mailbox, critic: CriticConfig, gamma: float = 1.0,
                 pad_token_id: int = 0, reference=None, sampling: SamplingConfig | None = None,
                 center_head: bool = False, router_replay: bool = False):
        """`critic`: its section (`compute.precision` resolved), with the warm-up (no policy row
        trains until it is over); `gamma`: the advantage's discount; `center_head`: start the
        critic's head at the mean return of the first batch (a fresh head, not a trained one);
        `router_replay`: rows' recorded routes replayed on a mixture-of-experts critic and reference."""
        self.model = value_model.eval()
        self.precision_choice: dict = {}  # how `compute.precision` was chosen (`learner_precision`)
        # The frozen initial policy and the distribution the generators sample from (KL in the reward).
        self.reference = None if reference is None else reference.eval().requires_grad_(False)
        self.sampling = sampling or SamplingConfig()
        self.serving = copy.deepcopy(value_model).eval().requires_grad_(False)
        self.trajectories = trajectories
        self.critic, self.gamma = critic, gamma
        # A frozen vision tower is not in the optimizer, as the policy learner's (`PolicyRank`).
        self.optimizer, self.scheduler = build_optimizer([p for p in self.model.parameters() if p.requires_grad],
                                                         critic.optimizer)
        self.batch_trajectories = critic.batch_trajectories
        self.warmup = critic.warmup
        self.center_head = center_head
        self.router_replay = router_replay
        self._explained: list[float] = []  # the fresh-value explained variance of each warm-up step
        self.explained = ExplainedVarianceWindow()  # over the last batches: one batch's figure is noise
        self._warmed_up = critic.warmup.steps == 0
        self.pad_token_id = pad_token_id
        self.version = 0
        self._seen = RecentIds(200_000)
        self._pending: list[ScoredTrajectory] = []
        self._serving_lock = asyncio.Lock()
        self._train_lock = asyncio.Lock()  # a checkpoint waits for a step in progress
        self._metrics: list[dict] = []
        self._running = False
        self._started = time.monotonic()
        self.timing = {"train_s": 0.0, "serve_s": 0.0}
        self.counters = {"value_steps": 0, "trajectories_trained": 0, "duplicate_trajectories": 0,
                         "value_requests": 0, "rows_valued": 0, "rows_referenced": 0, "warmup_steps_taken": 0}
        self.last: dict[str, float] = {}

    @property
    def ready(self) -> bool:
        """The warm-up (value pretraining) is over: it learned what it could, or ran its longest."""
        return self._warmed_up

    async def values(self, rows: list[tuple], images: list[tuple[str, ...]] | None = None
                     ) -> tuple[list[np.ndarray], int]:
        """`V(s_t)` for the new tokens of each (context, new[, routes]) row plus the state after its
        last token (n + 1 values), and the value version used. `images`: each row's prompt images
        by reference (a vision-language model's rows; None: none has any)."""
        start = time.perf_counter()
        async with self._serving_lock:
            version = self.version
            out = await asyncio.to_thread(predict_values, self.serving, rows, self.pad_token_id,
                                          self.critic.compute.micro_batch_tokens, True, self.critic.compute.precision,
                                          self.router_replay, images)
        self.timing["serve_s"] += time.perf_counter() - start
        self.counters["value_requests"] += 1
        self.counters["rows_valued"] += len(rows)
        return out, version

    async def reference_logprobs(self, rows: list[tuple], images: list[tuple[str, ...]] | None = None
                                 ) -> list[np.ndarray]:
        """log π_ref of each (context, new[, routes]) row's new tokens (with its prompt's `images`),
        under the generators' sampling settings."""
        if self.reference is None:
            raise RuntimeError("this value learner holds no reference policy (algorithm.advantage.kl_in_reward is off)")
        p = self.sampling
        start = time.perf_counter()
        out = await asyncio.to_thread(response_logprobs, self.reference, rows, p.temperature, p.top_k, p.top_p,
                                      self.pad_token_id, self.critic.compute.micro_batch_tokens, self.router_replay,
                                      images)
        self.timing["serve_s"] += time.perf_counter() - start
        self.counters["rows_referenced"] += len(rows)
        return out

    async def _train(self, batch: list[ScoredTrajectory]) -> dict:
        start = time.perf_counter()
        async with self._train_lock:
            shift = None
            if self.center_head and self.version == 0:
                shift = await asyncio.to_thread(center_value_head, self.model, batch, self.gamma,
                                                self.pad_token_id, self.critic.compute.micro_batch_tokens,
                                                self.critic.compute.precision, self.router_replay)
            metrics = await asyncio.to_thread(value_step, self.model, self.optimizer, batch, self.critic, self.gamma,
                                              self.pad_token_id, self.router_replay, self.explained)
            self.scheduler.step()
            async with self._serving_lock:
                self.serving.load_state_dict(self.model.state_dict())
                self.version += 1
        if not self._warmed_up:
            self._explained.append(metrics["value_explained_variance"])
            self.counters["warmup_steps_taken"] = len(self._explained)
            w = self.warmup
            self._warmed_up = warmup_finished(self._explained, w.min_steps, w.steps, w.patience, w.min_gain)
        elapsed = time.perf_counter() - start
        self.timing["train_s"] += elapsed
        self.counters["value_steps"] += 1
        self.counters["trajectories_trained"] += len(batch)
        record = {"value_step": self.version, **metrics, "value_train_s": elapsed, "value_ready": self.ready,
                  **({"value_head_shift": shift} if shift is not None else {})}
        self.last = record
        self._metrics.append(record)
        return record

    async def step_once(self, timeout: float = 1.0) -> dict | None:
        got = await self.trajectories.get(self.batch_trajectories, timeout=timeout)
        for t in got:
            if t.msg_id in self._seen:
                self.counters["duplicate_trajectories"] += 1
            else:
                self._seen.add(t.msg_id)
                self._pending.append(t)
        # Held here from now on (a crash before training loses at most this partial batch).
        if got:
            await self.trajectories.ack([t.msg_id for t in got])
        dealt = self.batch_trajectories * self.critic.mix_batches
        if len(self._pending) < dealt:
            return None
        together, self._pending = self._pending[:dealt], self._pending[dealt:]
        batches = [together] if self.critic.mix_batches == 1 else dealt_batches(together, self.batch_trajectories)
        for batch in batches:
            record = await self._train(batch)
        return record

    async def run(self) -> None:
        self._running = True
        self._started = time.monotonic()
        while self._running:
            await self.step_once()

    # --- checkpoints -------------------------------------------------------------------------------

    async def save_checkpoint_part(self, directory: str, writer: WriterClient | None = None) -> None:
        """Write the value model, optimizer and version into the checkpoint being written at
        `directory` (shipped to the run directory's `writer` where this node does not see it). The
        partial batch held here is not saved: its trajectories were regenerated-or-trained policy
        samples already, and the critic simply sees other ones."""
        def save(into: str) -> None:
            checkpoint_parts.save_value_part(into, self.model, self.optimizer, self.version, dict(self.counters))

        async with self._train_lock:  # between steps, the serving copy equals the model
            if writer is None:
                await asyncio.to_thread(save, directory)
            else:
                await asyncio.to_thread(write_part, writer, directory, save)

    def load_checkpoint(self, directory: str) -> None:
        from safetensors.torch import load_file

        part = os.path.join(directory, "value")
        state = load_file(os.path.join(part, "model.safetensors"))
        self.model.load_state_dict(state)
        self.serving.load_state_dict(state)
        self.optimizer.load_state_dict(checkpoint_parts.load_tensors(os.path.join(part, "optimizer.pt"))["optimizer"])
        meta = checkpoint_parts.load_json(os.path.join(part, "state.json"))
        self.version = int(meta["version"])
        for _ in range(self.version):  # the learning-rate schedule steps once per value step
            self.scheduler.step()
        self.counters.update({k: v for k, v in meta["counters"].items() if k in self.counters})
        # A resumed critic was warmed up if it took its warm-up steps (or more) before the checkpoint.
        self._warmed_up = self._warmed_up or self.version > self.counters["warmup_steps_taken"] or \
            self.version >= self.warmup.steps

    def stats(self) -> dict:
        wall = max(time.monotonic() - self._started, 1e-9)
        return {"value_version": self.version, "value_ready": self.ready, "pending_trajectories": len(self._pending),
                **self.counters, **{f"value_{k}": v for k, v in self.timing.items()},
                "value_busy_fraction": self.timing["train_s"] / wall, "last": self.last,
                "value_precision": self.critic.compute.precision,  # precision=auto, as resolved
                "value_precision_choice": self.precision_choice}


def build_value_learner(model: ModelConfig, critic: CriticConfig, algorithm: AlgorithmConfig, sampling: SamplingConfig,
                        seed: int, trajectories: Mailbox) -> ValueLearner:
    """`algorithm`: the advantage's γ, and whether the KL to the reference is a reward (then this
    learner holds the reference policy and scores tokens under the `sampling` distribution)."""
    torch.manual_seed(seed + 1)
    tokenizer = load_tokenizer(model)
    if critic.init_path:
        value_model = value_model_from_checkpoint(critic.init_path, model, tokenizer)
    else:
        value_model = value_model_from_policy(load_model(model, tokenizer))
    if value_model.vision is not None and model.freeze_vision_tower:  # as the policy learner's (`build_policy_rank`)
        freeze_vision_tower(value_model.backbone)
    precision = learner_precision(critic.compute.precision, value_model, critic.compute.device, "value learner")
    compute = msgspec.structs.replace(critic.compute, precision=precision.name)
    reference = load_model(model, tokenizer).to(critic.compute.device) if algorithm.advantage.kl_in_reward else None
    learner = ValueLearner(value_model.to(critic.compute.device), trajectories,
                           msgspec.structs.replace(critic, compute=compute), algorithm.advantage.gamma,
                           tokenizer.pad_token_id or 0, reference=reference, sampling=sampling,
                           center_head=critic.head_init == "mean_return" and not critic.init_path,
                           # The rows' routes are the policy's: a critic of the policy's own trunk takes them.
                           router_replay=model.router_replay != "off" and not critic.init_path
                           and route_shape(value_model) is not None)
    learner.precision_choice = precision.summary()
    return learner


class ValueLearnerActor(RoleShell):
    def __init__(self, model: ModelConfig, critic: CriticConfig, algorithm: AlgorithmConfig, sampling: SamplingConfig,
                 seed: int, trajectories: Mailbox, resume_from: str | None = None,
                 checkpoint_writer: WriterClient | None = None):
        """`resume_from`: a checkpoint's path on the run directory's node, read through its writer."""
        torch.set_num_threads(critic.compute.threads)
        self.inner = build_value_learner(model, critic, algorithm, sampling, seed, trajectories)
        if resume_from:
            # An async actor's constructor runs on its event loop; the copy may wait on the writer,
            # so it runs in a thread (the actor serves nothing before its constructor returns).
            with concurrent.futures.ThreadPoolExecutor(1) as thread:
                thread.submit(self._resume, resume_from, checkpoint_writer).result()

    def _resume(self, resume_from: str, checkpoint_writer: WriterClient | None) -> None:
        with local_copy(checkpoint_writer, resume_from, [checkpoint_parts.VALUE_PART]) as local:
            self.inner.load_checkpoint(local)

    async def save_checkpoint_part(self, directory: str, writer: WriterClient | None = None) -> None:
        await self.inner.save_checkpoint_part(directory, writer)

    async def values(self, rows, images=None):
        return await self.inner.values(rows, images)

    async def reference_logprobs(self, rows, images=None):
        return await self.inner.reference_logprobs(rows, images)

    def ready(self) -> bool:
        """The warm-up (value pretraining) is over: the assembler may train policy rows."""
        return self.inner.ready

    def pop_metrics(self) -> list[dict]:
        return self.inner.pop_metrics()
