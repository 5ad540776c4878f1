"""The run as a whole: `trainer` (how long, batches, checkpoints, evaluation, records: the driver
and the `Run`), `cluster` (where the roles run and how they reach each other), `serve` (the Serve
applications' access), `offline` (`mode=learn`), and the root `Config` that holds every section."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Section, UnitFloat
from asyncrl.config.learner import CriticConfig, PolicyConfig
from asyncrl.config.model import EngineConfig, ModelConfig, SamplingConfig
from asyncrl.config.reward import RewardConfig
from asyncrl.config.task import EnvironmentConfig, TaskConfig


class TrainerConfig(Section):
    """How a run goes: its length, its batches, checkpoints, evaluation, metrics and records."""

    total_steps: PositiveInt = 20
    """Learner steps before `asyncrl train` exits (serve runs until stopped)."""
    prompts_per_step: PositiveInt = 4
    """Groups per training batch (samples per step = prompts_per_step * group_size)."""
    seed: int = 0
    """Seed of the prompt order, the sampling seeds and the models' initial heads."""
    run_dir: str = ""
    """Where metrics.jsonl, plots and checkpoints go (default outputs/<time>)."""
    eval_every: NonNegativeInt = 0
    """Evaluate on the held-out prompts every N steps, beside training, each score named by the
    weight version it scored (`evals.jsonl`, `eval_accuracy.png`); 0 = only at start and end. Each
    step trains one version, so this is also every N versions. task=file needs task.eval_path."""
    eval_samples: PositiveInt = 64
    """Held-out prompts evaluated (greedy pass@1)."""
    checkpoint_every: NonNegativeInt = 10
    """Checkpoint every N learner steps into <run_dir>/checkpoints (0 = never; `asyncrl train`
    also writes one at the end)."""
    checkpoint_every_s: NonNegativeFloat = 0.0
    """Also checkpoint when this many seconds passed since the last one (0 = not by time): a
    service that trains for days wants checkpoints by time, not every few seconds of a fast model."""
    checkpoint_keep: PositiveInt = 1
    """How many of the newest checkpoints to keep (a commit is atomic; 2 also keeps a fallback for a
    checkpoint damaged on disk)."""
    max_restarts: NonNegativeInt = 3
    """When a role that holds unrecoverable state dies (or any other error ends a poll of the run),
    restart the run from the newest checkpoint, this many times at most within any
    `restart_window_s` (`asyncrl train` fails past it; the Serve `train` app waits until the window
    allows the next); 0 = fail at the first death."""
    restart_window_s: PositiveFloat = 3600.0
    """The window `max_restarts` counts restarts in (restarts.jsonl keeps them across processes): a
    budget per hour, so a run of days is not ended by a few restarts spread over its life."""
    stall_timeout_s: PositiveFloat = 600.0
    """`asyncrl train` fails if no learner step happens for this long (e.g. dynamic sampling
    dropping every group of a task the policy has solved), naming the drop counts."""
    target_reward: float | None = None
    """Stop early once the mean `reward_mean_generated` of the last `target_window` steps reaches
    this (None = run all steps). Benchmarks use it for wall-clock to a target reward."""
    target_window: PositiveInt = 20
    """Steps averaged for `target_reward`."""
    max_train_s: NonNegativeFloat = 0.0
    """Stop `asyncrl train` once training has run this many seconds (0 = no limit), then checkpoint
    and evaluate as after the last step: how algorithms are compared at equal wall-clock. The
    clock starts when the run's actors are up (model loading and the first evaluation excluded)
    and includes periodic evaluations and restarts; a `resume=true` run starts it again. Refused
    with `mode=generate`/`mode=learn`; the Serve apps train until stopped."""
    max_generated_samples: NonNegativeInt = 0
    """Stop `asyncrl train` once the generators have finished this many samples (0 = no limit), then
    checkpoint and evaluate as after a last step: how algorithms are compared at an equal number of
    generated samples (DAPO's dynamic sampling generates more per step than it trains). Checked at
    each poll of the driver (0.5 s), so a run overshoots by what was generated meanwhile and while
    it stops: compare `final_status.samples_generated` in `summary.json`. The count is that of the
    generators running now (one that leaves takes its count with it; a restart or `resume=true`
    counts from 0). Refused with `mode=generate`/`mode=learn`; the Serve apps train until stopped."""
    synchronous: bool = False
    """Synchronous baseline: issue a batch of prompts, wait for all of it, train, wait for the new
    weights to reach the generators, repeat (no staleness). Windows are whole responses
    (`engine.window_tokens` is set to `engine.max_response_tokens`)."""
    loggers: list[Literal["console", "wandb", "tensorboard", "ray"]] = msgspec.field(
        default_factory=lambda: ["console", "wandb"])
    """Where the step records go besides `metrics.jsonl` (always written): console (`asyncrl
    train`'s progress bar), wandb (a wandb run that follows the run directory across resumes and
    restarts: `wandb_mode`), tensorboard (scalars in `<run_dir>/tensorboard/`), ray (the run's live
    figures as `ray.util.metrics` gauges and counters, `asyncrl_*`, tagged with the run's name: the
    Ray dashboard and Ray's Prometheus endpoint show them; `cluster.metrics_export_port`). verl's
    `trainer.logger` sets it; the Serve `train` app logs to all of them too."""
    experiment_name: str = ""
    """The run's name in wandb (verl's name for it); empty = the run directory's name."""
    wandb_project: str = "asyncrl"
    """The wandb project of the run's metrics."""
    wandb_group: str = ""
    """The wandb group the run joins (runs compared together: seeds, algorithms); empty = none."""
    wandb_tags: list[str] = msgspec.field(default_factory=list)
    """The wandb run's tags."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """offline | online | disabled (WANDB_MODE in the environment wins). Offline, each process of a
    run (a resume, a Serve controller) writes `<run_dir>/wandb/offline-run-<time>-<id>/` with the
    one id of `<run_dir>/loggers.json`: `wandb sync <run_dir>/wandb/offline-run-*` uploads them as
    one run."""
    store_trajectories: bool = False
    """Keep every finished trajectory (kept or dropped, with its reward, versions and values) and
    every trained batch in `<run_dir>/trajectories/` as Parquet files (`asyncrl.storage.trajectory_store`)."""
    store_file_mb: PositiveInt = 64
    """A store file is closed and a new one begun past this size..."""
    store_file_age_s: PositiveFloat = 600.0
    """...or this age, so a long run's store is readable while it runs."""
    store_keep_mb: NonNegativeInt = 0
    """The store's closed files are deleted oldest first past this many MB in all, its images
    counted (one that no file left names goes too; 0 = keep every file: the store is the run's data
    set; a run of days sets a bound or a disk of its own)."""
    log_file_mb: PositiveInt = 256
    """A run's jsonl log (metrics, generators, retirements, restarts) rolls to `<name>.1` past this size..."""
    log_files_kept: NonNegativeInt = 4
    """...and keeps this many rolled files (the oldest beyond is deleted), so a run of days keeps
    at most (1 + log_files_kept) x log_file_mb of each log."""


