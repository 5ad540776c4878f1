"""The two learners: `policy` (the policy learner) and `critic` (the value learner). Each has three
sub-sections of one shape: `loss`, `optimizer` and `compute` (where and how it computes). The
learners take these sections as they are: a section is the settings object its builder passes.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from asyncrl.config.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Section, UnitFloat
from asyncrl.config.model import Device

AtLeastOne = Annotated[float, msgspec.Meta(ge=1)]
Precision = Literal["auto", "fp32", "bf16"]


class Optimizer(Section):
    """AdamW and its schedule."""

    lr: PositiveFloat = 1e-6
    """Adam's learning rate."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW's weight decay."""
    grad_clip: PositiveFloat = 1.0
    """Gradient norm clip."""
    warmup_steps: NonNegativeInt = 0
    """Linear learning-rate warm-up over this many learner steps (batches trained)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate after the warm-up: constant | linear (down to `min_lr_ratio` x lr at
    `decay_steps`, TRL's default) | cosine (half a cosine down to the same, verl's `cosine`)."""
    min_lr_ratio: UnitFloat = 0.0
    """Where linear and cosine end, as a fraction of lr (held there after `decay_steps`)."""
    decay_steps: NonNegativeInt = 0
    """Learner steps from the start to the end of the decay, warm-up included. 0: the run's
    `trainer.total_steps` for the policy (one policy step per run step); the critic's steps follow
    its own pace, so a decaying critic needs it set."""


class Compute(Section):
    """Where and how a learner computes."""

    device: Device = "cpu"
    """cpu | cuda: where the learner trains."""
    precision: Precision = "auto"
    """auto | fp32 | bf16 (autocast: fp32 master weights and optimizer state, bf16 matmuls; the
    critic's scalar head stays fp32). auto: the rule of `engine.dtype`, measured at start-up on this
    device, not read from CPU flags (`asyncrl/models/precision.py`): bf16 where the model's own linear
    shapes (at 256 rows) run at least 1.25x faster in bf16 than in fp32 and the model has 10M+
    parameters (the tiny one stays fp32); the ranks of a sharded learner decide on their summed
    timings. Logged, and reported in the learner's stats (policy: `precision`, `precision_choice`;
    critic: `value_precision`, `value_precision_choice`)."""
    micro_batch_tokens: PositiveInt = 4096
    """Tokens per forward/backward chunk (gradient accumulation)."""
    threads: PositiveInt = 1
    """torch threads of each learner process."""
    gpus: NonNegativeFloat = 0.0
    """GPUs each process of the learner asks Ray for."""
    resources: dict[str, float] = msgspec.field(default_factory=dict)
    """Custom Ray resources each process of the learner asks for, e.g. {node_learner: 1}."""


class PolicyCompute(Compute):
    """Where and how the policy learner computes: `Compute`, plus sharding and memory savers."""

    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory for long responses, ~30% more compute)."""
    logits_chunk_tokens: NonNegativeInt = 0
    """Project the vocabulary this many trained positions at a time (e.g. 1024) and recompute each
    chunk in the backward instead of keeping the `[tokens, vocab]` logits and softmax of the whole
    micro-batch (0: all at once). Worth it with `gradient_checkpointing` and a large vocabulary: on
    the embedded model -10% peak memory for +8% step time with checkpointing, -1.5% for +11%
    without (docs/benchmarks.md, "Policy learner memory")."""
    ranks: PositiveInt = 1
    """Processes of the policy learner: more than one shards the weights, gradients and Adam's state
    over them (FSDP2; one per GPU of a multi-GPU node, or CPU processes over gloo) and splits each
    batch's micro-batches between them."""
    timeout_s: PositiveFloat = 600.0
    """How long a collective of the policy learner's ranks may take before it fails the run (which
    then restarts from its last checkpoint)."""


class PolicyLoss(Section):
    """The clipped surrogate and the terms summed with it."""

    clip_low: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.2
    """ε_low of the clipped surrogate: the ratio is clipped below at 1 − ε_low."""
    clip_high: NonNegativeFloat = 0.28
    """ε_high (DAPO's clip-higher): the ratio is clipped above at 1 + ε_high."""
    dual_clip: Annotated[float, msgspec.Meta(gt=1)] | None = 10.0
    """Dual-clip constant c (> 1) for negative advantages; None = off."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses aggregate: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    norm_tokens: NonNegativeInt = 0
    """The constant of `seq-mean-token-sum-norm` (Dr.GRPO); 0 = engine.max_response_tokens."""
    entropy_coef: NonNegativeFloat = 0.0
    """Weight of the entropy bonus (0 = none)."""
    proximal_anchor: bool = True
    """With more than one update per batch: clip around the weights before the batch's first update
    (decoupled PPO) and weight tokens by the capped ratio of those to the behaviour policy."""
    behaviour_weight_cap: AtLeastOne = 5.0
    """The cap of the decoupled loss's token weights π_prox/π_behaviour (several updates per batch)."""
    rollout_correction: Literal["none", "token_tis", "sequence_tis", "token_mis", "sequence_mis"] = "none"
    """Rollout-training mismatch (the engine's log-probs are not the learner's: other kernels,
    batch shapes, precision): none | token_tis | sequence_tis | token_mis | sequence_mis. When set,
    the learner recomputes the proximal log-probs every batch, clips around them and weights each
    token (or row) by the truncated (tis) or bounds-masked (mis) ratio to the behaviour log-probs,
    capped at `rollout_is_cap`. The mismatch itself is reported every step either way
    (`rollout_kl_k3`, `rollout_ratio_max`). engine=sglang sets token_tis."""
    rollout_is_cap: AtLeastOne = 2.0
    """The cap of the rollout correction's importance weights."""
    router_aux_coef: NonNegativeFloat = 0.0
    """A mixture-of-experts model's load-balancing loss (Switch Transformer's, over the router's own
    top-k at every real position and sparse layer; `router_balance_loss` in the step records) added
    with this weight; 0 = none, as most RL recipes run (pretraining balanced the experts). Refused
    on a dense model."""


