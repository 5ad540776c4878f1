"""The algorithm and its two learners: `algorithm` (how samples become training rows: advantages,
filters, shaping; the knobs several roles share), `policy` (the policy learner: loss, optimizer,
where and how it trains) and `critic` (the value learner). Formulas and the papers' defaults:
docs/algorithms.md."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AlgorithmConfig:
    """How finished samples become training rows (the assembler's section), and what the prompt
    source, the assembler and the learners must agree on (group size, staleness, KL, NLL)."""

    name: str = "dapo"
    """The recipe's name: one of configs/algorithm/ (informational; the fields below decide)."""
    estimator: str = "grpo"
    """The advantage estimator, a key of `asyncrl.algo.advantages.ADVANTAGES`: grpo (group-
    normalised outcome) | drgrpo (group mean only, Dr.GRPO) | pairwise (mean win probability from
    a pairwise judge) | gae (PPO family: (E)GAE over a value learner's values)."""
    group_size: int = 8
    """G: samples per prompt."""
    max_staleness_versions: int = 4
    """No token more than this many versions behind the weights being trained is trained: the learner
    masks such tokens out of the loss at its step (the assembler already does when a batch leaves)."""
    dynamic_sampling: bool = True
    """DAPO: drop groups whose filter metric is all equal (no gradient) and count them."""
    filter_metric: str = "acc"
    """Dynamic sampling's metric: acc (correctness; a reward without a correctness flag, such as a
    Bradley-Terry model, falls back to its score) | score (the raw score)."""
    max_refill_rounds: int = 0
    """Bounded refill (verl's max_num_gen_batches): after this many generation rounds
    (prompts_per_step groups each) without a full batch of groups with signal, the learner trains on
    the groups that have signal, or, with none, skips the step with the reason. 0 = no bound."""
    overlong_buffer_tokens: int = 0
    """DAPO soft overlong punishment buffer L_cache (0 = off); L_max = engine.max_response_tokens."""
    overlong_penalty_factor: float = 1.0
    """The overlong penalty at L_max (it ramps linearly over the buffer)."""
    gamma: float = 1.0
    """Discount γ of (E)GAE and the critic's returns."""
    lam: float = 0.95
    """Policy GAE λ (used when length-adaptive λ is off; the floor of the T-PPO clamp)."""
    length_adaptive_alpha: float = 0.0
    """VAPO length-adaptive λ = 1 − 1/(α·l); 0 = off (use `lam`). Paper: 0.05."""
    lambda_floor: bool = False
    """How length-adaptive λ is clamped: True = max(λ, `lam`) (T-PPO recipe), False = into [0, 1] (NeMo-RL)."""
    window_training: bool = False
    """T-PPO: train the policy on every window as it streams (EGAE), not only on finished responses."""
    egae_bootstrap: str = "previous"
    """Value of the state after a cut window: previous = V(s_{l-1}) (T-PPO's EGAE) | next = the value
    model's V(s_l), which a streaming system has at no extra cost (the window's last token is known)."""
    edge_mask_tokens: int = 0
    """T-PPO: the last N tokens of an unfinished window carry no policy loss (recipe: 8)."""
    whiten_advantages: bool = False
    """Whiten advantages over the stream's recent trained tokens (PPO/T-PPO), then clamp to
    ±advantage_clamp."""
    advantage_clamp: float = 0.0
    """Clamp advantages to ±this after whitening (0 = no clamp)."""
    pairwise_endpoint: str = "genrm"
    """pairwise: the genrm endpoint that judges pairs (both orders, averaged)."""
    pairwise_anchor: str = "group"
    """pairwise: group (every other response of the group) | reference (the ground-truth answer)."""
    kl_coef: float = 0.0
    """Weight β of the KL to the reference (initial) policy: a loss term, or with `kl_in_reward` a
    per-token reward penalty; 0 = no reference model."""
    kl_estimator: str = "low_var_kl"
    """k1 | k2 | low_var_kl (k3, Schulman's unbiased low-variance estimator; GRPO's)."""
    kl_in_reward: bool = False
    """PPO baseline (docs/algorithms.md §1, verl `use_kl_in_reward`): put `−kl_coef·KL_t` into each
    token's reward before GAE (and into the critic's return) instead of a KL loss term. The value
    learner holds the reference policy and scores each row's tokens. Needs estimator=gae."""
    nll_coef: float = 0.0
    """VAPO positive-example LM loss weight μ on the tokens of correct finished responses (paper: 0.1)."""
    importance_clip: float = 0.2
    """DQO: importance weights π_θ/π_behaviour of offline tokens are clipped to [1 − c, 1 + c]."""


@dataclass
class PolicyConfig:
    """The policy learner (its section, whole): its loss and optimizer, and where and how it trains."""

    lr: float = 1e-6
    """Adam's learning rate."""
    weight_decay: float = 0.0
    """AdamW's weight decay."""
    grad_clip: float = 1.0
    """Gradient norm clip."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer updates."""
    clip_low: float = 0.2
    """ε_low of the clipped surrogate: the ratio is clipped below at 1 − ε_low."""
    clip_high: float = 0.28
    """ε_high (DAPO's clip-higher): the ratio is clipped above at 1 + ε_high."""
    dual_clip: float | None = 10.0
    """Dual-clip constant c (> 1) for negative advantages; None = off."""
    loss_agg: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    loss_norm_tokens: int = 0
    """The constant of `seq-mean-token-sum-norm` (Dr.GRPO); 0 = engine.max_response_tokens."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (0 = none)."""
    ppo_epochs: int = 1
    """Passes over each batch (each pass takes `mini_batches` optimizer updates)."""
    mini_batches: int = 1
    """Optimizer updates per pass over a batch (DAPO/VAPO recipes: 16 at 512 prompts x 16)."""
    proximal_anchor: bool = True
    """With more than one update per batch: clip around the weights before the batch's first update
    (decoupled PPO) and weight tokens by the capped ratio of those to the behaviour policy."""
    behaviour_weight_cap: float = 5.0
    """The cap of the decoupled loss's token weights π_prox/π_behaviour (several updates per batch)."""
    rollout_correction: str = "none"
    """Rollout-training mismatch (the engine's log-probs are not the learner's: other kernels,
    batch shapes, precision): none | token_tis | sequence_tis | token_mis | sequence_mis. When set,
    the learner recomputes the proximal log-probs every batch, clips around them and weights each
    token (or row) by the truncated (tis) or bounds-masked (mis) ratio to the behaviour log-probs,
    capped at `rollout_is_cap`. The mismatch itself is reported every step either way
    (`rollout_kl_k3`, `rollout_ratio_max`). engine=sglang sets token_tis."""
    rollout_is_cap: float = 2.0
    """The cap of the rollout correction's importance weights."""
    micro_batch_tokens: int = 4096
    """Tokens per forward/backward chunk (gradient accumulation)."""
    device: str = "cpu"
    """cpu | cuda: where the policy learner trains."""
    precision: str = "auto"
    """auto | fp32 | bf16 (autocast: fp32 master weights and optimizer state, bf16 matmuls). auto:
    the rule of `engine.dtype`, measured at start-up on this device, not read from CPU flags: bf16
    where the model's own linear shapes (at 256 rows) run at least 1.25x faster in bf16 than in
    fp32 and the model has 10M+ parameters (the tiny one stays fp32); the ranks of a sharded
    learner decide on their summed timings. Logged, and reported in the learner's stats
    (`precision`, `precision_choice`)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory for long responses, ~30% more compute)."""
    logits_chunk_tokens: int = 0
    """Project the vocabulary this many trained positions at a time (e.g. 1024) and recompute each
    chunk in the backward instead of keeping the `[tokens, vocab]` logits and softmax of the whole
    micro-batch (0: all at once). Worth it with `gradient_checkpointing` and a large vocabulary: on
    the embedded model -10% peak memory for +8% step time with checkpointing, -1.5% for +11%
    without (docs/benchmarks.md, "Policy learner memory")."""
    threads: int = 1
    """torch threads of each learner process."""
    gpus: float = 0.0
    """GPUs each rank of the policy learner asks Ray for."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each rank asks for, e.g. {node_learner: 1}."""
    ranks: int = 1
    """Processes of the policy learner: more than one shards the weights, gradients and Adam's state
    over them (FSDP2; one per GPU of a multi-GPU node, or CPU processes over gloo) and splits each
    batch's micro-batches between them."""
    timeout_s: float = 600.0
    """How long a collective of the policy learner's ranks may take before it fails the run (which
    then restarts from its last checkpoint)."""
    broadcast_bucket_mb: int = 64
    """Bucket size of the distributed weight path."""
    weight_transport: str = "auto"
    """How weights reach each generator: auto (shared memory on the learner's node, CUDA IPC on its
    GPU, a torch.distributed group for other nodes) | shm | cuda_ipc | group (forced)."""


@dataclass
class CriticConfig:
    """The value learner (used when `algorithm.estimator=gae`): its own model, optimizer and pace."""

    lr: float = 2e-6
    """Adam's learning rate."""
    weight_decay: float = 0.0
    """AdamW's weight decay."""
    grad_clip: float = 1.0
    """Gradient norm clip."""
    lam: float = 1.0
    """Critic GAE λ (VC-PPO decoupled GAE: 1.0 = Monte-Carlo targets)."""
    clip_low: float | None = 0.5
    """Clipped value loss range below the values the rows were valued with (T-PPO: 0.5 / 0.6); null = plain MSE."""
    clip_high: float | None = 0.6
    """Clipped value loss range above those values."""
    batch_trajectories: int = 16
    """Finished trajectories per value step."""
    warmup_steps: int = 0
    """The most value-only steps under the frozen initial policy before the first policy step (VC-PPO
    pretraining; 0 = none); the warm-up ends earlier once it stops learning (`warmup_patience`)."""
    warmup_min_steps: int = 0
    """The fewest warm-up steps."""
    warmup_patience: int = 3
    """The warm-up ends when the critic's explained variance (fresh values) has not improved by
    `warmup_min_gain` in this many steps (`asyncrl.algo.warmup`)."""
    warmup_min_gain: float = 0.01
    """The improvement of explained variance that counts as still learning."""
    head_init: str = "mean_return"
    """mean_return: a fresh critic's head starts at the mean return of its first batch (the initial
    policy's responses) | zero: at 0. A critic from `init_path` keeps its head."""
    init_path: str = ""
    """Initialise from a reward / process-reward model directory (sequence or token classification
    with one label); empty = from the policy, with a zero scalar head."""
    micro_batch_tokens: int = 1024
    """Tokens per forward/backward chunk (the embedded model's value step peaks at ~3.9 GB with 1024,
    ~6 GB with 4096: measured with 16 trajectories of 164 tokens)."""
    threads: int = 1
    """torch threads of the value learner's process."""
    device: str = "cpu"
    """cpu | cuda: where the value learner trains."""
    precision: str = "auto"
    """auto | fp32 | bf16 (autocast, fp32 master weights, the scalar head in fp32): the value
    learner's forward passes, for values served and for its steps. auto: the rule of
    `policy.precision`, measured at start-up on this device (bf16 where the model's own linear
    shapes run at least 1.25x faster in it and the model has 10M+ parameters; the tiny one stays
    fp32), reported in its stats (`value_precision`, `value_precision_choice`)."""
    gpus: float = 0.0
    """GPUs the value learner asks Ray for."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources the value learner asks for, e.g. {node_learner: 1}."""
