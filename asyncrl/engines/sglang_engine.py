"""SGLang behind the engine interface (`engine=sglang`: on the GPU torch sees, else on the CPU).

SGLang's offline `Engine` runs in the generator's process: its tokenizer manager on the
generator's event loop, its scheduler and detokenizer in subprocesses. Built by
`asyncrl.engines.sglang_launch.start_sglang`.

* Each sequence's window is its own request: the token ids so far, `max_new_tokens` = what is left
  of the window, `min_new_tokens`, the EOS ids as stop tokens, per-token log-probs. The radix cache
  makes the re-sent prefix cheap.
* Log-probs are those of the distribution each token was drawn from: top-k / top-p are cut in the
  scheduler by `TruncatedSampling` (SGLang's own returned log-probs are not renormalised after
  them); FIRE's first token is a one-token request at the hot temperature under its top-k.
* Weight updates land while requests run (`updates_mid_window`): the requests in flight are
  aborted (their tokens so far are kept, of the old version), the weights are loaded in SGLang's
  weight-update session (begin, update, end), and each request's remainder is submitted again with
  its tokens so far as prefix. Every request carries `cache_salt` = its weight version, so that
  prefix is computed again under the new weights: no token after an update attends to KV computed
  under older ones. Pausing in place would keep the old KV of running requests, and a retract
  re-reads the radix cache's old prefix (both measured: docs/gpu.md).
* Each token's version is the one SGLang's weight-version spans give it.
* `WindowOutput.scored` marks FIRE's first token and the positions where EOS was held back below a
  minimum length, as the embedded engine does (`engines.base.scored_positions`): their log-probs are
  exact, but of a distribution other than the policy's at the run's settings, and the learner
  leaves them out.
* Top log-probs (`SamplingParams.top_logprobs`) are SGLang's `top_logprobs_num`, from the same
  distribution as the sampled token's (after the cut: -inf for a token it leaves out).
* A LoRA version (`load_adapter`) is merged here, in the generator's process, into the base weights
  of its modules (read once from the model directory SGLang loaded), and the merged modules go
  through the same weight update. SGLang 0.5.23's own LoRA backends are GPU kernels (triton, csgmv,
  triton_v2, uno_cublas) or Ascend's, and its `torch_native` one pins host memory for every batch
  (`pin_memory=True`), which raises without a CUDA driver; a merged model also decodes at the base
  model's speed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

from asyncrl.engines.base import SamplingParams, SequenceInput, WindowOutput, scored_positions
from asyncrl.messages.structs import FinishReason
from asyncrl.weights.shared_memory import SharedVersion

# How long an update waits for the requests it aborted to come back before it fails.
DRAIN_TIMEOUT_S = 120.0


@dataclass
class _Tokens:
    """What one sequence's window produced so far, over one or more requests."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)  # per token, with top log-probs asked for

    def take(self, out: dict, top_n: int) -> str:
        """Append a request's output; returns SGLang's finish type (stop, length, abort)."""
        meta, new = out["meta_info"], list(out["output_ids"])
        logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
        versions = [int(span["version"]) for span in meta["weight_versions"] for _ in range(span["start"], span["end"])]
        top = [[(float(e[0]), int(e[1])) for e in entries] for entries in meta.get("output_top_logprobs") or []]
        if not len(logprobs) == len(versions) == len(new) or top_n and len(top) != len(new):
            raise RuntimeError(f"SGLang returned {len(new)} tokens, {len(logprobs)} log-probs, {len(top)} top "
                               f"log-probs and {len(versions)} versions for request {meta['id']}")
        self.ids += new
        self.logprobs += logprobs
        self.versions += versions
        self.top += top
        return meta["finish_reason"]["type"]

    def top_arrays(self, top_n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """`WindowOutput.top_ids` / `top_logprobs`: [N, top_n], most likely first."""
        if not top_n:
            return None, None
        ids = np.zeros((len(self.ids), top_n), dtype=np.int32)
        logprobs = np.full((len(self.ids), top_n), -np.inf, dtype=np.float32)
        for row, entries in enumerate(self.top):
            entries = sorted(entries, key=lambda e: -e[0])[:top_n]
            ids[row, :len(entries)] = [e[1] for e in entries]
            logprobs[row, :len(entries)] = [e[0] for e in entries]
        # SGLang clamps the log-prob of a token the cut left out to float32's lowest value: -inf here.
        logprobs[logprobs <= np.finfo(np.float32).min] = -np.inf
        return ids, logprobs


class SGLangEngine:
    # The generator hands this engine an update at once instead of between windows.
    updates_mid_window = True

    def __init__(self, server_args: dict, eos_token_ids: Iterable[int]):
        """`server_args`: SGLang's `ServerArgs` fields (`sglang_launch.server_args`)."""
        # Imported here, never at package import: importing SGLang installs uvloop's event-loop
        # policy and sets multiprocessing's start method to spawn (ecosystem §2.4).
        import sglang
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import MultiprocessingSerializer

        from asyncrl.engines.sglang_scheduler import SHARED_LOADER, TruncatedSampling

        self.eos_token_ids = sorted(set(int(i) for i in eos_token_ids))
        if not self.eos_token_ids:
            raise ValueError("an engine needs at least one EOS token id")
        self.io = io_struct
        self.serializer = MultiprocessingSerializer
        self.tp_size = int(server_args["tp_size"])
        self.model_path = server_args["model_path"]
        self._lora = None  # `asyncrl.weights.lora.AdapterMerger`, from the first adapter on
        self.truncation = TruncatedSampling.to_str()
        # The initial version as an integer string: SGLang's default is "default", and every
        # token's weight-version span carries it.
        self.engine = sglang.Engine(**server_args, weight_version="0", enable_custom_logit_processor=True,
                                    custom_weight_loader=[SHARED_LOADER])
        self._version = 0
        self._loop = _running_loop()  # SGLang's coroutines run on one loop; bound at first use if none runs here
        self._open = asyncio.Event()  # cleared while an update loads: no request starts then
        self._open.set()
        self._idle = asyncio.Event()  # set when no request is in flight
        self._idle.set()
        self._inflight: set[str] = set()
        self._cut: set[str] = set()  # requests an update aborted: continued, not failed
        self._updating = asyncio.Lock()
        # Requests sent, prefix tokens SGLang served from its cache, and the same for the requests
        # that continued a request an update cut (their cache hits must be 0: no KV of old weights).
        self.counters = {"requests": 0, "cached_tokens": 0, "continued": 0, "continued_cached_tokens": 0}

    @property
    def weight_version(self) -> int:
        return self._version

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("SGLangEngine is used from a second event loop; SGLang's coroutines run on one")

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
        out = _Tokens()
        min_new = max(0, seq.min_response_tokens - prior)
        finish = None
        # Greedy: SGLang's temperature 0 (argmax; the log-prob is that of softmax(logits)).
        regular = params.truncation
        fire = params.first_token_temperature is not None and not params.greedy
        if fire and prior == 0:
            # FIRE: the first response token alone, at the hot temperature under its top-k guard.
            finish = await self._request(context, out, 1, min_new, seq.seed,
                                         (params.first_token_temperature, params.first_token_top_k, 1.0, 0.0),
                                         params.top_logprobs)
        if finish is None and len(out.ids) < budget:
            finish = await self._request(context, out, budget - len(out.ids), max(0, min_new - len(out.ids)),
                                         seq.seed, regular, params.top_logprobs)
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

    async def _request(self, context: list[int], out: _Tokens, max_new: int, min_new: int, seed: int,
                       setting: tuple[float, int, float, float], top_n: int = 0) -> str | None:
        """Up to `max_new` tokens after `context + out.ids`, appended to `out`. A request cut by a
        weight update continues from its last token under the new weights. Returns "stop" (EOS) or
        None (the budget used)."""
        start = len(out.ids)
        continued = False
        while True:
            done = len(out.ids) - start
            rid, result = await self._submit(context + out.ids, self._sampling(max_new - done, max(0, min_new - done),
                                                                              seed, setting), top_n)
            # A request aborted before the scheduler took it has no `cached_tokens`: nothing was read.
            self._count(result["meta_info"].get("cached_tokens", 0), continued)
            kind = out.take(result, top_n)
            cut = rid in self._cut
            self._cut.discard(rid)
            if kind == "abort":
                if not cut:
                    raise RuntimeError(f"SGLang aborted a generation request: {result['meta_info']['finish_reason']}")
                if len(out.ids) - start < max_new:
                    continued = True
                    continue
                return None
            return "stop" if kind == "stop" else None

    def _count(self, cached_tokens: int, continued: bool) -> None:
        self.counters["requests"] += 1
        self.counters["cached_tokens"] += cached_tokens
        if continued:
            self.counters["continued"] += 1
            self.counters["continued_cached_tokens"] += cached_tokens

    def _sampling(self, max_new: int, min_new: int, seed: int, setting: tuple[float, int, float, float],
                  adjust: SamplingParams | None = None) -> dict:
        """SGLang's sampling parameters (`sglang.srt.sampling.sampling_params.SamplingParams`) for
        `setting` (temperature, top-k, top-p, min-p). Its own top-k / top-p / min-p stay off:
        `TruncatedSampling` cuts the logits (`custom_params`), as our sampler does."""
        from asyncrl.engines.sglang_scheduler import truncation

        temperature, top_k, top_p, min_p = setting
        sampling = {"max_new_tokens": max_new, "min_new_tokens": min(min_new, max_new), "temperature": temperature,
                    "stop_token_ids": self.eos_token_ids, "sampling_seed": seed}
        if adjust is not None and adjust.adjusts_logits:  # the policy endpoint's penalties and bias
            sampling.update(presence_penalty=adjust.presence_penalty, frequency_penalty=adjust.frequency_penalty,
                            logit_bias={str(i): b for i, b in adjust.logit_bias} or None)
        if temperature > 0 and (top_k > 0 or top_p < 1.0 or min_p > 0):
            sampling["custom_params"] = truncation(temperature, top_k, top_p, min_p)
        return sampling

    async def _submit(self, input_ids: list[int], sampling: dict, top_n: int = 0) -> tuple[str, dict]:
        await self._open.wait()
        rid = uuid.uuid4().hex
        self._inflight.add(rid)
        self._idle.clear()
        try:
            return rid, await self.engine.async_generate(
                input_ids=input_ids, sampling_params=sampling, return_logprob=True, logprob_start_len=-1, rid=rid,
                top_logprobs_num=top_n,
                cache_salt=f"asyncrl-v{self._version}",
                custom_logit_processor=self.truncation if "custom_params" in sampling else None)
        finally:
            self._inflight.discard(rid)
            if not self._inflight:
                self._idle.set()

    def stream_window(self, sequences, window_tokens, params):
        raise NotImplementedError("SGLangEngine streams whole responses (`stream`, the policy endpoint's); "
                                  "generators advance windows (generate_window)")

    def stream(self, sequences: list[SequenceInput], params: SamplingParams):
        """Whole responses of `sequences`, streamed as SGLang samples them (the policy endpoint):
        `asyncrl.engines.sglang_stream.SGLangSteps`. Continuous batching is SGLang's own."""
        from asyncrl.engines.sglang_stream import SGLangSteps

        self._bind()
        return SGLangSteps(self, sequences, params)

    @property
    def context_tokens(self) -> int:
        """The model's context length, as SGLang's tokenizer manager checks it."""
        return int(self.engine.tokenizer_manager.context_len)

    # --- weights ----------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights by tensor (CUDA IPC handles on a GPU, shared memory on CPU) while
        requests run. Called from a worker thread: SGLang's calls are coroutines on its loop."""
        self._run(self._load(list(named_tensors), version))

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter, version: int) -> None:
        """A LoRA version: merged here into the base of its modules (`asyncrl.weights.lora.AdapterMerger`),
        then loaded like any version (only the adapted modules' weights)."""
        from asyncrl.weights.lora import AdapterMerger, adapter_modules

        tensors = {name: t.clone() for name, t in named_tensors}
        if self._lora is None:
            self._lora = AdapterMerger(_read_weights(self.model_path, [m + ".weight" for m in adapter_modules(tensors)]))
        self._run(self._load(list(self._lora.merged(tensors, adapter.scaling)), version))

    def adopt_shared(self, shared: SharedVersion, version: int) -> None:
        """Load a version from the node's shared-memory slot (`asyncrl.weights.shared_memory.SharedSlots`):
        SGLang's scheduler maps the file and copies from it (`sglang_scheduler.load_shared`)."""
        from asyncrl.engines.sglang_scheduler import SHARED_LOADER, shared_payload

        self._run(self._load(shared_payload(shared), version, SHARED_LOADER))

    def _run(self, coroutine) -> None:
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("SGLangEngine has no event loop yet: build it in a running loop or generate first")
        if _running_loop() is self._loop:
            coroutine.close()
            raise RuntimeError("SGLangEngine's weight updates block: call them from a worker thread")
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _load(self, named: list, version: int, load_format: str | None = None) -> None:
        io, manager = self.io, self.engine.tokenizer_manager
        async with self._updating:
            self._open.clear()
            try:
                await self._cut_running()
                payload = [self.serializer.serialize(named) for _ in range(self.tp_size)]
                await _succeed(manager.begin_weight_update(io.BeginWeightUpdateReqInput(), None), "begin_weight_update")
                try:
                    await _succeed(manager.update_weights_from_tensor(io.UpdateWeightsFromTensorReqInput(
                        serialized_named_tensors=payload, load_format=load_format, flush_cache=False,
                        weight_version=str(version)), None),
                        f"update_weights_from_tensor (version {version})")
                finally:
                    await _succeed(manager.end_weight_update(io.EndWeightUpdateReqInput(), None), "end_weight_update")
                self._version = version
            finally:
                self._open.set()

    async def _cut_running(self) -> None:
        """Abort every request in flight and wait until all came back. A request submitted just
        before may reach the scheduler after an abort: aborting again until none is left catches it."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self._inflight:
            self._cut |= self._inflight
            self.engine.tokenizer_manager.abort_request(abort_all=True)
            try:
                await asyncio.wait_for(self._idle.wait(), 0.05)
            except asyncio.TimeoutError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SGLang did not return {len(self._inflight)} aborted requests in "
                                       f"{DRAIN_TIMEOUT_S:.0f} s; the weight update is not applied") from None

    def shutdown(self) -> None:
        self.engine.shutdown()


def _read_weights(directory: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors of a Hugging Face directory by name, read from its safetensors files."""
    import glob
    import os

    from safetensors import safe_open

    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            out.update({name: f.get_tensor(name) for name in names if name in f.keys()})
    missing = sorted(set(names) - set(out))
    if missing:
        raise KeyError(f"{directory} has no weights {missing[:3]}: the adapter names modules the model lacks")
    return out


async def _succeed(call, what: str) -> None:
    ok, message = await call
    if not ok:
        raise RuntimeError(f"SGLang refused {what}: {message}")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
