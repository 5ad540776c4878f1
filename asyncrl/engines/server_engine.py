"""What SGLang's and vLLM's engines share behind the engine interface (`ServerEngine`, the base of
`sglang_engine.SGLangEngine` and `vllm_engine.VLLMEngine`): an inference server's engine running in
the generator's process, its coroutines on the generator's event loop.

* Each sequence's window is its own request: its tokens so far, at most what is left of the
  window, the EOS ids as stop tokens. The server's prefix cache makes the re-sent prefix cheap.
  FIRE's first token is a one-token request at the hot temperature under its top-k.
* Weight updates land while requests run (`updates_mid_window`): no request starts while one
  loads; the requests in flight are aborted (their tokens so far are kept, of the old version) and
  each continues from its last token under the new weights once the version is loaded. Every
  request carries `cache_salt` = its weight version, so no token after an update attends to KV
  computed under older weights; the counters show it (`continued_cached_tokens` stays 0).
* `WindowOutput.scored` marks FIRE's first token and the positions where EOS was held back below a
  minimum length (`engines.base.scored_positions`): their log-probs are exact, but of a
  distribution other than the policy's at the run's settings, and the learner leaves them out.

A subclass says how one request is sent and read (`_send`), its sampling settings as its server
takes them (`_sampling`), how requests in flight are aborted (`_abort_inflight`), and the seed of
a request (`_request_seed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

from asyncrl.engines.base import SamplingParams, SequenceInput, WindowOutput, scored_positions
from asyncrl.messages.routes import joined_routes
from asyncrl.messages.structs import FinishReason
from asyncrl.weights import delta as weights_delta
from asyncrl.weights.sync import WeightTransferError

# How long an update waits for the requests it aborted to come back before it fails.
DRAIN_TIMEOUT_S = 120.0
# (temperature, top-k, top-p, min-p), as `SamplingParams.truncation` gives them.
Setting = tuple[float, int, float, float]


@dataclass
class WindowTokens:
    """What one sequence's window produced so far, over one or more requests."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)  # per token, with top log-probs asked for
    # Per request, a mixture-of-experts model's routes of its tokens (None: not recorded) and its token count.
    routes: list[tuple[np.ndarray | None, int]] = field(default_factory=list)

    def top_arrays(self, top_n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """`WindowOutput.top_ids` / `top_logprobs`: [N, top_n], most likely first; -inf for a token
        the cut left out (a server may clamp it to float32's lowest value)."""
        if not top_n:
            return None, None
        ids = np.zeros((len(self.ids), top_n), dtype=np.int32)
        logprobs = np.full((len(self.ids), top_n), -np.inf, dtype=np.float32)
        for row, entries in enumerate(self.top):
            entries = sorted(entries, key=lambda e: -e[0])[:top_n]
            ids[row, :len(entries)] = [e[1] for e in entries]
            logprobs[row, :len(entries)] = [e[0] for e in entries]
        logprobs[logprobs <= np.finfo(np.float32).min] = -np.inf
        return ids, logprobs


class ServerEngine:
    # The generator hands this engine an update at once instead of between windows.
    updates_mid_window = True
    server = "the server"  # its name in messages
    # True: every tensor of a version is loaded at each update (vLLM's CPU build repacks every
    # layer at a reload); False: the server takes some tensors and keeps the rest (SGLang).
    loads_whole_versions = False

    def __init__(self, eos_token_ids: Iterable[int]):
        self.eos_token_ids = sorted(set(int(i) for i in eos_token_ids))
        if not self.eos_token_ids:
            raise ValueError("an engine needs at least one EOS token id")
        self._version = 0
        self._loop = running_loop()  # the server's coroutines run on one loop; bound at first use if none runs here
        self._open = asyncio.Event()  # cleared while an update loads: no request starts then
        self._open.set()
        self._idle = asyncio.Event()  # set when no request is in flight
        self._idle.set()
        self._inflight: set[str] = set()
        self._cut: set[str] = set()  # requests an update aborted: continued, not failed
        self._updating = asyncio.Lock()
        # Requests sent, prefix tokens the server read from its cache, and the same for the requests
        # that continued a request an update cut (their cache hits must be 0: no KV of old weights).
        self.counters = {"requests": 0, "cached_tokens": 0, "continued": 0, "continued_cached_tokens": 0}
        # `policy.weight_delta`: (version, weights) of the whole version deltas change; a server's
        # loaded weights cannot be read back, so the generator keeps this copy.
        self._held: tuple[int, dict[str, torch.Tensor]] | None = None

    @property
    def weight_version(self) -> int:
        return self._version

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(f"{type(self).__name__} is used from a second event loop; {self.server}'s "
                               "coroutines run on one")

    # --- what a subclass says -----------------------------------------------------------------------

    async def _send(self, rid: str, input_ids: list[int], sampling, out: WindowTokens, top_n: int,
                    version: int) -> tuple[str | None, int]:
        """One request, its tokens appended to `out`: (its finish: "stop" for EOS, "abort", or
        another; the prefix tokens read from the cache)."""
        raise NotImplementedError

    def _sampling(self, max_new: int, min_new: int, seed: int, setting: Setting, params: SamplingParams):
        raise NotImplementedError

    async def _abort_inflight(self) -> None:
        raise NotImplementedError

    def _request_seed(self, seed: int, position: int) -> int:
        """The seed of a request that starts at response position `position`."""
        return seed

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
        out = WindowTokens()
        min_new = max(0, seq.min_response_tokens - prior)
        finish = None
        fire = params.first_token_temperature is not None and not params.greedy
        if fire and prior == 0:
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
                            top_ids=top_ids, top_logprobs=top_logprobs, routes=joined_routes(out.routes))

    async def _request(self, context: list[int], out: WindowTokens, max_new: int, min_new: int,
                       seed: tuple[int, int], setting: Setting, params: SamplingParams) -> str | None:
        """Up to `max_new` tokens after `context + out.ids`, appended to `out`. A request cut by a
        weight update continues from its last token under the new weights. `seed`: the sequence's
        seed and its response length before `out`. Returns "stop" (EOS) or None (the budget used)."""
        start = len(out.ids)
        continued = False
        while True:
            done = len(out.ids) - start
            sampling = self._sampling(max_new - done, max(0, min_new - done),
                                      self._request_seed(seed[0], seed[1] + len(out.ids)), setting, params)
            async with self._tracked() as (rid, version):
                finish, cached = await self._send(rid, context + out.ids, sampling, out, params.top_logprobs, version)
            self._count(cached, continued)
            cut = rid in self._cut
            self._cut.discard(rid)
            if finish == "abort":
                if not cut:
                    raise RuntimeError(f"{self.server} aborted a generation request that no weight update cut")
                if len(out.ids) - start < max_new:
                    continued = True
                    continue
                return None
            return "stop" if finish == "stop" else None

    @contextlib.asynccontextmanager
    async def _tracked(self):
        """A request's id and weight version, in flight for its duration: it starts only while no
        update loads, and an update cuts it and waits for it before loading, so all its tokens are
        of that version."""
        await self._open.wait()
        rid = uuid.uuid4().hex
        self._inflight.add(rid)
        self._idle.clear()
        try:
            yield rid, self._version
        finally:
            self._inflight.discard(rid)
            if not self._inflight:
                self._idle.set()

    def _count(self, cached_tokens: int, continued: bool) -> None:
        self.counters["requests"] += 1
        self.counters["cached_tokens"] += cached_tokens
        if continued:
            self.counters["continued"] += 1
            self.counters["continued_cached_tokens"] += cached_tokens

    # --- weights ----------------------------------------------------------------------------------

    def _run(self, coroutine) -> None:
        """Run `coroutine` on the server's loop and wait for it: weight updates are called from a
        worker thread, the server's calls are coroutines on its loop."""
        if self._loop is None:
            coroutine.close()
            raise RuntimeError(f"{type(self).__name__} has no event loop yet: build it in a running loop or "
                               "generate first")
        if running_loop() is self._loop:
            coroutine.close()
            raise RuntimeError(f"{type(self).__name__}'s weight updates block: call them from a worker thread")
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def hold_version(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """A whole version in delta mode (`policy.weight_delta`): copied here, in the dtype it came in
        (the server's), then loaded; the deltas that follow change the copy."""
        held = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_tensors}
        self._held = None
        self.update_weights(held.items(), version)
        self._held = (version, held)

    def apply_delta(self, named_tensors: Iterable[tuple[str, torch.Tensor]], base_version: int, version: int) -> None:
        """What changed since `base_version` (`asyncrl.weights.delta`), written into the held copy; then
        the changed tensors are loaded (every tensor where the server takes whole versions only). A
        delta from another version is refused, and one whose load failed leaves no version held."""
        if self._held is None or self._held[0] != base_version:
            held = "none" if self._held is None else f"version {self._held[0]}"
            raise WeightTransferError(f"a delta from version {base_version}, but this generator holds {held}")
        pieces = list(named_tensors)
        held, self._held = self._held[1], None
        weights_delta.apply(held, pieces)
        changed = {weights_delta.target(name) for name, _ in pieces}
        self.update_weights([(name, t) for name, t in held.items() if self.loads_whole_versions or name in changed],
                            version)
        self._held = (version, held)

    async def _swap(self, load, version: int) -> None:
        """Cut the requests in flight, `await load()` (the server loads the version), set the version;
        no request starts meanwhile."""
        async with self._updating:
            self._open.clear()
            try:
                await self._cut_running()
                await load()
                self._version = version
            finally:
                self._open.set()

    async def _cut_running(self) -> None:
        """Abort every request in flight and wait until all came back. A request submitted just
        before may reach the server after an abort: aborting again until none is left catches it."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self._inflight:
            self._cut |= self._inflight
            await self._abort_inflight()
            try:
                await asyncio.wait_for(self._idle.wait(), 0.05)
            except asyncio.TimeoutError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.server} did not return {len(self._inflight)} aborted requests in "
                                       f"{DRAIN_TIMEOUT_S:.0f} s; the weight update is not applied") from None


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def read_weights(directory: str, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a Hugging Face directory by name (all of them: `names=None`), read from its
    safetensors files: the base a LoRA version is merged into."""
    import glob
    import os

    from safetensors import safe_open

    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys() if names is None or name in names})
    missing = sorted(set(names or ()) - set(out))
    if missing:
        raise KeyError(f"{directory} has no weights {missing[:3]}: the adapter names modules the model lacks")
    return out
