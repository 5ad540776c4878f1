"""vLLM behind the engine interface (`engine=vllm`; built by `asyncrl.engines.vllm_launch.start_vllm`).

vLLM's `AsyncLLM` runs in the generator's process: its request handling on the generator's event
loop, its engine core and worker in subprocesses.

* Each sequence's window is its own request: the token ids so far, `max_tokens` = what is left of
  the window, `min_tokens`, the EOS ids as stop tokens, the sampled token's log-prob (`logprobs=0`),
  outputs streamed as deltas. Prefix caching makes the re-sent prefix cheap.
* Log-probs are those of the distribution each token was drawn from: vLLM runs with
  `logprobs_mode=processed_logprobs` (after temperature, top-k, top-p), the distribution the learner
  scores. FIRE's first token is a one-token request at the hot temperature under its top-k.
* A request's seed is the sequence's seed hashed with its response length so far
  (`asyncrl.algo.sampling.choice_seed`): a regenerated sample draws the same tokens, and a later
  window does not replay the random numbers of an earlier one.
* Weight updates land while requests run (`updates_mid_window`): the requests in flight are
  aborted (their tokens so far are kept, of the old version), the version is loaded in vLLM's
  worker (`asyncrl.engines.vllm_worker`), and each request's remainder is submitted again with
  its tokens so far as prefix. Every request carries `cache_salt` = its weight version and the
  prefix cache is reset after each load, so no token after an update attends to KV computed under
  older weights. Every token's version is the one its request was submitted under: a load starts
  only once no request is in flight.
* `WindowOutput.scored` marks FIRE's first token and the positions where EOS was held back, as the
  other engines do (`engines.base.scored_positions`).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Iterable

import msgspec
import numpy as np
import torch

from asyncrl.algo.sampling import choice_seed
from asyncrl.engines.base import SamplingParams, SequenceInput, WindowOutput, scored_positions
from asyncrl.messages.structs import FinishReason
from asyncrl.weights.shared_memory import SharedVersion

# How long an update waits for the requests it aborted to come back before it fails.
DRAIN_TIMEOUT_S = 120.0


@dataclass
class _Deltas:
    """What one sequence's window produced so far, over one or more requests."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)  # per token, with top log-probs asked for

    def take(self, completion, version: int, top_n: int) -> None:
        """Append a streamed delta (vLLM's `CompletionOutput`) generated under `version`."""
        new = [int(t) for t in completion.token_ids]
        positions = completion.logprobs or []
        if len(positions) != len(new):
            raise RuntimeError(f"vLLM returned {len(new)} tokens and {len(positions)} log-probs")
        for token, entries in zip(new, positions):
            self.logprobs.append(float(entries[token].logprob))
            if top_n:
                ranked = sorted(((float(e.logprob), int(t)) for t, e in entries.items()), key=lambda e: -e[0])
                self.top.append(ranked[:top_n])
        self.ids += new
        self.versions += [version] * len(new)

    def top_arrays(self, top_n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """`WindowOutput.top_ids` / `top_logprobs`: [N, top_n], most likely first."""
        if not top_n:
            return None, None
        ids = np.zeros((len(self.ids), top_n), dtype=np.int32)
        logprobs = np.full((len(self.ids), top_n), -np.inf, dtype=np.float32)
        for row, entries in enumerate(self.top):
            ids[row, :len(entries)] = [e[1] for e in entries]
            logprobs[row, :len(entries)] = [e[0] for e in entries]
        return ids, logprobs


class VLLMEngine:
    # The generator hands this engine an update at once instead of between windows.
    updates_mid_window = True

    def __init__(self, engine_args: dict, eos_token_ids: Iterable[int]):
        """`engine_args`: vLLM's `AsyncEngineArgs` fields (`vllm_launch.engine_args`)."""
        # Imported here, never at package import: vLLM exists only in .venv-vllm.
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.eos_token_ids = sorted(set(int(i) for i in eos_token_ids))
        if not self.eos_token_ids:
            raise ValueError("an engine needs at least one EOS token id")
        self.model_path = engine_args["model"]
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
        self._version = 0
        self._loop = _running_loop()  # vLLM's coroutines run on one loop; bound at first use if none runs here
        self._open = asyncio.Event()  # cleared while an update loads: no request starts then
        self._open.set()
        self._idle = asyncio.Event()  # set when no request is in flight
        self._idle.set()
        self._inflight: set[str] = set()
        self._cut: set[str] = set()  # requests an update aborted: continued, not failed
        self._updating = asyncio.Lock()
        # Requests sent, prefix tokens vLLM served from its cache, and the same for the requests
        # that continued a request an update cut (their cache hits must be 0: no KV of old weights).
        self.counters = {"requests": 0, "cached_tokens": 0, "continued": 0, "continued_cached_tokens": 0}

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def context_tokens(self) -> int:
        """The longest sequence (prompt and response) vLLM takes."""
        return int(self.engine.model_config.max_model_len)

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("VLLMEngine is used from a second event loop; vLLM's coroutines run on one")

    # --- generation -------------------------------------------------------------------------------

    async def generate_window(self, sequences: list[SequenceInput], window_tokens: int,
                              params: SamplingParams) -> list[WindowOutput]:
        self._bind()
        return list(await asyncio.gather(*(self._window(s, window_tokens, params) for s in sequences)))

    async def _window(self, seq: SequenceInput, window_tokens: int, params: SamplingParams) -> WindowOutput:
        prior = len(seq.response_ids)
        budget = min(window_tokens, seq.max_response_tokens - prior)
        if budget <= 0:
            raise ValueError("a sequence passed to generate_window has no response budget left")
        context = np.concatenate([seq.prompt_ids, seq.response_ids]).astype(np.int64).tolist()
        out = _Deltas()
        min_new = max(0, seq.min_response_tokens - prior)
        finish = None
        fire = params.first_token_temperature is not None and not params.greedy
        if fire and prior == 0:
            # FIRE: the first response token alone, at the hot temperature under its top-k guard.
            hot = (params.first_token_temperature, params.first_token_top_k, 1.0, 0.0)
            finish = await self._request(context, out, 1, min_new, (seq.seed, prior), hot, params)
        if finish is None and len(out.ids) < budget:
            finish = await self._request(context, out, budget - len(out.ids), max(0, min_new - len(out.ids)),
                                         (seq.seed, prior), params.truncation, params)
        if finish == "stop":
            reason = FinishReason.EOS
        elif prior + len(out.ids) >= seq.max_response_tokens:
            reason = FinishReason.MAX_LENGTH
        else:
            reason = FinishReason.WINDOW
        scored = scored_positions(torch.tensor([prior]), torch.tensor([seq.min_response_tokens]), len(out.ids), fire)
        top_ids, top_logprobs = out.top_arrays(params.top_logprobs)
        return WindowOutput(token_ids=np.asarray(out.ids, dtype=np.int32),
                            logprobs=np.asarray(out.logprobs, dtype=np.float32), finish_reason=reason,
                            versions=np.asarray(out.versions, dtype=np.int32),
                            scored=None if scored is None else scored[0].numpy().copy(),
                            top_ids=top_ids, top_logprobs=top_logprobs)

    async def _request(self, context: list[int], out: _Deltas, max_new: int, min_new: int, seed: tuple[int, int],
                       setting: tuple[float, int, float, float], params: SamplingParams) -> str | None:
        """Up to `max_new` tokens after `context + out.ids`, appended to `out`. A request cut by a
        weight update continues from its last token under the new weights. `seed`: the sequence's
        seed and its response length before `out`. Returns "stop" (EOS) or None (the budget used)."""
        start = len(out.ids)
        continued = False
        while True:
            done = len(out.ids) - start
            sampling = self._sampling(max_new - done, max(0, min_new - done),
                                      choice_seed(seed[0], seed[1] + len(out.ids)), setting, params)
            rid, finish, cached = await self._submit(context + out.ids, sampling, out, params.top_logprobs)
            self._count(cached, continued)
            cut = rid in self._cut
            self._cut.discard(rid)
            if finish == "abort":
                if not cut:
                    raise RuntimeError("vLLM aborted a generation request that no weight update cut")
                if len(out.ids) - start < max_new:
                    continued = True
                    continue
                return None
            return "stop" if finish == "stop" else None

    def _count(self, cached_tokens: int, continued: bool) -> None:
        self.counters["requests"] += 1
        self.counters["cached_tokens"] += cached_tokens
        if continued:
            self.counters["continued"] += 1
            self.counters["continued_cached_tokens"] += cached_tokens

    def _sampling(self, max_new: int, min_new: int, seed: int, setting: tuple[float, int, float, float],
                  adjust: SamplingParams):
        """vLLM's `SamplingParams` for `setting` (temperature, top-k, top-p, min-p; temperature 0 is
        greedy), the sampled token's log-prob and `adjust.top_logprobs` alternatives, streamed as deltas."""
        from vllm import SamplingParams as VLLMSampling
        from vllm.sampling_params import RequestOutputKind

        temperature, top_k, top_p, min_p = setting
        extra = {}
        if adjust.adjusts_logits:  # the policy endpoint's penalties and bias
            extra = {"presence_penalty": adjust.presence_penalty, "frequency_penalty": adjust.frequency_penalty,
                     "logit_bias": {int(i): float(b) for i, b in adjust.logit_bias} or None}
        return VLLMSampling(max_tokens=max_new, min_tokens=min(min_new, max_new), temperature=temperature,
                            top_k=int(top_k), top_p=float(top_p), min_p=float(min_p), seed=seed,
                            stop_token_ids=self.eos_token_ids, logprobs=adjust.top_logprobs, detokenize=False,
                            output_kind=RequestOutputKind.DELTA, **extra)

    async def _submit(self, input_ids: list[int], sampling, out: _Deltas, top_n: int) -> tuple[str, str | None, int]:
        """One request, its deltas appended to `out` as they come: (its id, vLLM's finish reason,
        its prefix tokens read from the cache)."""
        await self._open.wait()
        rid = uuid.uuid4().hex
        version = self._version  # no load starts while this request is in flight: all its tokens are of it
        self._inflight.add(rid)
        self._idle.clear()
        finish, cached = None, 0
        try:
            prompt = {"prompt_token_ids": input_ids, "cache_salt": f"asyncrl-v{version}"}
            async for output in self.engine.generate(prompt, sampling, request_id=rid):
                completion = output.outputs[0]
                out.take(completion, version, top_n)
                finish = completion.finish_reason or finish
                cached = output.num_cached_tokens or cached
            return rid, finish, cached
        finally:
            self._inflight.discard(rid)
            if not self._inflight:
                self._idle.set()

    def stream_window(self, sequences, window_tokens, params):
        raise NotImplementedError("VLLMEngine advances generators' windows (generate_window); the policy "
                                  "endpoint does not run on vLLM yet")

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

    def load_adapter(self, named_tensors, adapter, version: int) -> None:
        raise NotImplementedError("engine=vllm takes whole versions; model.lora_rank > 0 is refused at start-up")

    def _run(self, coroutine) -> None:
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("VLLMEngine has no event loop yet: build it in a running loop or generate first")
        if _running_loop() is self._loop:
            coroutine.close()
            raise RuntimeError("VLLMEngine's weight updates block: call them from a worker thread")
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _load(self, method: str, args: tuple, version: int) -> None:
        """Cut the requests in flight, load in the worker, drop the prefix cache, set the version."""
        async with self._updating:
            self._open.clear()
            try:
                cut = set(self._inflight)
                self._cut |= cut
                if cut:
                    await self.engine.abort(sorted(cut))
                await asyncio.wait_for(self._idle.wait(), DRAIN_TIMEOUT_S)
                await self.engine.collective_rpc(method, args=args)
                # The salt keeps old KV from being read; resetting frees its blocks at once.
                await self.engine.reset_prefix_cache()
                await self.engine.update_weight_version(str(version))
                self._version = version
            finally:
                self._open.set()

    def shutdown(self) -> None:
        self.engine.shutdown()
        # vLLM cancels its output handler through the loop; a loop that is not running (a test's,
        # between calls) runs once more so the task ends before the loop is closed.
        if self._loop is not None and not self._loop.is_running() and not self._loop.is_closed():
            self._loop.run_until_complete(asyncio.sleep(0.1))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