class PolicyConfig(Section):
    """The policy learner (its section, whole): its loss, optimizer and compute, its updates per
    batch, and how its weights reach the generators."""

    loss: PolicyLoss = msgspec.field(default_factory=PolicyLoss)
    """The policy loss."""
    optimizer: Optimizer = msgspec.field(default_factory=Optimizer)
    """AdamW and its schedule."""
    compute: PolicyCompute = msgspec.field(default_factory=PolicyCompute)
    """Where and how it trains."""
    ppo_epochs: PositiveInt = 1
    """Passes over each batch (each pass takes `mini_batches` optimizer updates)."""
    mini_batches: PositiveInt = 1
    """Optimizer updates per pass over a batch (DAPO/VAPO recipes: 16 at 512 prompts x 16)."""
    broadcast_bucket_mb: PositiveInt = 64
    """Bucket size of the distributed weight path."""
    weight_transport: Literal["auto", "shm", "cuda_ipc", "group"] = "auto"
    """How weights reach each generator: auto (shared memory on the learner's node, CUDA IPC on its
    GPU, a torch.distributed group for other nodes) | shm | cuda_ipc | group (forced)."""
    weight_delta: bool = False
    """Full fine-tuning: send each generator only what changed since the version it holds, in the
    generators' dtype (unchanged tensors left out; a tensor with few changed values as their indices
    and values), instead of every weight. The embedded engine needs engine.dtype set (not auto);
    SGLang and vLLM hold the weights in model.dtype, and each generator keeps a copy of the
    version deltas change (vLLM then loads it whole). Off by default: see whether it pays
    (docs/benchmarks.md, "Delta weight updates")."""


class ValueLoss(Section):
    """The critic's targets and its clipped value loss."""

    lam: UnitFloat = 1.0
    """Critic GAE λ of the targets (VC-PPO decoupled GAE: 1.0 = Monte-Carlo returns)."""
    clip_low: NonNegativeFloat | None = 0.5
    """Clipped value loss range below the values the rows were valued with (T-PPO: 0.5 / 0.6); null = plain MSE."""
    clip_high: NonNegativeFloat | None = 0.6
    """Clipped value loss range above those values."""


class CriticWarmup(Section):
    """Value pretraining under the frozen initial policy, before the first policy step (VC-PPO)."""

    steps: NonNegativeInt = 0
    """The most value-only steps (0 = none); the warm-up ends earlier once it stops learning."""
    min_steps: NonNegativeInt = 0
    """The fewest warm-up steps."""
    patience: PositiveInt = 3
    """The warm-up ends when the critic's explained variance (fresh values) has not improved by
    `min_gain` in this many steps (`asyncrl.algo.warmup`)."""
    min_gain: NonNegativeFloat = 0.01
    """The improvement of explained variance that counts as still learning."""


class CriticConfig(Section):
    """The value learner (used with `algorithm.advantage.type=gae`): its own model, loss, optimizer and pace."""

    loss: ValueLoss = msgspec.field(default_factory=ValueLoss)
    """The value loss."""
    optimizer: Optimizer = msgspec.field(default_factory=lambda: Optimizer(lr=2e-6))
    """AdamW and its schedule."""
    compute: Compute = msgspec.field(default_factory=lambda: Compute(micro_batch_tokens=1024))
    """Where and how it trains (the embedded model's value step peaks at ~3.9 GB with 1024 tokens
    per micro-batch, ~6 GB with 4096: 16 trajectories of 164 tokens)."""
    batch_trajectories: PositiveInt = 16
    """Finished trajectories per value step."""
    mix_batches: PositiveInt = 1
    """Value steps whose trajectories are dealt out together: the learner waits for this many
    batches' worth and deals them round-robin across their groups, so that each batch holds every
    prompt present. A group's samples arrive one after the other: with groups of 32, a batch of 16 is
    one prompt's, and the tiny critic learned half as fast (load_tests/critic_learning.py).
    1: batches in arrival order."""
    warmup: CriticWarmup = msgspec.field(default_factory=CriticWarmup)
    """Value pretraining."""
    head_init: Literal["mean_return", "zero"] = "mean_return"
    """mean_return: a fresh critic's head starts at the mean return of its first batch (the initial
    policy's responses) | zero: at 0. A critic from `init_path` keeps its head."""
    init_path: str = ""
    """Initialise from a reward / process-reward model directory (sequence or token classification
    with one label); empty = from the policy, with a zero scalar head."""
