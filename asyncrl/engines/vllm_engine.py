"""vLLM behind the engine interface (`engine=vllm`; built by `asyncrl.engines.vllm_launch.start_vllm`).

vLLM's `AsyncLLM` runs in the generator's process: its request handling on the generator's event
loop, its engine core and worker in subprocesses.

Windows, FIRE, minimum lengths and weight updates mid-request are `server_engine.ServerEngine`'s;
here, vLLM's side of them:

* A window's request: `max_tokens` = what is left of the window, `min_tokens`, the EOS ids as stop
  tokens, the sampled token's log-prob (`logprobs=0`), outputs streamed as deltas.
* Log-probs are those of the distribution each token was drawn from: vLLM runs with
  `logprobs_mode=processed_logprobs` (after penalties, temperature, top-k, top-p, min-p), the
  distribution the learner scores.
* A request's seed is the sequence's seed hashed with its response length so far
  (`asyncrl.algo.sampling.choice_seed`): a regenerated sample draws the same tokens, and a later
  window does not replay the random numbers of an earlier one.
* A weight update aborts the requests in flight, loads the version in vLLM's worker
  (`asyncrl.engines.vllm_worker`) and resets the prefix cache, so the old KV's blocks are freed at
  once. Every token's version is the one its request was submitted under.
* The policy endpoint's rows (`stream`, `VLLMSteps`) are requests of the same kind, each delta
  handed on as it comes; a row dropped or a client gone cancels its request, which vLLM aborts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Iterable

import msgspec
import torch

from asyncrl.algo.sampling import choice_seed
from asyncrl.engines.base import SamplingParams, SequenceInput
from asyncrl.engines.batch_jobs import StepToken
from asyncrl.engines.server_engine import ServerEngine, Setting, WindowTokens, read_weights
from asyncrl.engines.server_stream import RequestSteps
from asyncrl.messages.structs import FinishReason
from asyncrl.weights.shared_memory import SharedVersion


def take_delta(out: WindowTokens, completion, version: int, top_n: int) -> None:
    """Append a streamed delta (vLLM's `CompletionOutput`) generated under `version` to `out`."""
    new = [int(t) for t in completion.token_ids]
    positions = completion.logprobs or []
    if len(positions) != len(new):
        raise RuntimeError(f"vLLM returned {len(new)} tokens and {len(positions)} log-probs")
    for token, entries in zip(new, positions):
        out.logprobs.append(float(entries[token].logprob))
        if top_n:
            out.top.append([(float(e.logprob), int(t)) for t, e in entries.items()])
    out.ids += new
    out.versions += [version] * len(new)


@dataclass
class StreamedRow(WindowTokens):
    """A policy-endpoint row's tokens: each delta is also handed on to its job's queue as it comes."""

    row: int = 0
    queue: asyncio.Queue | None = None
    top_n: int = 0

    def hand_on(self, new: int, finish: str | None) -> None:
        """The last `new` tokens as `StepToken`s; the row's last carries its end (vLLM's "stop" is
        EOS, "length" its budget)."""
        top_n = self.top_n
        first = len(self.ids) - new
        steps = []
        for j in range(first, len(self.ids)):
            top = None
            if top_n:
                ranked = sorted(self.top[j], key=lambda e: -e[0])[:top_n]
                top = ([e[1] for e in ranked], [e[0] if e[0] > -3.0e38 else float("-inf") for e in ranked])
            steps.append(StepToken(self.row, self.ids[j], self.logprobs[j], None, top, self.versions[j]))
        if steps and finish in ("stop", "length"):
            last = steps[-1]
            reason = FinishReason.EOS if finish == "stop" else FinishReason.MAX_LENGTH
            steps[-1] = StepToken(last.row, last.token, last.logprob, reason, last.top, last.version)
        if steps:
            self.queue.put_nowait(steps)


class VLLMSteps(RequestSteps):
    """A job's rows as vLLM requests (`RequestSteps`), the run's sampling settings of a window's
    request with the endpoint's penalties, bias and alternatives."""

    async def _generate(self, i: int, seq: SequenceInput) -> None:
        context = [int(t) for t in seq.prompt_ids] + [int(t) for t in seq.response_ids]
        prior = len(seq.response_ids)
        row = StreamedRow(row=i, queue=self.queue, top_n=self.params.top_logprobs)
        await self.engine._request(context, row, seq.max_response_tokens - prior, 0, (seq.seed, prior),  # noqa: SLF001
                                   self.params.truncation, self.params)


class VLLMEngine(ServerEngine):
    server = "vLLM"
    loads_whole_versions = True

    def __init__(self, engine_args: dict, eos_token_ids: Iterable[int]):
        """`engine_args`: vLLM's `AsyncEngineArgs` fields (`vllm_launch.engine_args`)."""
        # Imported here, never at package import: vLLM exists only in .venv-vllm.
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        super().__init__(eos_token_ids)
        self.model_path = engine_args["model"]
        self._lora = None  # `asyncrl.weights.lora.AdapterMerger` over every base weight, from the first adapter on
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))

    @property
    def context_tokens(self) -> int:
        """The longest sequence (prompt and response) vLLM takes."""
        return int(self.engine.model_config.max_model_len)

    @property
    def kv_positions(self) -> int:
        """Token positions vLLM's KV cache holds (its blocks, as its engine core sized them)."""
        cache = self.engine.vllm_config.cache_config
        return int(cache.num_gpu_blocks or 0) * int(cache.block_size) or (1 << 62)

    # --- generation -------------------------------------------------------------------------------

    def _request_seed(self, seed: int, position: int) -> int:
        return choice_seed(seed, position)

    def _sampling(self, max_new: int, min_new: int, seed: int, setting: Setting, params: SamplingParams):
        """vLLM's `SamplingParams` for `setting` (temperature, top-k, top-p, min-p; temperature 0 is
        greedy), the sampled token's log-prob and `params.top_logprobs` alternatives, streamed as deltas."""
        from vllm import SamplingParams as VLLMSampling
        from vllm.sampling_params import RequestOutputKind

        temperature, top_k, top_p, min_p = setting
        extra = {}
        if params.adjusts_logits:  # the policy endpoint's penalties and bias
            extra = {"presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
                     "logit_bias": {int(i): float(b) for i, b in params.logit_bias} or None}
        return VLLMSampling(max_tokens=max_new, min_tokens=min(min_new, max_new), temperature=temperature,
                            top_k=int(top_k), top_p=float(top_p), min_p=float(min_p), seed=seed,
                            stop_token_ids=self.eos_token_ids, logprobs=params.top_logprobs, detokenize=False,
                            output_kind=RequestOutputKind.DELTA, **extra)

    async def _send(self, rid: str, input_ids: list[int], sampling, out: WindowTokens, top_n: int,
                    version: int) -> tuple[str | None, int]:
        finish, cached = None, 0
        prompt = {"prompt_token_ids": input_ids, "cache_salt": f"asyncrl-v{version}"}
        async for output in self.engine.generate(prompt, sampling, request_id=rid):
            completion = output.outputs[0]
            take_delta(out, completion, version, top_n)
            if isinstance(out, StreamedRow):
                out.hand_on(len(completion.token_ids), completion.finish_reason)
            finish = completion.finish_reason or finish
            cached = output.num_cached_tokens or cached
        return finish, cached

    async def _abort_inflight(self) -> None:
        await self.engine.abort(sorted(self._inflight))

    def stream_window(self, sequences, window_tokens, params):
        raise NotImplementedError("VLLMEngine streams whole responses (`stream`, the policy endpoint's); "
                                  "generators advance windows (generate_window)")

    def stream(self, sequences: list[SequenceInput], params: SamplingParams) -> VLLMSteps:
        """Whole responses of `sequences`, streamed as vLLM samples them (the policy endpoint).
        Continuous batching is vLLM's own."""
        self._bind()
        return VLLMSteps(self, sequences, params)

    # --- weights ----------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load a whole version, its tensors carried through vLLM's RPC, while requests run. Called
        from a worker thread: vLLM's calls are coroutines on its loop."""
        from safetensors.torch import save

        blob = save({name: t.detach().to("cpu").contiguous() for name, t in named_tensors})
        self._run(self._load("asyncrl_load_tensors", (blob,), version))

    def adopt_shared(self, shared: SharedVersion, version: int) -> None:
        """Load a version from the node's shared-memory slot: vLLM's worker maps the file and reads
        from it (`vllm_worker.WeightLoading.asyncrl_load_shared`)."""
        self._run(self._load("asyncrl_load_shared", (msgspec.msgpack.encode(shared),), version))

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter, version: int) -> None:
        """A LoRA version: merged here into the base weights of the model directory
        (`asyncrl.weights.lora.AdapterMerger`, never into an earlier version), then loaded as a whole
        version. vLLM's CPU build repacks every layer at a reload (`vllm_worker`), so the modules the
        adapter leaves go along unchanged. vLLM's own LoRA serving (a `LoRARequest` per request, the
        adapter read from disk per version) is not used: merged, the forward is the base model's own."""
        from asyncrl.weights.lora import AdapterMerger, adapted_weight, adapter_modules

        tensors = {name: t.clone() for name, t in named_tensors}
        if self._lora is None:
            if any(not adapted_weight(m).endswith(".weight") for m in adapter_modules(tensors)):
                raise NotImplementedError("LoRA on the fused experts needs engine=torch")  # refused at start-up too
            self._lora = AdapterMerger(read_weights(self.model_path))
        whole = dict(self._lora.base)
        whole.update(self._lora.merged(tensors, adapter.scaling))
        self.update_weights(whole.items(), version)

    async def _load(self, method: str, args: tuple, version: int) -> None:
        """Load in the worker, drop the prefix cache (the salt keeps old KV from being read;
        resetting frees its blocks at once), stamp the version."""
        async def load():
            await self.engine.collective_rpc(method, args=args)
            await self.engine.reset_prefix_cache()
            await self.engine.update_weight_version(str(version))

        await self._swap(load, version)

    def shutdown(self) -> None:
        self.engine.shutdown()
        # vLLM cancels its output handler through the loop; a loop that is not running (a test's,
        # between calls) runs once more so the task ends before the loop is closed.
        if self._loop is not None and not self._loop.is_running() and not self._loop.is_closed():
            self._loop.run_until_complete(asyncio.sleep(0.1))