class ClusterConfig(Section):
    """Where the roles run and how they reach each other: Ray, placement, mailboxes."""

    num_generators: PositiveInt = 1
    """Generator processes (each with its own engine)."""
    placement: Literal["any", "colocated", "spread"] = "any"
    """any (Ray decides) | colocated (every role on one node: a STRICT_PACK placement group) |
    spread (generators over as many nodes as there are: a SPREAD placement group)."""
    ray_address: str = ""
    """A running Ray cluster to join (auto, or <head-ip>:6379); empty = start Ray in this process
    (RAY_ADDRESS in the environment also joins one)."""
    metrics_export_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """The port of Ray's Prometheus endpoint (`http://<node>:<port>/metrics`, where the metrics of
    `trainer.loggers: [ray]` are) when asyncrl starts Ray; 0 = a free port Ray picks (the run says
    which at start-up). A cluster joined (`ray_address`) keeps its own."""
    object_store_mb: Annotated[int, msgspec.Meta(ge=64)] = 2048
    """Ray's object store when asyncrl starts Ray: room for a few versions of the policy on their
    way to the policy endpoint and to evaluation (the embedded model: 0.5 GB each)."""
    mailbox_capacity: PositiveInt = 256
    """Segments the generators' mailbox holds before it applies backpressure."""
    mailbox_bytes: NonNegativeInt = 1 << 30
    """Each mailbox of a run (prompts, segments, batches, trajectories) also applies backpressure
    once the encoded messages it holds reach this many bytes (a sharded one: this over its shards);
    a message larger than this alone still passes an empty mailbox. 0: messages counted only."""
    segment_shards: PositiveInt = 1
    """Mailbox actors behind the generators' segments (a sample's windows stay in one): one actor
    moves a few thousand segments a second; give many generators several."""
    lease_s: PositiveFloat = 600.0
    """A message taken from a mailbox and not acknowledged within this is delivered again (a
    generator that dies or leaves gives its leases back at once; a generator renews the leases of
    the prompts it works on every quarter of this)."""
    generator_timeout_s: PositiveFloat = 120.0
    """A generator that does not answer for this long (its stats, or a weight delivery), or whose
    engine call in progress (a window, a weight load) has gone this long without progress, is
    healed: its work goes back through the ledger to the others and a replacement joins. Progress
    is a decode step on the embedded engine (a window longer than this that decodes is live); on
    SGLang it is the call's end, so there it must exceed the longest window."""
    drain_timeout_s: NonNegativeFloat = 60.0
    """A generator leaving the pool finishes its sequences for up to this long, then hands the rest back."""
    autoscale: bool = False
    """Grow and shrink the pool between `min_generators` and `max_generators` from what the run
    measures: the learner waiting for batches grows it, batches waiting for the learner shrink it."""
    min_generators: PositiveInt = 1
    """The smallest pool the autoscaler keeps."""
    max_generators: PositiveInt = 4
    """The largest pool the autoscaler (or the admin route) may ask for."""
    autoscale_every_s: PositiveFloat = 60.0
    """How often the autoscaler looks, and the window it measures over."""


