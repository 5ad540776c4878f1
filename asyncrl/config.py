"""Typed configuration: dataclasses (the schema) mirrored by the Hydra YAML files in `configs/`.

`compose(overrides)` composes `configs/config.yaml` with dotted overrides (the same call serves the
CLI, `serve run` and tests), merges it into the dataclass schema so unknown or mistyped fields fail
at start-up naming the field, and returns a plain `Config` instance. Actors receive only their own
sub-config.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf, open_dict


@dataclass
class ModelConfig:
    source: str = "gguf"
    """tiny (random, built in-process) | gguf (embedded SmolLM2-135M-Instruct) | hf (local dir)."""
    name: str = "smollm2-135m"
    """Name reported by the policy endpoint's /v1/models."""
    path: str = ""
    """Local directory for source=hf (or a GGUF directory; empty = the embedded wheel)."""
    gguf_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    hidden_size: int = 64
    """tiny only: width, depth and heads of the random Llama."""
    num_layers: int = 2
    num_heads: int = 4
    max_positions: int = 512
    seed: int = 0
    """tiny only: initialisation seed."""
    dtype: str = "float32"
    use_chat_template: bool = True
    """Wrap task prompts in the tokenizer's chat template (instruct models)."""


@dataclass
class EngineConfig:
    name: str = "torch"
    """The generators' inference engine: torch (the embedded one, CPU or CUDA) | sglang (SGLang's
    offline engine, CUDA or CPU, in .venv-sglang: `make sglang`; presets engine=sglang, sglang_cpu)."""
    device: str = "cpu"
    """cpu | cuda: where the generators' engine runs."""
    sglang_mem_fraction: float = 0.5
    """sglang: the share of the device's memory for weights and KV cache (mem_fraction_static): of
    the GPU's (leave room for a learner on the same GPU), on CPU of the RAM free at start-up."""
    sglang_tp_size: int = 1
    sglang_max_total_tokens: int = 0
    """sglang: KV cache capacity in tokens (max_total_tokens); 0 = SGLang sizes it from
    `sglang_mem_fraction` (a GPU). On CPU the KV cache is ordinary RAM: a cap is required
    (engine=sglang_cpu: 8192 tokens)."""
    sglang_max_running_requests: int = 0
    """sglang: requests decoded at once (max_running_requests; 0 = SGLang's, from the KV capacity)."""
    sglang_chunked_prefill_tokens: int = 0
    """sglang: prefill in chunks of this many tokens (chunked_prefill_size; 0 = SGLang's default),
    which bounds a long prompt's activation memory."""
    window_tokens: int = 64
    """W: new tokens per sequence per generator turn. A sequence cut at W continues next turn."""
    max_response_tokens: int = 128
    """Total response budget; a response reaching it finishes with reason max_length."""
    max_windows: int = 0
    """K: at most this many windows per response (0 = ceil(max_response_tokens / W))."""
    max_inflight_sequences: int = 16
    """Sequences a generator advances per window (its batch); continuations come first."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    first_token_temperature: float | None = None
    """FIRE: hot temperature for the first response token (None = off)."""
    first_token_top_k: int = 20
    threads: int = 1
    """torch threads of each generator process."""
    long_tail_fraction: float = 0.0
    """Benchmark workload: this fraction of samples (chosen by seed) may not end before
    `long_tail_tokens`, like chains of thought that run long (0 = off; EOS is held back as
    SGLang's `min_new_tokens` does)."""
    long_tail_tokens: int = 0


@dataclass
class AlgorithmConfig:
    name: str = "dapo"
    """grpo | dapo (critic-free) | ppo | vcppo | vapo | tppo | tppo_sync (value-based)."""
    group_size: int = 8
    """G: samples per prompt."""
    scale_advantage_by_std: bool = True
    """GRPO: divide by the group std (False = Dr.GRPO)."""
    dynamic_sampling: bool = True
    """DAPO: drop groups whose filter metric is all equal (no gradient) and count them."""
    filter_metric: str = "acc"
    """Dynamic sampling's metric: acc (correctness; a reward without a correctness flag, such as a
    Bradley-Terry model, falls back to its score) | score (the raw score)."""
    max_refill_rounds: int = 0
    """Bounded refill (verl's max_num_gen_batches): after this many generation rounds
    (prompts_per_step groups each) without a full batch of groups with signal, the learner trains on
    the groups that have signal, or, with none, skips the step with the reason. 0 = no bound."""
    retire_after_groups: int = 0
    """Prompt retirement: a prompt whose last N groups all had no signal (all correct; with
    `retire_unsolved` also all wrong) is skipped for `retire_epochs` epochs, then tried again
    (counted and shown; `asyncrl train` stops once every prompt is retired). 0 = off."""
    retire_epochs: int = 1
    """How long a retired prompt sits out: until this many datasets' worth of other prompts were issued."""
    retire_unsolved: bool = True
    retest_every_s: float = 30.0
    """When every prompt is retired (a service that keeps running), the prompt retired longest is
    tried again this often: a swapped reward or a changed policy can bring prompts back."""
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 10.0
    """Dual-clip constant c (> 1) for negative advantages; None = off."""
    loss_agg: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    kl_coef: float = 0.0
    """Weight β of the KL to the reference (initial) policy: a loss term, or with `kl_in_reward` a
    per-token reward penalty; 0 = no reference model."""
    kl_estimator: str = "low_var_kl"
    """k1 | k2 | low_var_kl (k3, Schulman's unbiased low-variance estimator; GRPO's)."""
    kl_in_reward: bool = False
    """PPO baseline (ALGORITHMS.md §1, verl `use_kl_in_reward`): put `−kl_coef·KL_t` into each
    token's reward before GAE (and into the critic's return) instead of a KL loss term. The value
    learner holds the reference policy and scores each row's tokens. Needs estimator=gae."""
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
    loss_norm_tokens: int = 0
    """The constant of `seq-mean-token-sum-norm` (Dr.GRPO); 0 = engine.max_response_tokens."""
    entropy_coef: float = 0.0
    overlong_buffer_tokens: int = 0
    """DAPO soft overlong punishment buffer L_cache (0 = off); L_max = engine.max_response_tokens."""
    overlong_penalty_factor: float = 1.0
    max_staleness_versions: int = 4
    """No token more than this many versions behind the weights being trained is trained: the learner
    masks such tokens out of the loss at its step (the assembler already does when a group closes)."""
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    micro_batch_tokens: int = 4096
    """Tokens per forward/backward chunk on the learner (gradient accumulation)."""
    # --- advantage estimation ---
    estimator: str = "group"
    """group (GRPO/DAPO: group-normalised outcome, no critic) | gae (PPO family: a value learner) |
    pairwise (Pairwise PPO: mean win probability against the group, from a pairwise judge)."""
    pairwise_endpoint: str = "genrm"
    """pairwise: the genrm endpoint that judges pairs (both orders, averaged)."""
    pairwise_anchor: str = "group"
    """pairwise: group (every other response of the group) | reference (the ground-truth answer)."""
    gamma: float = 1.0
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
    """Whiten advantages over the batch's trained tokens (PPO/T-PPO), then clamp to ±advantage_clamp."""
    advantage_clamp: float = 0.0
    """0 = no clamp."""
    nll_coef: float = 0.0
    """VAPO positive-example LM loss weight μ on the tokens of correct finished responses (paper: 0.1)."""
    importance_clip: float = 0.2
    """DQO: importance weights π_θ/π_behaviour of offline tokens are clipped to [1 − c, 1 + c]."""


@dataclass
class CriticConfig:
    """The value learner (used when `algorithm.estimator=gae`): its own model, optimizer and pace."""

    lr: float = 2e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lam: float = 1.0
    """Critic GAE λ (VC-PPO decoupled GAE: 1.0 = Monte-Carlo targets)."""
    clip_low: float | None = 0.5
    """Clipped value loss range around the pre-step values (T-PPO: 0.5 / 0.6); null = plain MSE."""
    clip_high: float | None = 0.6
    batch_trajectories: int = 16
    """Finished trajectories per value step."""
    warmup_steps: int = 0
    """Value-only steps under the frozen initial policy before the first policy step (VC-PPO pretraining)."""
    init_path: str = ""
    """Initialise from a reward / process-reward model directory (sequence or token classification
    with one label); empty = from the policy, with a zero scalar head."""
    micro_batch_tokens: int = 1024
    """Tokens per forward/backward chunk (the embedded model's value step peaks at ~3.9 GB with 1024,
    ~6 GB with 4096: measured with 16 trajectories of 164 tokens)."""
    threads: int = 1


@dataclass
class EndpointConfig:
    """One reward endpoint (an actor, or the Serve application `reward-<name>` under `serve run`)."""

    kind: str = "verifier"
    """verifier | genrm (generative judge) | bt (scalar Bradley–Terry RM) | prm (process reward model)."""
    model_path: str = ""
    """genrm: empty = the policy's model (the embedded SmolLM2 on CPU); bt/prm: a local HF directory."""
    judge_mode: str = "pointwise"
    """genrm: pointwise (Yes/No against the reference) | pairwise (the reference as the anchor)."""
    style: str = ""
    """verifier: zero_one | plus_minus (empty = task.reward)."""
    verifier_kinds: dict[str, str] = field(default_factory=dict)
    """verifier: data_source -> math | code | format | tiny | tiny_seq | none (none: not applicable, so a
    hybrid route falls through to the judge). Unlisted sources get a kind by name."""
    code_wall_s: float = 5.0
    """code: wall-clock limit of one test (a run of several asserts gets up to 3x, plus 1 s)."""
    code_memory_mb: int = 512
    """code: memory of the whole sandbox (a cgroup), else of each process."""
    code_isolation: str = "auto"
    """code: auto | namespaces (as root) | user_namespaces | unisolated (rlimits only; needs code_allow_unisolated)."""
    code_allow_unisolated: bool = False
    """code: where no namespace can be made, run code rewards with rlimits alone instead of refusing."""
    math_timeout_s: float = 6.0
    """math: a symbolic check past this is killed (a worker process) and counts as wrong."""
    sigmoid: bool = False
    """bt: squash the logit into (0, 1)."""
    version: str = "1"
    """Reported in every Reward this endpoint produces; bump it when swapping code or model."""
    fault_delay_s: float = 0.0
    """Fault injection (load_tests/faults.py): every call waits this long first, e.g. longer than
    reward.timeout_s to make the endpoint hang. 0 in any real run."""


@dataclass
class RouteConfig:
    """Which endpoints score a data source (fnmatch pattern), and how their rewards combine."""

    match: str = "*"
    endpoints: list[str] = field(default_factory=lambda: ["verifier"])
    combine: str = "first"
    """first: the first endpoint that applies (verifier first, the judge where no verifier applies) |
    mix: weighted mean of the endpoints' scores."""
    weights: list[float] = field(default_factory=list)
    dense: list[str] = field(default_factory=list)
    """Endpoints adding per-token (process) rewards, scaled by dense_lambda_fail/pass by outcome."""
    dense_lambda_fail: float = 0.25
    dense_lambda_pass: float = 0.025


@dataclass
class RewardConfig:
    endpoints: dict[str, EndpointConfig] = field(default_factory=lambda: {"verifier": EndpointConfig()})
    routes: list[RouteConfig] = field(default_factory=lambda: [RouteConfig()])
    timeout_s: float = 120.0
    """A reward call slower than this is retried, then recorded as a failed reward (never a hang)."""
    retries: int = 3
    use_serve: bool = False
    """Call the Serve applications `reward-<name>` (deployed by `serve run configs/serve.yaml`)
    instead of starting the endpoints as actors: they can then be redeployed while training runs."""


@dataclass
class CurriculumStage:
    start_step: int = 0
    data_sources: list[str] = field(default_factory=list)
    """Sources served from `start_step` on (empty = all). E.g. code first, then code + math, then all."""


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    """tiny | arithmetic | file."""
    path: str = ""
    """file: a local jsonl or parquet in verl's layout."""
    eval_path: str = ""
    num_train_prompts: int = 512
    """Built-in tasks: prompts generated for training (and a disjoint held-out set)."""
    num_eval_prompts: int = 64
    reward: str = "zero_one"
    """zero_one (1/0) | plus_minus (+1/-1, DAPO)."""
    seed: int = 0
    pre_ppo_fraction: float = 0.0
    """Pre-PPO selection: before training, sample a response per candidate prompt with the initial
    policy, score it with `pre_ppo_endpoint`, z-score within each data source and keep the lowest
    fraction per source (paper: 0.1). 0 = off."""
    pre_ppo_pool_path: str = ""
    """Candidates for Pre-PPO (a jsonl/parquet in verl's layout). Empty: the train prompts themselves
    are the candidates. Either way the selection is merged with the train prompts (the paper's
    step 4): selected train prompts appear twice, so the hard ones are drawn twice as often."""
    pre_ppo_endpoint: str = "verifier"
    pre_ppo_samples: int = 4
    """Responses sampled per candidate; its score is their mean (one 0/1 response per prompt ties
    most prompts). Failed rewards are left out of the mean; a candidate with none is not selected."""
    curriculum: list[CurriculumStage] = field(default_factory=list)
    """Stages by learner step, e.g. [{start_step: 0, data_sources: [code]}, {start_step: 50,
    data_sources: [code, math]}, {start_step: 150}]."""


@dataclass
class TrainerConfig:
    total_steps: int = 30
    """Learner steps before `asyncrl train` exits (serve runs until stopped)."""
    prompts_per_step: int = 8
    """Groups per training batch (samples per step = prompts_per_step * group_size)."""
    num_generators: int = 1
    generator_threads: int = 1
    learner_threads: int = 1
    learner_device: str = "cpu"
    """cpu | cuda: where the policy and value learners train."""
    learner_precision: str = "fp32"
    """fp32 | bf16 (autocast: fp32 master weights and optimizer state, bf16 matmuls)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory for long responses, ~30% more compute)."""
    logits_chunk_tokens: int = 0
    """The policy learner projects the vocabulary this many trained positions at a time (e.g. 1024)
    and recomputes each chunk in the backward instead of keeping the `[tokens, vocab]` logits and
    softmax of the whole micro-batch (0: all at once). Worth it with `gradient_checkpointing` and a
    large vocabulary: on the embedded model -10% peak memory for +8% step time with checkpointing,
    -1.5% for +11% without (`docs/benchmarks.md`, "Policy learner memory")."""
    generator_gpus: float = 0.0
    """GPUs each generator asks Ray for (e.g. 1, or 0.5 to share one GPU with the learner)."""
    learner_gpus: float = 0.0
    """GPUs each rank of the policy learner asks Ray for (the value learner asks the same)."""
    learner_ranks: int = 1
    """Processes of the policy learner: more than one shards the weights, gradients and Adam's state
    over them (FSDP2; one per GPU of a multi-GPU node, or CPU processes over gloo) and splits each
    batch's micro-batches between them."""
    learner_timeout_s: float = 600.0
    """How long a collective of the policy learner's ranks may take before it fails the run (which
    then restarts from its last checkpoint)."""
    generator_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each generator asks for: pins generators to nodes that offer them,
    e.g. {node_generator: 1} on a cluster whose worker nodes were started with that resource."""
    learner_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources the learners (policy and value) ask for, e.g. {node_learner: 1}."""
    placement: str = "any"
    """any (Ray decides) | colocated (every role on one node: a STRICT_PACK placement group) |
    spread (generators over as many nodes as there are: a SPREAD placement group)."""
    broadcast_bucket_mb: int = 64
    """Bucket size of the distributed weight path."""
    weight_transport: str = "auto"
    """How weights reach each generator: auto (shared memory on the learner's node, CUDA IPC on its
    GPU, a torch.distributed group for other nodes) | shm | cuda_ipc | group (forced)."""
    ray_address: str = ""
    """A running Ray cluster to join (auto, or <head-ip>:6379); empty = start Ray in this process
    (RAY_ADDRESS in the environment also joins one)."""
    object_store_mb: int = 2048
    """Ray's object store when asyncrl starts Ray: the shared memory same-node generators read the
    weights from needs room for about three versions (the embedded model: 0.5 GB each)."""
    seed: int = 0
    run_dir: str = ""
    """Where metrics.jsonl, plots and checkpoints go (default outputs/<time>)."""
    eval_every: int = 0
    """Evaluate on the held-out prompts every N steps (0 = only at start and end)."""
    checkpoint_every: int = 10
    """Checkpoint every N learner steps into <run_dir>/checkpoints (0 = never; `asyncrl train`
    also writes one at the end)."""
    checkpoint_keep: int = 1
    """How many of the newest checkpoints to keep (a commit is atomic; 2 also keeps a fallback for a
    checkpoint damaged on disk, at 1.6 GB each on the embedded model)."""
    max_restarts: int = 3
    """When an actor dies, restart the system from the newest checkpoint this many times at most
    (`asyncrl train` and the Serve `train` app); 0 = fail at the first death."""
    eval_samples: int = 64
    mailbox_capacity: int = 256
    segment_shards: int = 1
    """Mailbox actors behind the generators' segments (a sample's windows stay in one): one actor
    moves a few thousand segments a second; give many generators several."""
    lease_s: float = 600.0
    target_reward: float | None = None
    """Stop early once the mean `reward_mean_generated` of the last `target_window` steps reaches
    this (None = run all steps). Benchmarks use it for wall-clock to a target reward."""
    target_window: int = 20
    synchronous: bool = False
    """Synchronous baseline: issue a batch of prompts, wait for all of it, train, wait for the new
    weights to reach the generators, repeat (no staleness). Windows are whole responses
    (`engine.window_tokens` is set to `engine.max_response_tokens`)."""
    stall_timeout_s: float = 600.0
    """`asyncrl train` fails if no learner step happens for this long (e.g. dynamic sampling
    dropping every group of a task the policy has solved), naming the drop counts."""
    wandb_project: str = "asyncrl"
    wandb_mode: str = "offline"
    """offline | online | disabled (WANDB_MODE in the environment wins)."""
    record: bool = False
    """Keep every finished trajectory (kept or dropped, with its reward, versions and values) and
    every trained batch in `<run_dir>/trajectories/` as Parquet files (`asyncrl.store`)."""
    record_file_mb: int = 64
    """A store file is closed and a new one begun past this size..."""
    record_file_age_s: float = 600.0
    """...or this age, so a long run's store is readable while it runs."""


@dataclass
class OfflineConfig:
    """`mode=learn`: training from recorded data, no generator."""

    data: str = ""
    """A trajectory store (a run directory recorded with trainer.record=true, or its trajectories/),
    or a jsonl/parquet file of labelled responses in verl's layout (`prompt` messages,
    `reward_model.ground_truth`, `data_source`, plus `response` and an optional `score`; without a
    score the task's verifier scores it)."""
    train: str = "policy"
    """policy (the algorithm's policy learner, and its critic if it has one) | value (value
    pretraining only: the critic learns Monte-Carlo returns of the recorded responses)."""
    epochs: int = 1
    """Passes over the data (the run also ends at trainer.total_steps)."""
    batch_trajectories: int = 16
    """DQO and value pretraining: trajectories per update."""
    statuses: list[str] = field(default_factory=lambda: ["kept", "dropped", "recorded"])
    """Which recorded samples to learn from (kept: trained by the recording run; dropped: e.g. no
    signal under dynamic sampling; recorded: mode=generate)."""


@dataclass
class ServeConfig:
    # Where Serve listens is Serve's own `http_options` (configs/serve.yaml: 127.0.0.1:8000).
    admin_token: str = ""
    """Bearer token for the admin routes (e.g. changing the reward mix); empty = ASYNCRL_ADMIN_TOKEN
    from the environment; neither set = admin routes refuse every call."""
    reward_token: str = ""
    """Bearer token for POST /reward/<name>/score (it runs submitted code); empty =
    ASYNCRL_REWARD_TOKEN; neither set = only callers on this machine (loopback) are served."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    offline: OfflineConfig = field(default_factory=OfflineConfig)
    mode: str = "train"
    """train (generate and learn, streaming) | generate (generate, score and record; no learner:
    needs trainer.record=true) | learn (learn from offline.data; no generator)."""
    resume: bool = False
    """Continue from the newest valid checkpoint of `trainer.run_dir` (default: the newest run
    under outputs/ with one): step, weight version, optimizer, prompt cursor, unsent batches."""


def config_dir() -> str:
    """`configs/` of the source tree (editable install), or ASYNCRL_CONFIG_DIR."""
    env = os.environ.get("ASYNCRL_CONFIG_DIR")
    if env:
        return os.path.abspath(env)
    return str(Path(__file__).resolve().parent.parent / "configs")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field."""


def compose(overrides: list[str] | None = None, config_name: str = "config") -> Config:
    """Compose the Hydra config with overrides and validate it against the `Config` schema.

    Hydra picks the config groups (`algorithm=vapo`); every dotted override is then applied to the
    typed config here, so that a mistake is one line naming the field, the nearest valid name and
    the expected type, and `+` never adds a field the schema does not have (Hydra's `+` would add
    it and the dataclass would silently drop it). `+` adds an entry to a mapping, e.g.
    `+reward.endpoints.judge={kind: genrm}`.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore

    parsed = _parse_overrides(list(overrides or []))
    groups = config_groups()
    group_overrides = [o for o in parsed if o.key_or_group in groups]
    value_overrides = [o for o in parsed if o.key_or_group not in groups]
    for override in group_overrides:
        _check_group_choice(override, groups[override.key_or_group])
    # The dataclass schema is the base of configs/config.yaml: every field is typed.
    ConfigStore.instance().store(name="asyncrl_schema", node=Config)
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base=None, job_name="asyncrl"):
            raw = hydra_compose(config_name=config_name, overrides=[o.input_line for o in group_overrides])
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
    except Exception as exc:  # a broken YAML file of a group: Hydra's first line names it
        raise ConfigError(f"invalid config: {_first_line(exc)}") from exc
    for override in value_overrides:
        _apply_override(merged, override)
    try:
        config: Config = OmegaConf.to_object(merged)
    except Exception as exc:
        raise ConfigError(f"invalid config: {_first_line(exc)}") from exc
    if config.trainer.synchronous:
        # A synchronous batch is whole responses (cut windows would wait for a batch that never
        # fills); set here so that a task's window size cannot undo it.
        config.engine.window_tokens = config.engine.max_response_tokens
    validate(config)
    return config


def config_from_dict(data: dict) -> Config:
    """A config written by `to_dict` (a run's `config.json`) back as a validated `Config`."""
    try:
        config: Config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), data))
    except Exception as exc:
        raise ConfigError(f"invalid config: {_first_line(exc)}") from exc
    validate(config)
    return config


