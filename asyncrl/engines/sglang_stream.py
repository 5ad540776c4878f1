"""SGLang's streamed responses as the policy endpoint reads them: each sequence one SGLang request
(`stream=True`), its tokens handed on as `StepToken`s as they come, with their log-probs,
alternatives and weight versions.

* A request that a weight update cuts (`SGLangEngine` aborts the requests in flight, loads, and
  reopens) continues from its tokens so far under the new weights, as a generator's window does;
  its tokens carry the versions SGLang's spans give them.
* Dropping a row, or closing the whole stream (the client gone), cancels its task: SGLang's
  tokenizer manager aborts a request whose generator is closed, and the request is aborted by id
  as well, so its KV pages go back to SGLang's pool at once.
"""

from __future__ import annotations

import asyncio
import uuid

from asyncrl.engines.base import SamplingParams, SequenceInput
from asyncrl.engines.batch_jobs import StepToken, drain
from asyncrl.messages.structs import FinishReason


class SGLangSteps:
    """The steps of one job of sequences (the interface of `asyncrl.engines.batch_jobs.JobSteps`)."""

    def __init__(self, engine, sequences: list[SequenceInput], params: SamplingParams):
        self.engine, self.params = engine, params
        self.queue: asyncio.Queue = asyncio.Queue()
        self.live = set(range(len(sequences)))
        self.tasks = {i: asyncio.ensure_future(self._row(i, s)) for i, s in enumerate(sequences)}

    def __aiter__(self) -> "SGLangSteps":
        return self

    async def __anext__(self) -> list[StepToken]:
        while self.live or not self.queue.empty():
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is not None:  # None: a row ended
                return item + drain(self.queue)
        raise StopAsyncIteration

    def drop(self, rows: list[int]) -> None:
        for i in rows:
            if i in self.live:
                self.tasks[i].cancel()

    def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()

    async def _row(self, i: int, seq: SequenceInput) -> None:
        try:
            await self._generate(i, seq)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - the job fails with it, read by its consumer
            self.queue.put_nowait(exc)
        finally:
            self.live.discard(i)
            self.queue.put_nowait(None)

    async def _generate(self, i: int, seq: SequenceInput) -> None:
        engine, params = self.engine, self.params
        context = [int(t) for t in seq.prompt_ids] + [int(t) for t in seq.response_ids]
        setting = params.truncation
        budget = seq.max_response_tokens - len(seq.response_ids)
        done: list[int] = []
        while len(done) < budget:
            sampling = engine._sampling(budget - len(done), 0, seq.seed, setting, params)  # noqa: SLF001
            finish, rid = None, None
            async for rid, tokens, finish in self._request(context + done, sampling):
                done += [s.token for s in tokens]
                if tokens and finish in ("stop", "length"):
                    last = tokens[-1]
                    reason = FinishReason.EOS if finish == "stop" else FinishReason.MAX_LENGTH
                    tokens[-1] = StepToken(last.row, last.token, last.logprob, reason, last.top, last.version)
                self.queue.put_nowait([StepToken(i, s.token, s.logprob, s.finish, s.top, s.version) for s in tokens])
            if finish != "abort":
                return
            if rid not in engine._cut:  # noqa: SLF001
                raise RuntimeError("SGLang aborted a generation request of the policy endpoint")
            engine._cut.discard(rid)  # noqa: SLF001 - cut by a weight update: the rest under the new weights

    async def _request(self, input_ids: list[int], sampling: dict):
        """One streamed SGLang request: (rid, its new tokens, SGLang's finish type or None) per output."""
        engine = self.engine
        await engine._open.wait()  # noqa: SLF001 - no request starts while an update loads
        rid = uuid.uuid4().hex
        # An update cuts every request in flight before it loads, so this request's tokens are all of
        # the version it starts under. (SGLang reports its version spans with the last output only.)
        version = engine.weight_version
        engine._inflight.add(rid)  # noqa: SLF001 - an update aborts and waits for it like a window's
        engine._idle.clear()  # noqa: SLF001
        seen = 0
        try:
            stream = await engine.engine.async_generate(
                input_ids=input_ids, sampling_params=sampling, return_logprob=True, logprob_start_len=-1, rid=rid,
                top_logprobs_num=self.params.top_logprobs, cache_salt=f"asyncrl-v{engine.weight_version}",
                custom_logit_processor=engine.truncation if "custom_params" in sampling else None, stream=True)
            incremental = bool(getattr(engine.engine.tokenizer_manager, "incremental_streaming_output", False))
            async for out in stream:
                tokens, seen = _new_tokens(out, 0 if incremental else seen, self.params.top_logprobs, version)
                reason = out["meta_info"].get("finish_reason")
                yield rid, tokens, (reason or {}).get("type") if isinstance(reason, dict) else reason
        except BaseException:
            engine.engine.tokenizer_manager.abort_request(rid)
            raise
        finally:
            engine._inflight.discard(rid)  # noqa: SLF001
            if not engine._inflight:  # noqa: SLF001
                engine._idle.set()  # noqa: SLF001


def _new_tokens(out: dict, seen: int, top_n: int, version: int) -> tuple[list[StepToken], int]:
    """The tokens of a streamed output past the first `seen` (SGLang's outputs are cumulative
    unless its incremental streaming is on, then `seen` is 0), and the new count. Each token's
    version is SGLang's where the output carries its spans (the last one does), else `version`."""
    meta = out["meta_info"]
    ids = list(out["output_ids"])
    logprobs = [float(e[0]) for e in meta["output_token_logprobs"]]
    versions = [int(span["version"]) for span in meta.get("weight_versions") or [] for _ in range(span["start"], span["end"])]
    tops = meta.get("output_top_logprobs") or []
    steps = []
    for j in range(seen, len(ids)):
        top = None
        if top_n and j < len(tops):
            entries = sorted(((float(e[0]), int(e[1])) for e in tops[j]), key=lambda e: -e[0])[:top_n]
            top = ([e[1] for e in entries], [e[0] if e[0] > -3.0e38 else float("-inf") for e in entries])
        steps.append(StepToken(0, ids[j], logprobs[j] if j < len(logprobs) else 0.0, None, top,
                               versions[j] if j < len(versions) else version))
    return steps, len(ids)