class ServeConfig(Section):
    """Access to the Serve applications (where Serve listens is its own `http_options`:
    configs/serve.yaml, 127.0.0.1:8000)."""

    admin_token: str = ""
    """Bearer token for the admin routes (e.g. changing the reward mix); empty = ASYNCRL_ADMIN_TOKEN
    from the environment; neither set = admin routes refuse every call."""
    reward_token: str = ""
    """Bearer token for POST /reward/<name>/score (it runs submitted code); empty =
    ASYNCRL_REWARD_TOKEN; neither set = the route refuses every call (the trainer does not use it:
    it calls the endpoints through Serve handles)."""
    reward_local_without_token: bool = False
    """With no reward token, serve POST /reward/<name>/score to callers on this machine (loopback)
    anyway: a development machine's opt-in. Never behind a same-host reverse proxy or a mesh
    sidecar, which make every caller loopback."""
    api_key: str = ""
    """Bearer key the policy endpoint asks every caller for (`Authorization: Bearer <key>`, as vLLM's
    `--api-key`; a missing or wrong one is a 401), on every route but /health; empty =
    ASYNCRL_API_KEY from the environment; neither set = the endpoint answers whoever reaches it. A
    secret: records write it as <redacted>."""
    follow_learner: bool = True
    """The policy endpoint adopts the running learner's weights as they change; false = it serves
    the model's own weights (a frozen reference beside a run, or a policy loaded from model.path)."""
    version_wait_s: NonNegativeFloat = 30.0
    """Policy endpoint: a request asking for a weight version not yet held (`min_weight_version`,
    or an exact `weight_version` above the one served) waits up to this long for it to land, then
    is refused with 409 naming the version held."""
    max_batch_sequences: PositiveInt = 64
    """Policy endpoint: sequences (requests x n choices) the embedded engine decodes together in one
    window (more wait for a later one). One request with more is refused (400), on SGLang too."""
    batch_window_tokens: PositiveInt = 16
    """Policy endpoint, embedded engine: tokens per sequence per engine window. Between windows,
    finished and abandoned requests leave, waiting ones join and weight updates land; a request
    that could join the window in progress cuts it (`batch_cut_after_s`)."""
    batch_cut_after_s: NonNegativeFloat = 0.0
    """Policy endpoint, embedded engine: a request that arrives while a window runs and could join
    it (a free row; rows of any sampling settings share a window) ends that window at its next
    decode step once the window has run this long (0: at the next step), so it waits a step, not the rest of the window.
    Each new window costs its rows' KV caches copied into a fresh block: raise this where steps are
    much cheaper than that copy. Above a window's time (say 60), windows are never cut. A model on
    transformers' padded path (a family the engine's decoder does not know) is never cut: it keeps
    no caches, so each window re-reads every context."""
    batch_gather_s: NonNegativeFloat = 0.05
    """Policy endpoint, embedded engine: when every sequence of the last window has ended and fewer
    new ones are ready than it had, wait up to this long for more before the next window starts
    (clients whose answers just ended send their next requests milliseconds apart; a window
    started for the first would keep the rest waiting a whole window). 0 = start at once."""
    max_kv_mb: PositiveInt = 1024
    """Policy endpoint, embedded engine: the KV cache one window may allocate (every sequence's
    keys and values at the window's width). Requests wait for room; one that could never fit is
    refused (400)."""
    max_response_tokens: PositiveInt = 4096
    """Policy endpoint: the most tokens a choice may generate. A chat request with no length gets
    what is left of the context, up to this; one that asks for more is refused (400)."""
    max_body_mb: PositiveInt = 4
    """Policy endpoint: request bodies over this are refused with 413 before they are read
    (declared lengths at once, chunked bodies as they arrive)."""
    max_images_per_request: NonNegativeInt = 4
    """Policy endpoint, a vision-language model: the most `image_url` content parts one chat request
    may hold (every message together); more is refused (400). 0 = no images at all."""
    max_image_mb: PositiveFloat = 8.0
    """Policy endpoint: the most bytes one image may have (a data URL's decoded payload, or a file),
    else 400; a data URL is bounded by `max_body_mb` first (base64 is 4/3 of its bytes)."""
    image_store_mb: NonNegativeFloat = 1024.0
    """Policy endpoint: the disk its requests' images and their processed tensors may fill, in their
    own part of the image store (`~/.cache/asyncrl/images/endpoint`); past it the least recently
    used are deleted (never one used within `image_store_keep_s`). 0 = no bound. Training's images
    are never deleted."""
    image_store_keep_s: NonNegativeFloat = 600.0
    """Policy endpoint: an image used (stored or read) within this many seconds is never deleted to
    keep `image_store_mb`, so that the requests in flight keep theirs."""
    image_files_from: str = ""
    """Policy endpoint: a directory whose files an `image_url` may name (a path, absolute or relative
    to it, or `file://`), read only where its real path (links resolved) is inside it. Empty = no
    files: images come as data URLs only. Never URLs of the network (http, https)."""
    resume_run: bool = True
    """The `train` app continues the run of its run directory when that has a valid checkpoint (a
    controller Serve replaced, a redeploy, a restarted cluster), as `resume=true` does; without
    `trainer.run_dir` that directory is `outputs/serve-<app name>`, the same at every start.
    false: every start is a new run (in a new timestamped directory unless trainer.run_dir is set)."""