def _first_line(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return (str(cause).strip().splitlines() or [type(cause).__name__])[0]


def _parse_overrides(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = []
    for line in overrides:
        try:
            (override,) = parser.parse_overrides([line])
        except Exception as exc:
            raise ConfigError(f"{line!r} is not an override (key=value, +key=value or group=option): "
                              f"{_first_line(exc)}") from exc
        if override.is_sweep_override():
            raise ConfigError(f"{line!r}: sweeps (a,b or range()) are not supported; run once per value")
        parsed.append(override)
    return parsed


def config_groups() -> dict[str, list[str]]:
    """Config group -> its options (the YAML files of `configs/<group>/`)."""
    root = Path(config_dir())
    return {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in root.iterdir() if d.is_dir()}


def _nearest(word: str, options) -> str:
    import difflib

    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_group_choice(override, options: list[str]) -> None:
    choice = override.value()
    if override.is_delete() or choice in options:
        return
    raise ConfigError(f"{override.input_line}: no {override.key_or_group} named {choice!r}"
                      f"{_nearest(str(choice), options)} (choices: {', '.join(options)})")


def _apply_override(merged, override) -> None:
    """Walk the schema along the dotted key, then set (or delete) the value with its type checked."""
    import typing
    from dataclasses import is_dataclass

    key, line = override.key_or_group, override.input_line
    parts = key.split(".")
    node, kind = merged, Config
    for i, part in enumerate(parts):
        at = ".".join(parts[: i + 1])
        last = i == len(parts) - 1
        kind = _strip_optional(kind)
        if is_dataclass(kind):
            hints = typing.get_type_hints(kind)
            if part not in hints:
                section = ".".join(parts[:i]) or "the config"
                # `modle=tiny`: a group's name mistyped, and its value one of the group's options.
                groups = {g for g, options in config_groups().items() if str(override.value()) in options} if i == 0 else set()
                hint = _nearest(part, groups) or _nearest(part, hints)
                raise ConfigError(f"{line}: {section} has no field {part!r}"
                                  f"{hint or ' (fields: ' + ', '.join(hints) + ')'}")
            if last and override.is_delete():
                raise ConfigError(f"{line}: {at} is a field of the schema and cannot be removed; set it instead")
            kind = hints[part]
        elif typing.get_origin(kind) is dict:
            value_kind = typing.get_args(kind)[1]
            if part not in node:
                entries = ", ".join(map(str, node)) or "none"
                if not override.is_add():
                    raise ConfigError(f"{line}: {'.'.join(parts[:i])} has no entry {part!r}{_nearest(part, node)} "
                                      f"(entries: {entries}); to add one, write +{at}=...")
                if not last and is_dataclass(value_kind):
                    with open_dict(node):
                        node[part] = OmegaConf.structured(value_kind)
            elif last and override.is_delete():
                with open_dict(node):
                    del node[part]
                return
            kind = value_kind
        elif typing.get_origin(kind) is list:
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{line}: {'.'.join(parts[:i])} has {len(node)} entries; {part!r} is not one of them")
            part, kind = int(part), typing.get_args(kind)[0]
        else:
            raise ConfigError(f"{line}: {'.'.join(parts[:i])} is {_describe(kind)} and has no field {part!r}")
        if not last:
            node = node[part]
    if override.is_delete():
        raise ConfigError(f"{line}: only entries of a mapping (e.g. ~reward.endpoints.genrm) can be removed")
    value = override.value()
    try:
        if is_dataclass(_strip_optional(kind)) and isinstance(value, dict) and part not in node:
            with open_dict(node):  # a new entry of a mapping, typed by the schema
                node[part] = OmegaConf.merge(OmegaConf.structured(_strip_optional(kind)), value)
        elif typing.get_origin(_strip_optional(kind)) is dict and not is_dataclass(typing.get_args(_strip_optional(kind))[1]):
            with open_dict(merged):  # a mapping of plain values takes new keys
                OmegaConf.update(merged, key, value, merge=True)
        else:
            OmegaConf.update(merged, key, value, merge=True)
    except Exception as exc:
        got = override.get_value_element_as_str()
        detail = f" ({_first_line(exc)})" if isinstance(value, (dict, list)) else ""
        raise ConfigError(f"{line}: {key} expects {_describe(kind)}, got {got!r}{detail}") from exc


def _strip_optional(kind):
    import typing

    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


def _describe(kind) -> str:
    import typing
    from dataclasses import is_dataclass

    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    inner = _strip_optional(kind)
    suffix = " or null" if inner is not kind else ""
    if inner in names:
        return names[inner] + suffix
    if is_dataclass(inner):
        return f"a mapping of {inner.__name__} fields ({', '.join(typing.get_type_hints(inner))})" + suffix
    origin = typing.get_origin(inner)
    if origin is list:
        return f"a list of {_describe(typing.get_args(inner)[0])}" + suffix
    if origin is dict:
        return f"a mapping to {_describe(typing.get_args(inner)[1])}" + suffix
    return str(inner) + suffix


# Ranges of numeric fields: ">= 1", "> 0", "[0, 1]" or "(0, 1]"; `*` matches any entry of a
# mapping; a null (where the field allows it) is always in range.
RANGES = {
    "model.hidden_size": ">= 1", "model.num_layers": ">= 1", "model.num_heads": ">= 1", "model.max_positions": ">= 1",
    "engine.window_tokens": ">= 1", "engine.max_response_tokens": ">= 1", "engine.max_windows": ">= 0",
    "engine.max_inflight_sequences": ">= 1", "engine.temperature": "> 0", "engine.top_p": "(0, 1]",
    "engine.top_k": ">= 0", "engine.first_token_temperature": "> 0", "engine.first_token_top_k": ">= 0",
    "engine.threads": ">= 1", "engine.long_tail_fraction": "[0, 1]", "engine.long_tail_tokens": ">= 0",
    "engine.sglang_mem_fraction": "(0, 1)", "engine.sglang_tp_size": ">= 1",
    "engine.sglang_max_total_tokens": ">= 0", "engine.sglang_max_running_requests": ">= 0",
    "engine.sglang_chunked_prefill_tokens": ">= 0",
    "algorithm.group_size": ">= 1", "algorithm.clip_low": "[0, 1)", "algorithm.clip_high": ">= 0",
    "algorithm.kl_coef": ">= 0", "algorithm.entropy_coef": ">= 0", "algorithm.overlong_buffer_tokens": ">= 0",
    "algorithm.overlong_penalty_factor": ">= 0", "algorithm.max_staleness_versions": ">= 0", "algorithm.lr": "> 0",
    "algorithm.weight_decay": ">= 0", "algorithm.grad_clip": "> 0", "algorithm.warmup_steps": ">= 0",
    "algorithm.micro_batch_tokens": ">= 1", "algorithm.gamma": "(0, 1]", "algorithm.lam": "[0, 1]",
    "algorithm.length_adaptive_alpha": ">= 0", "algorithm.edge_mask_tokens": ">= 0",
    "algorithm.advantage_clamp": ">= 0", "algorithm.nll_coef": ">= 0", "algorithm.ppo_epochs": ">= 1",
    "algorithm.mini_batches": ">= 1", "algorithm.behaviour_weight_cap": ">= 1", "algorithm.loss_norm_tokens": ">= 0",
    "algorithm.max_refill_rounds": ">= 0", "algorithm.retire_after_groups": ">= 0", "algorithm.retire_epochs": ">= 1",
    "algorithm.retest_every_s": "> 0", "algorithm.rollout_is_cap": ">= 1",
    "task.pre_ppo_samples": ">= 1",
    "critic.lr": "> 0", "critic.weight_decay": ">= 0", "critic.grad_clip": "> 0", "critic.lam": "[0, 1]",
    "critic.clip_low": ">= 0", "critic.clip_high": ">= 0", "critic.batch_trajectories": ">= 1",
    "critic.warmup_steps": ">= 0", "critic.micro_batch_tokens": ">= 1", "critic.threads": ">= 1",
    "reward.timeout_s": "> 0", "reward.retries": ">= 0", "reward.endpoints.*.code_wall_s": "> 0",
    "reward.endpoints.*.code_memory_mb": ">= 16", "reward.endpoints.*.math_timeout_s": "> 0",
    "reward.endpoints.*.fault_delay_s": ">= 0", "reward.routes.*.dense_lambda_fail": ">= 0",
    "reward.routes.*.dense_lambda_pass": ">= 0",
    "task.num_train_prompts": ">= 1", "task.num_eval_prompts": ">= 1", "task.pre_ppo_fraction": "[0, 1]",
    "trainer.total_steps": ">= 1", "trainer.prompts_per_step": ">= 1", "trainer.num_generators": ">= 1",
    "trainer.generator_threads": ">= 1", "trainer.learner_threads": ">= 1", "trainer.broadcast_bucket_mb": ">= 1",
    "trainer.object_store_mb": ">= 64", "trainer.segment_shards": ">= 1", "trainer.generator_gpus": ">= 0", "trainer.learner_gpus": ">= 0",
    "trainer.learner_ranks": ">= 1", "trainer.learner_timeout_s": "> 0", "trainer.logits_chunk_tokens": ">= 0",
    "trainer.eval_every": ">= 0", "trainer.checkpoint_every": ">= 0", "trainer.checkpoint_keep": ">= 1",
    "trainer.max_restarts": ">= 0", "trainer.eval_samples": ">= 1", "trainer.mailbox_capacity": ">= 1",
    "trainer.lease_s": "> 0", "trainer.target_window": ">= 1", "trainer.stall_timeout_s": "> 0",
    "trainer.record_file_mb": ">= 1", "trainer.record_file_age_s": "> 0", "offline.epochs": ">= 1",
    "offline.batch_trajectories": ">= 1", "algorithm.importance_clip": "> 0",
}


def _in_range(value: float, bounds: str) -> bool:
    if bounds.startswith((">", "<")):
        op, limit = bounds.split()
        return {">=": value >= float(limit), ">": value > float(limit)}[op]
    low, high = (float(x) for x in bounds[1:-1].split(","))
    return ((value >= low) if bounds[0] == "[" else (value > low)) and ((value <= high) if bounds[-1] == "]" else (value < high))


def range_checks(config: Config) -> list[tuple[bool, str]]:
    """Every field of RANGES (each entry of a mapping or list for `*`) against its bounds."""
    def values(node, parts, path):
        if not parts:
            yield path, node
        elif parts[0] == "*":
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                yield from values(child, parts[1:], f"{path}.{key}")
        else:
            yield from values(getattr(node, parts[0]), parts[1:], f"{path}.{parts[0]}" if path else parts[0])

    checks = []
    for pattern, bounds in RANGES.items():
        for path, value in values(config, pattern.split("."), ""):
            if value is not None:
                checks.append((_in_range(value, bounds), f"{path}={value} is out of range: it must be "
                                              f"{bounds if bounds[0] in '<>' else 'in ' + bounds}"))
    return checks


def validate(config: Config) -> None:
    """Ranges, then cross-field checks that the schema alone cannot express."""
    e, a = config.engine, config.algorithm
    checks = [
        *range_checks(config),
        (e.long_tail_tokens <= e.max_response_tokens, "engine.long_tail_tokens must be <= engine.max_response_tokens"),
        (a.name in ALGORITHMS, f"algorithm.name must be one of {sorted(ALGORITHMS)}"),
        (a.loss_agg in LOSS_AGG_MODES, f"algorithm.loss_agg must be one of {LOSS_AGG_MODES}"),
        (a.dual_clip is None or a.dual_clip > 1, "algorithm.dual_clip must be > 1 (or null)"),
        (a.overlong_buffer_tokens < e.max_response_tokens,
         "algorithm.overlong_buffer_tokens must be < engine.max_response_tokens"),
        (config.model.source in ("tiny", "gguf", "hf"), "model.source must be tiny, gguf or hf"),
        (config.task.reward in ("zero_one", "plus_minus"), "task.reward must be zero_one or plus_minus"),
        (a.estimator in ESTIMATORS, f"algorithm.estimator must be one of {ESTIMATORS}"),
        (not a.window_training or a.estimator == "gae",
         "algorithm.window_training needs algorithm.estimator=gae (windows have no outcome to normalise)"),
        (a.egae_bootstrap in ("previous", "next"), "algorithm.egae_bootstrap must be previous or next"),
        (a.filter_metric in FILTER_METRICS, f"algorithm.filter_metric must be one of {FILTER_METRICS}"),
        (a.kl_estimator in KL_ESTIMATORS, f"algorithm.kl_estimator must be one of {KL_ESTIMATORS}"),
        (a.rollout_correction in ("none", *BEHAVIOUR_CORRECTIONS),
         f"algorithm.rollout_correction must be none or one of {BEHAVIOUR_CORRECTIONS}"),
        (not a.kl_in_reward or (a.estimator == "gae" and a.kl_coef > 0),
         "algorithm.kl_in_reward needs algorithm.estimator=gae (token rewards feed GAE) and algorithm.kl_coef > 0"),
        (not a.window_training or not any(route.dense for route in config.reward.routes),
         "process rewards (reward.routes[*].dense) cannot train T-PPO's windows: a process reward model "
         "scores a finished response, after its earlier windows were trained; use algorithm=vapo or ppo "
         "(whole responses), or drop the dense endpoints"),
        *_reward_checks(config),
        (config.task.pre_ppo_fraction == 0 or config.task.pre_ppo_endpoint in config.reward.endpoints,
         "task.pre_ppo_endpoint must name an entry of reward.endpoints"),
        (not config.trainer.synchronous or a.max_staleness_versions == 0,
         "trainer.synchronous needs algorithm.max_staleness_versions=0"),
        (config.mode in MODES, f"mode must be one of {MODES}"),
        (e.name in ("torch", "sglang"), "engine.name must be torch or sglang"),
        (e.device in ("cpu", "cuda"), "engine.device must be cpu or cuda"),
        (config.trainer.learner_device in ("cpu", "cuda"), "trainer.learner_device must be cpu or cuda"),
        (config.trainer.learner_precision in ("fp32", "bf16"), "trainer.learner_precision must be fp32 or bf16"),
        (config.trainer.placement in ("any", "colocated", "spread"), "trainer.placement must be any, colocated or spread"),
        (e.device != "cuda" or config.trainer.generator_gpus > 0,
         "a generator on CUDA (engine.device=cuda) needs trainer.generator_gpus > 0"),
        (e.name != "sglang" or e.device == "cuda" or config.trainer.generator_gpus == 0,
         f"engine.device=cpu with trainer.generator_gpus={config.trainer.generator_gpus}: engine=sglang is the "
         "one-GPU preset; for SGLang on CPU use engine=sglang_cpu"),
        (e.name != "sglang" or e.device == "cuda" or e.sglang_max_total_tokens > 0,
         "engine=sglang on CPU needs engine.sglang_max_total_tokens > 0: its KV cache is ordinary RAM "
         "(engine=sglang_cpu sets 8192)"),
        (e.name != "sglang" or not e.sglang_max_total_tokens or e.sglang_max_total_tokens > e.max_response_tokens,
         f"engine.sglang_max_total_tokens={e.sglang_max_total_tokens} cannot hold one response of "
         f"engine.max_response_tokens={e.max_response_tokens} and its prompt"),
        (config.trainer.learner_device != "cuda" or config.trainer.learner_gpus > 0,
         "trainer.learner_device=cuda needs trainer.learner_gpus > 0"),
        (config.trainer.weight_transport in ("auto", "shm", "cuda_ipc", "group"),
         "trainer.weight_transport must be auto, shm, cuda_ipc or group"),
        (config.mode != "generate" or config.trainer.record,
         "mode=generate keeps nothing but the store: set trainer.record=true"),
        (config.mode != "learn" or bool(config.offline.data), "mode=learn needs offline.data (a store or a file)"),
        (a.name != "dqo" or config.mode == "learn", "algorithm=dqo learns offline: run it with mode=learn"),
        (config.offline.train in ("policy", "value"), "offline.train must be policy or value"),
        (config.offline.train != "value" or a.estimator == "gae",
         "offline.train=value pretrains a critic: use a value-based algorithm (ppo, vcppo, vapo, tppo)"),
        (set(config.offline.statuses) <= {"kept", "dropped", "recorded"},
         "offline.statuses must be among kept, dropped, recorded"),
        (config.trainer.learner_ranks == 1 or config.mode == "train",
         "trainer.learner_ranks > 1 shards the online learner; mode=learn and mode=generate run one rank"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def route_checks(routes: list[RouteConfig], endpoint_names: set[str]) -> list[tuple[bool, str]]:
    """Checks of reward routes (at start-up, and when the admin route changes them)."""
    checks = []
    for i, route in enumerate(routes):
        for name in [*route.endpoints, *route.dense]:
            checks.append((name in endpoint_names, f"reward.routes[{i}] names unknown endpoint {name!r}"))
        checks.append((bool(route.endpoints), f"reward.routes[{i}].endpoints must not be empty"))
        checks.append((route.combine in ("first", "mix"), f"reward.routes[{i}].combine must be first or mix"))
        checks.append((route.combine != "mix" or len(route.weights) == len(route.endpoints),
                       f"reward.routes[{i}].weights must give one weight per endpoint for combine=mix"))
    return checks


def _reward_checks(config: Config) -> list[tuple[bool, str]]:
    r = config.reward
    checks = [(bool(r.endpoints), "reward.endpoints must name at least one endpoint")]
    for name, e in r.endpoints.items():
        checks.append((e.kind in ENDPOINT_KINDS, f"reward.endpoints.{name}.kind must be one of {ENDPOINT_KINDS}"))
        checks.append((e.kind not in ("bt", "prm") or bool(e.model_path), f"reward.endpoints.{name}.model_path is required for {e.kind}"))
        checks.append((e.judge_mode in ("pointwise", "pairwise"), f"reward.endpoints.{name}.judge_mode must be pointwise or pairwise"))
    checks += route_checks(r.routes, set(r.endpoints))
    if config.algorithm.estimator == "pairwise":
        judge = r.endpoints.get(config.algorithm.pairwise_endpoint)
        checks.append((judge is not None and judge.kind == "genrm",
                       "algorithm.pairwise_endpoint must name a genrm endpoint in reward.endpoints"))
    return checks


ENDPOINT_KINDS = ("verifier", "genrm", "bt", "prm")
ALGORITHMS = ("grpo", "dapo", "ppo", "vcppo", "vapo", "tppo", "tppo_sync", "pairwise_ppo", "dqo")
MODES = ("train", "generate", "learn")
ESTIMATORS = ("group", "gae", "pairwise")
# Names the algorithms accept, owned here so that checking a config needs no torch import.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
FILTER_METRICS = ("acc", "score")
BEHAVIOUR_CORRECTIONS = ("token_tis", "sequence_tis", "token_mis", "sequence_mis")
KL_ESTIMATORS = ("k1", "k2", "low_var_kl")


def to_dict(config: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)
