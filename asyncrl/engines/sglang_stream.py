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

from asyncrl.engines.base import SequenceInput
from asyncrl.engines.batch_jobs import StepToken
from asyncrl.engines.server_stream import RequestSteps
from asyncrl.messages.structs import FinishReason


class SGLangSteps(RequestSteps):
    """A job's rows as SGLang requests (`RequestSteps`)."""

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
        # An update cuts every request in flight before it loads, so this request's tokens are all of
        # the version it starts under. (SGLang reports its version spans with the last output only.)
        async with engine._tracked() as (rid, version):  # noqa: SLF001 - cut by an update like a window's
            seen = 0
            try:
                stream = await engine.engine.async_generate(
                    input_ids=input_ids, rid=rid, stream=True,
                    **engine.request_fields(sampling, self.params.top_logprobs, version))
                incremental = bool(getattr(engine.engine.tokenizer_manager, "incremental_streaming_output", False))
                async for out in stream:
                    tokens, seen = _new_tokens(out, 0 if incremental else seen, self.params.top_logprobs, version)
                    reason = out["meta_info"].get("finish_reason")
                    yield rid, tokens, (reason or {}).get("type") if isinstance(reason, dict) else reason
            except BaseException:
                engine.engine.tokenizer_manager.abort_request(rid)
                raise

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
