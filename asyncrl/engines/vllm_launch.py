"""Starting vLLM for a run (`engine=vllm`): the model as a Hugging Face directory (written once
into the cache where the source is another, as for SGLang: `sglang_launch.hf_directory`), vLLM's
engine arguments from `EngineConfig`, and the environment its processes start with.
`start_vllm` is what a generator calls."""

from __future__ import annotations

import contextlib
import os

from asyncrl.config import ConfigError, EngineConfig, ModelConfig
from asyncrl.engines.sglang_launch import eos_ids, hf_directory
from asyncrl.errors import StartupError

# The worker-side loaders (`asyncrl.engines.vllm_worker`), mixed into vLLM's worker class.
WORKER_EXTENSION = "asyncrl.engines.vllm_worker.WeightLoading"


def engine_args(model_path: str, model: ModelConfig, engine: EngineConfig, seed: int) -> dict:
    """vLLM's `AsyncEngineArgs` for a generator.

    * `logprobs_mode=processed_logprobs`: each sampled token's log-prob is that of the distribution
      it was drawn from (after temperature, top-k and top-p), the one the learner scores; vLLM's
      default is the raw softmax's.
    * Prefix caching on: a window re-sends its sequence's tokens so far and reads them from the
      cache. Requests carry `cache_salt` = their weight version, so no token reads KV of older weights.
    * Eager on CPU: vLLM's graph compilation costs minutes of start-up here and changes no number.
    * No chunked prefill on CPU: a seeded request whose prompt is split across steps has its
      generator rewound by an offset after each partial step, which a CPU generator lacks (vLLM
      0.32's worker dies: "CPU Generator does not use offset"). A step takes whole prompts, up to
      the model's context (as vLLM's CPU platform itself does for MLA models).
    """
    cpu = engine.device == "cpu"
    args = {"model": model_path, "dtype": model.dtype, "seed": seed, "enable_prefix_caching": True,
            "logprobs_mode": "processed_logprobs", "worker_extension_cls": WORKER_EXTENSION,
            "disable_log_stats": True, "enforce_eager": cpu, "block_size": engine.vllm_block_tokens}
    if cpu:
        args |= {"enable_chunked_prefill": False, "max_num_batched_tokens": max(context_length(model_path), 4096)}
    if engine.vllm_kv_cache_mb:
        args["kv_cache_memory_bytes"] = engine.vllm_kv_cache_mb << 20
    else:
        args["gpu_memory_utilization"] = engine.vllm_mem_fraction
    if engine.vllm_max_num_seqs:
        args["max_num_seqs"] = engine.vllm_max_num_seqs
    return args


def context_length(model_path: str) -> int:
    """The longest sequence the model directory's config allows (`max_position_embeddings`)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_path).get_text_config().max_position_embeddings)


@contextlib.contextmanager
def engine_environment(engine: EngineConfig):
    """The environment vLLM's engine-core and worker processes start with (they copy it when
    spawned); the generator's own is put back after."""
    settings = {
        # vLLM's sampler compiles its log-prob rank counter with inductor on first use: half a
        # minute of C++ build on this 2-core machine, for a reduction eager runs as exactly.
        "TORCHDYNAMO_DISABLE": "1",
        # vLLM binds its OpenMP threads to every core of the node by default; a generator shares the
        # node with its learner, so it gets `engine.threads` threads and no binding.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(engine.threads),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_vllm(model: ModelConfig, engine: EngineConfig, seed: int = 0):
    """The vLLM engine of a generator (`engine.name=vllm`), built on the running event loop."""
    from asyncrl.engines.vllm_engine import VLLMEngine

    directory = hf_directory(model)
    args, eos = engine_args(directory, model, engine, seed), eos_ids(directory)
    with engine_environment(engine):
        try:
            return VLLMEngine(args, eos)
        except Exception as exc:  # vLLM refused the model or its settings: its reason, in one line
            raise refusal(directory, exc) from exc


# vLLM ends some reasons with every name it knows (its ~300 architectures): the reason stops before it.
_ENUMERATIONS = (" Supported architectures:",)
_ENGINE_CORE_FAILED = "See root cause above"


def refusal(directory: str, exc: BaseException) -> Exception:
    """vLLM's failed start-up as one line naming the model directory and vLLM's reason: the root
    cause's message (a pydantic `ValidationError`'s, as vLLM's `ModelConfig` raises, is its
    validator's own error), its first line, without a trailing list of what vLLM supports. A
    `ConfigError` where vLLM refused the model or the settings; a `StartupError` where its engine
    process failed while starting, whose cause vLLM logged (the exception here names none)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    message = str(exc)
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            inner = (first.get("ctx") or {}).get("error")
            message = str(inner) if inner is not None else str(first.get("msg", message))
        except Exception:  # noqa: BLE001 - not pydantic's after all: its own message
            pass
    if _ENGINE_CORE_FAILED in message:
        return StartupError(f"engine=vllm: vLLM's engine process failed while starting on the model directory "
                            f"{directory} (vLLM's log above says why)")
    line = next((part.strip() for part in message.splitlines() if part.strip()), type(exc).__name__)
    for enumeration in _ENUMERATIONS:
        line = line.split(enumeration)[0]
    line = line if len(line) <= 400 else line[:400] + "..."
    return ConfigError(f"engine=vllm: vLLM cannot start on the model directory {directory}: {line}")
