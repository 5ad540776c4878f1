"""A judge behind an OpenAI-compatible API (`kind: openai`): a vLLM or SGLang server, a hosted model,
or another asyncrl policy endpoint. The judge's prompts, position swap and failure rules are the
built-in judge's (`asyncrl.rewards.judge.GenerativeJudge`); only the verdicts come from the server.

A verdict is read from the top log-probs of the reply's first token when the server returns them
(P(word) summed over the tokens that spell it, any case), else from the reply's first word; a reply
that is neither verdict word is no verdict (a failed reward). Requests run `max_concurrency` at a
time, each with a timeout and retries (the `openai` client's); the key is read from the variable
`api_key_env` names and never written anywhere. A call its caller cancels (its `reward.timeout_s`
deadline passed) sends none of its requests not yet sent.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from asyncrl.config import OpenAIJudgeEndpoint
from asyncrl.rewards.calls import CallCancelled, RewardCall, current_call

TOP_LOGPROBS = 20  # OpenAI's most


class OpenAIVerdicts:
    def __init__(self, endpoint: OpenAIJudgeEndpoint):
        import openai

        if endpoint.api_key_env and endpoint.api_key_env not in os.environ:
            raise ValueError(f"reward endpoint (openai): the environment variable {endpoint.api_key_env} "
                             f"(api_key_env) is not set")
        self.endpoint = endpoint
        key = os.environ.get(endpoint.api_key_env, "") if endpoint.api_key_env else ""
        # A server that needs no key still gets one (the client refuses none); vLLM's convention.
        self.client = openai.OpenAI(base_url=endpoint.base_url, api_key=key or "EMPTY",
                                    timeout=endpoint.request_timeout_s, max_retries=endpoint.retries)
        self.workers = ThreadPoolExecutor(max_workers=endpoint.max_concurrency, thread_name_prefix="openai-judge")
        self.counters = {"requests": 0, "errors": 0, "without_logprobs": 0, "requests_not_sent": 0}
        self.last_error = ""

    def serves(self, endpoint) -> bool:
        mine = ("base_url", "model", "api_key_env", "max_concurrency", "request_timeout_s", "retries")
        return isinstance(endpoint, OpenAIJudgeEndpoint) and all(
            getattr(endpoint, k) == getattr(self.endpoint, k) for k in mine)

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def verdict_probabilities(self, texts: list[str], words: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """P(words[0]) among the verdict words and their mass, per text; a request that failed has
        mass 0 (no verdict). If every request failed, the error is raised: each reward says why."""
        call = current_call()
        results = list(self.workers.map(lambda text: self._one(text, words, call), texts))
        errors = [r for r in results if isinstance(r, Exception)]
        if errors and len(errors) == len(results):
            raise RuntimeError(f"the judge at {self.endpoint.base_url} answered none of {len(texts)} requests: "
                               f"{type(errors[0]).__name__}: {errors[0]}")
        verdicts = [(0.5, 0.0) if isinstance(r, Exception) else r for r in results]
        return np.array([p for p, _ in verdicts]), np.array([m for _, m in verdicts])

    def _one(self, text: str, words: list[str], call: RewardCall) -> tuple[float, float] | Exception:
        if call.cancelled:  # the caller gave up on this call: its result would be thrown away
            self.counters["requests_not_sent"] += 1
            return CallCancelled("the reward call was cancelled before this request was sent")
        self.counters["requests"] += 1
        try:
            reply = self.client.chat.completions.create(
                model=self.endpoint.model, messages=[{"role": "user", "content": text}], max_tokens=4,
                temperature=0.0, logprobs=True, top_logprobs=TOP_LOGPROBS)
        except Exception as exc:  # noqa: BLE001 - after the client's retries: this text has no verdict
            self.counters["errors"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:300]
            return exc
        choice = reply.choices[0]
        content = choice.logprobs.content if choice.logprobs is not None else None
        if content:
            return word_probabilities({alt.token: alt.logprob for alt in content[0].top_logprobs}, words)
        self.counters["without_logprobs"] += 1
        return word_in_reply(choice.message.content or "", words)

    def stats(self) -> dict:
        return {**self.counters, "last_error": self.last_error}


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
