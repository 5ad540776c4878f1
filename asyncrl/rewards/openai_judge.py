"""A judge behind an OpenAI-compatible API (`kind: openai`): a vLLM or SGLang server, a hosted model,
or another asyncrl policy endpoint. The judge's prompts, position swap and failure rules are the
built-in judge's (`asyncrl.rewards.judge.GenerativeJudge`); only the verdicts come from the server.

A verdict is read from the top log-probs of the reply's first token when the server returns them
(P(word) summed over the tokens that spell it, any case), else from the reply's first word; a reply
that is neither verdict word is no verdict (a failed reward).

Requests run `max_concurrency` at a time as tasks of one event loop of the judge's own (a thread),
with the `openai` package's async client. Each attempt has `request_timeout_s` for the whole
request, not per read: a server that trickles bytes is cut off there, where the client's own
timeout (between two reads) never would, and the attempt's connection is closed with it. Failed
attempts are retried (`retries`, with backoff). A call that stops (its caller's deadline, or its
own: `asyncrl.rewards.calls`) cancels its requests: those not sent are never sent, those in flight
are closed, the verdicts already in are kept. Nothing blocks a thread on a socket, so a server that
wedged and recovered finds the judge free. The key is read from the variable `api_key_env` names and
never written anywhere: every error text is masked (`asyncrl.redaction`).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading

import numpy as np

from asyncrl.config import OpenAIJudgeEndpoint
from asyncrl.redaction import masked, register_secret
from asyncrl.rewards.calls import CallStopped, RewardCall, current_call

TOP_LOGPROBS = 20  # OpenAI's most
RETRIED_STATUS = (408, 409, 429)  # and 5xx: what the `openai` client itself retries


class OpenAIVerdicts:
    def __init__(self, endpoint: OpenAIJudgeEndpoint):
        import openai

        if endpoint.api_key_env and endpoint.api_key_env not in os.environ:
            raise ValueError(f"reward endpoint (openai): the environment variable {endpoint.api_key_env} "
                             f"(api_key_env) is not set")
        self.endpoint = endpoint
        key = os.environ.get(endpoint.api_key_env, "") if endpoint.api_key_env else ""
        register_secret(key)
        # A server that needs no key still gets one (the client refuses none); vLLM's convention.
        # Retries are ours (`_attempts`): the client's would each get a timeout per read again.
        self.client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key or "EMPTY",
                                         timeout=endpoint.request_timeout_s, max_retries=0)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="openai-judge", daemon=True)
        self.thread.start()
        self.slots = asyncio.Semaphore(endpoint.max_concurrency)
        self.counters = {"requests": 0, "errors": 0, "without_logprobs": 0, "requests_not_sent": 0,
                         "requests_stopped": 0, "attempts_timed_out": 0}
        self.last_error = ""

    def serves(self, endpoint) -> bool:
        mine = ("base_url", "model", "api_key_env", "max_concurrency", "request_timeout_s", "retries")
        return isinstance(endpoint, OpenAIJudgeEndpoint) and all(
            getattr(endpoint, k) == getattr(self.endpoint, k) for k in mine)

    def close(self) -> None:
        """Cancel every request (their connections closed), close the client, end the loop's thread."""
        if self.loop.is_closed():
            return

        async def shut_down():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.client.close()

        try:
            asyncio.run_coroutine_threadsafe(shut_down(), self.loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - closing: what is left dies with the loop
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()

    def verdict_probabilities(self, texts: list[str], words: list[str]) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """P(words[0]) among the verdict words, their mass, and why there is no verdict ("" where
        there is), per text. If every request failed (not stopped), the error is raised: each reward says why."""
        call = current_call()
        results = asyncio.run_coroutine_threadsafe(self._all(texts, words, call), self.loop).result()
        errors = [r for r in results if isinstance(r, Exception)]
        if errors and len(errors) == len(results) and not any(isinstance(e, CallStopped) for e in errors):
            raise RuntimeError(f"the judge at {self.endpoint.base_url} answered none of {len(texts)} requests: "
                               f"{describe(errors[0])}")
        verdicts = [(0.5, 0.0) if isinstance(r, Exception) else r for r in results]
        return np.array([p for p, _ in verdicts]), np.array([m for _, m in verdicts]), [self._reason(r) for r in results]

    def _reason(self, result) -> str:
        """Why a text has no verdict ("" where it has one)."""
        if isinstance(result, CallStopped):
            return str(result)
        return f"the judge at {self.endpoint.base_url}: {describe(result)}" if isinstance(result, Exception) else ""

    async def _all(self, texts: list[str], words: list[str], call: RewardCall) -> list:
        """Every text's verdict or exception; the call's stop cancels the requests not yet done."""
        tasks = [asyncio.ensure_future(self._one(text, words, call)) for text in texts]

        def cancel_all():
            for task in tasks:
                task.cancel()

        forget = call.on_stop(lambda: self.loop.call_soon_threadsafe(cancel_all))
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            forget()
        for i, result in enumerate(results):
            if isinstance(result, asyncio.CancelledError):  # cancelled before it began
                self.counters["requests_not_sent"] += 1
                results[i] = CallStopped(call.reason or "the judge was closed")
        return results

    async def _one(self, text: str, words: list[str], call: RewardCall) -> tuple[float, float] | Exception:
        async with self.slots:
            if call.stopped:  # the caller gave up on this call: its result would be thrown away
                self.counters["requests_not_sent"] += 1
                return CallStopped(call.reason)
            self.counters["requests"] += 1
            try:
                return await self._attempts(text, words)
            except asyncio.CancelledError:  # the call stopped: this request's connection is closed
                self.counters["requests_stopped"] += 1
                return CallStopped(call.reason or "the judge was closed")
            except Exception as exc:  # noqa: BLE001 - after the retries: this text has no verdict
                self.counters["errors"] += 1
                self.last_error = masked(describe(exc))[:300]
                return exc

    async def _attempts(self, text: str, words: list[str]) -> tuple[float, float]:
        """One request, with `retries` more after a failure that may pass; each attempt bounded whole."""
        import openai

        for attempt in range(self.endpoint.retries + 1):
            try:
                reply = await asyncio.wait_for(self.client.chat.completions.create(
                    model=self.endpoint.model, messages=[{"role": "user", "content": text}], max_tokens=4,
                    temperature=0.0, logprobs=True, top_logprobs=TOP_LOGPROBS), self.endpoint.request_timeout_s)
                return self._read(reply, words)
            except asyncio.TimeoutError:
                self.counters["attempts_timed_out"] += 1
                error: Exception = TimeoutError(f"no whole answer within request_timeout_s="
                                                f"{self.endpoint.request_timeout_s:g} s (the request was closed)")
            except openai.APIStatusError as exc:
                if exc.status_code not in RETRIED_STATUS and exc.status_code < 500:
                    raise
                error = exc
            except openai.APIConnectionError as exc:
                error = exc
            if attempt < self.endpoint.retries:
                await asyncio.sleep(min(0.5 * 2**attempt, 8.0))
        raise error

    def _read(self, reply, words: list[str]) -> tuple[float, float]:
        choice = reply.choices[0]
        content = choice.logprobs.content if choice.logprobs is not None else None
        if content:
            return word_probabilities({alt.token: alt.logprob for alt in content[0].top_logprobs}, words)
        self.counters["without_logprobs"] += 1
        return word_in_reply(choice.message.content or "", words)

    def stats(self) -> dict:
        return {**self.counters, "last_error": self.last_error}


def describe(exc: BaseException) -> str:
    """An error as a record says it: its type and text, masked."""
    return masked(f"{type(exc).__name__}: {exc}")


def _spelled(token: str) -> str:
    return re.sub(r"[^a-z]", "", token.lower())


def word_probabilities(top_logprobs: dict[str, float], words: list[str]) -> tuple[float, float]:
    """(P(words[0]) / P(any word), P(any word)) from one position's top log-probs."""
    per_word = [sum(float(np.exp(lp)) for token, lp in top_logprobs.items() if _spelled(token) == word.lower())
                for word in words]
    total = sum(per_word)
    return (per_word[0] / total if total > 0 else 0.5), total


def word_in_reply(reply: str, words: list[str]) -> tuple[float, float]:
    """A reply without log-probs: its first word, if it is a verdict word (certainty), else none."""
    first = _spelled(reply.strip().split()[0]) if reply.strip() else ""
    for i, word in enumerate(words):
        if first == word.lower():
            return (1.0 if i == 0 else 0.0), 1.0
    return 0.5, 0.0
