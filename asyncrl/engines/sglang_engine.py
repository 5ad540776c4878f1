"""SGLang behind the engine interface (`engine=sglang`; GPU machines, e.g. the Docker image).

SGLang's offline `Engine` runs in the generator's process: its tokenizer manager on this event loop,
its scheduler and detokenizer in subprocesses. Every SGLang name used here is checked against the
pinned release's source by `tests/test_sglang_contract.py` (a renamed argument fails it), since
SGLang cannot be installed on a CPU machine.

* Each sequence's window is its own async request: the token ids so far, `max_new_tokens` = the
  window (or what is left of the response), the engine's own per-token log-probs. The radix cache
  makes the re-sent prefix cheap.
* FIRE's first token is a one-token request at the hot temperature under its top-k; the window
  continues from it at the regular settings.
* Every request carries `cache_salt` = the weight version, so no KV computed under older weights is
  reused (a `flush_cache` fails while requests run or wait: a known trap).
* Weights change between windows only (the generator applies an update when no window runs):
  pause in place, load with `weight_version`, continue. Outputs carry per-token weight-version
  spans; they become each token's version.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Iterable

import numpy as np
import torch

from asyncrl.engines.base import SamplingParams, SequenceInput, WindowOutput
from asyncrl.schema import FinishReason


class SGLangEngine:
    def __init__(self, model_path: str, eos_token_ids: Iterable[int], mem_fraction_static: float = 0.5,
                 tp_size: int = 1, seed: int = 0):
        # Imported here, never at package import: importing SGLang installs uvloop's event-loop
        # policy and sets multiprocessing's start method to spawn (docs: ecosystem §2.4).
        import sglang
        from sglang.srt.managers import io_struct

        self.io_struct = io_struct
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.engine = sglang.Engine(model_path=model_path, skip_tokenizer_init=True, tp_size=tp_size,
                                    mem_fraction_static=mem_fraction_static, random_seed=seed)
        self.loop = asyncio.get_event_loop()  # the tokenizer manager's loop: SGLang's coroutines run here
        self.loop_thread = threading.get_ident()
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    # --- generation -------------------------------------------------------------------------------

    async def generate_window(self, sequences: list[SequenceInput], window_tokens: int,
                              params: SamplingParams) -> list[WindowOutput]:
        if params.top_logprobs:
            raise ValueError("the SGLang adapter does not report top log-probs (the embedded engine does)")
        return list(await asyncio.gather(*(self._window(s, window_tokens, params) for s in sequences)))

    async def _window(self, seq: SequenceInput, window_tokens: int, params: SamplingParams) -> WindowOutput:
        prior = len(seq.response_ids)
        budget = min(window_tokens, seq.max_response_tokens - prior)
        if budget <= 0:
            raise ValueError("a sequence passed to generate_window has no response budget left")
        input_ids = np.concatenate([seq.prompt_ids, seq.response_ids]).astype(np.int64).tolist()
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        min_new = max(0, seq.min_response_tokens - prior)
        if params.first_token_temperature is not None and prior == 0:
            # FIRE: the first response token alone, at the hot temperature under its top-k guard.
            hot = self._sampling(1, params.first_token_temperature, 1.0, params.first_token_top_k, min_new,
                                 seq.seed)
            out = await self._request(input_ids, hot)
            finish = self._take(out, tokens, logprobs, versions)
            if finish is not None or budget == 1:
                return self._output(tokens, logprobs, versions, finish, prior, seq.max_response_tokens)
            input_ids, budget, min_new = input_ids + tokens, budget - 1, max(0, min_new - 1)
        regular = self._sampling(budget, params.temperature, params.top_p, params.top_k, min_new,
                                 seq.seed + prior + len(tokens))
        finish = self._take(await self._request(input_ids, regular), tokens, logprobs, versions)
        return self._output(tokens, logprobs, versions, finish, prior, seq.max_response_tokens)

    def _sampling(self, max_new_tokens: int, temperature: float, top_p: float, top_k: int, min_new_tokens: int,
                  seed: int) -> dict:
        """SGLang's sampling parameters (`sglang.srt.sampling.sampling_params.SamplingParams`)."""
        return {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                "top_k": top_k if top_k > 0 else -1, "min_new_tokens": min_new_tokens,
                "stop_token_ids": self.eos_token_ids, "skip_special_tokens": False, "sampling_seed": seed}

    async def _request(self, input_ids: list[int], sampling: dict) -> dict:
        return await self.engine.async_generate(input_ids=input_ids, sampling_params=sampling, return_logprob=True,
                                                logprob_start_len=-1, cache_salt=f"asyncrl-v{self._version}")

    def _take(self, out: dict, tokens: list[int], logprobs: list[float], versions: list[int]) -> str | None:
        """Append a request's output tokens, their log-probs and weight versions; returns how it
        ended: "stop" (an EOS token), None when it used its whole `max_new_tokens`."""
        meta = out["meta_info"]
        new = list(out["output_ids"])
        tokens += new
        logprobs += [float(entry[0]) for entry in meta["output_token_logprobs"]]
        spans = meta.get("weight_versions") or [{"version": meta["weight_version"], "start": 0, "end": len(new)}]
        for span in spans:
            versions += [int(span["version"])] * (span["end"] - span["start"])
        reason = meta["finish_reason"]
        kind = reason["type"] if isinstance(reason, dict) else reason
        if kind == "abort":
            raise RuntimeError(f"SGLang aborted a generation request: {reason}")
        return "stop" if kind == "stop" else None

    def _output(self, tokens: list[int], logprobs: list[float], versions: list[int], finish: str | None,
                prior: int, max_response_tokens: int) -> WindowOutput:
        if finish == "stop":
            reason = FinishReason.EOS
        elif prior + len(tokens) >= max_response_tokens:
            reason = FinishReason.MAX_LENGTH
        else:
            reason = FinishReason.WINDOW
        return WindowOutput(token_ids=np.asarray(tokens, dtype=np.int32), logprobs=np.asarray(logprobs, dtype=np.float32),
                            finish_reason=reason, versions=np.asarray(versions[: len(tokens)], dtype=np.int32))

    def stream_window(self, sequences, window_tokens, params):
        raise NotImplementedError("the policy endpoint streams from the embedded engine; SGLang serves generators")

    # --- weights ----------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights by tensor (CUDA IPC into SGLang's scheduler), from a worker thread (the
        generator loads off its event loop; SGLang's calls are coroutines on that loop)."""
        if threading.get_ident() == self.loop_thread:
            raise RuntimeError("SGLangEngine.update_weights blocks: call it from a worker thread")
        asyncio.run_coroutine_threadsafe(self._update(list(named_tensors), version), self.loop).result()

    async def _update(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        io, manager = self.io_struct, self.engine.tokenizer_manager
        await manager.pause_generation(io.PauseGenerationReqInput(mode="in_place"))
        try:
            payload = self.engine._serialize_tensors_per_rank(named_tensors, None)
            ok, message = await manager.update_weights_from_tensor(
                io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, flush_cache=False,
                                                   weight_version=str(version)), None)
            if not ok:
                raise RuntimeError(f"SGLang refused the weights of version {version}: {message}")
            self._version = version
        finally:
            await manager.continue_generation(io.ContinueGenerationReqInput())

    def shutdown(self) -> None:
        self.engine.shutdown()