class DQOConfig(Section):
    """DQO (`algorithm=dqo`, offline): Q(s,a) = β·log(π/π_ref)(a|s) + V(s) regressed to soft λ-returns."""

    beta: NonNegativeFloat = 0.03
    """β, the weight of the KL-regularised reward (the unofficial TRL fork: 0.03)."""
    gamma: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    """Discount of the soft returns."""
    lam: UnitFloat = 1.0
    """λ of the soft λ-returns (the paper: λ = 1 beat 0.95)."""
    importance_clip: PositiveFloat = 0.2
    """Importance weights π_θ/π_behaviour of offline tokens are clipped to [1 − c, 1 + c]."""


class OfflineConfig(Section):
    """`mode=learn`: training from recorded data, no generator."""

    data: str = ""
    """A trajectory store (a run directory of a run with trainer.store_trajectories=true, or its
    trajectories/), or a jsonl/parquet file of labelled responses in verl's layout (`prompt` messages,
    `reward_model.ground_truth`, `data_source`, plus `response` and an optional `score`; without a
    score the task's verifier scores it)."""
    train: Literal["policy", "value"] = "policy"
    """policy (the algorithm's policy learner, and its critic if it has one) | value (value
    pretraining only: the critic learns Monte-Carlo returns of the recorded responses)."""
    epochs: PositiveInt = 1
    """Passes over the data (the run also ends at trainer.total_steps)."""
    batch_trajectories: PositiveInt = 16
    """DQO and value pretraining: trajectories per update."""
    statuses: list[Literal["kept", "dropped", "recorded"]] = msgspec.field(
        default_factory=lambda: ["kept", "dropped", "recorded"])
    """Which recorded samples to learn from (kept: trained by the recording run; dropped: e.g. no
    signal under dynamic sampling; recorded: mode=generate)."""
    dqo: DQOConfig = msgspec.field(default_factory=DQOConfig)
    """DQO's own knobs (`algorithm=dqo`)."""


class Config(Section):
    """Every section; each role takes its own (docs/architecture.md lists who reads what)."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    """The policy model (every role that loads it)."""
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    """The generators' engine."""
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    """The behaviour distribution (the engines sample from it, the learners score under it)."""
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    """Advantages, filters and shaping (the assembler), and the knobs the roles share."""
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    """The policy learner."""
    critic: CriticConfig = msgspec.field(default_factory=CriticConfig)
    """The value learner (value-based algorithms)."""
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    """Reward endpoints and routes (the assembler's reward router)."""
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    """The prompts (the prompt source, evaluation)."""
    environment: EnvironmentConfig = msgspec.field(default_factory=EnvironmentConfig)
    """The environment episodes act in (multi-turn tool use; the generators and the environment endpoint)."""
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    """The run: steps, batches, checkpoints, evaluation, records."""
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    """Where the roles run and how they connect."""
    serve: ServeConfig = msgspec.field(default_factory=ServeConfig)
    """The Serve applications: access tokens, the policy endpoint's bounds, resuming the run."""
    offline: OfflineConfig = msgspec.field(default_factory=OfflineConfig)
    """`mode=learn`."""
    mode: Literal["train", "generate", "learn"] = "train"
    """train (generate and learn, streaming) | generate (generate, score and store; no learner:
    needs trainer.store_trajectories=true) | learn (learn from offline.data; no generator)."""
    resume: bool = False
    """Continue from the newest valid checkpoint of `trainer.run_dir` (default: the newest run
    under outputs/ with one): step, weight version, optimizer, prompt cursor, unsent batches."""
