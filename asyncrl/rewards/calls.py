"""A reward call's stop, as the scorer's thread sees it.

An endpoint scores in a worker thread (`asyncio.to_thread`, which carries context variables into
it). A call stops for one of two reasons: its caller cancels it (the router's `reward.timeout_s`
deadline passed: Ray or Serve cancels the endpoint's coroutine, and the result is thrown away), or
its own deadline passes at the endpoint (`budget_s`: the router's deadline less the time to answer),
and then the rewards already scored are returned, only the samples not scored failing with the
reason. The thread itself cannot be stopped, but the work it hands out can: a scorer asks
`current_call()` for the call it serves and registers what stops its work (`on_stop`): a
`kind: python` endpoint kills the worker processes still running the call's samples and drops those
not begun; an `openai` judge cancels its requests (their connections closed); the verifier kills
its math worker or its sandbox; the local models stop between samples or batches. A late call
then leaves no work behind it on the endpoint.
"""

from __future__ import annotations

import contextvars
import threading
import time
from typing import Callable

CANCELLED = "the reward call was cancelled: its caller's deadline (reward.timeout_s) passed"
PAST_DEADLINE = "not scored within the call's deadline (reward.timeout_s); the rewards already scored were kept"


class CallStopped(RuntimeError):
    """Work of a reward call that was stopped (cancelled, or past its deadline): the reason is the text."""


class RewardCall:
    """One call of an endpoint: stopped once, running every callback registered before or after."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], object]] = {}
        self._next_id = 0
        self.stopped = False
        self.reason = ""

    def on_stop(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Run `callback` when the call stops (at once if it already has); returns what forgets
        it again (the work it would stop has ended)."""
        with self._lock:
            if not self.stopped:
                key, self._next_id = self._next_id, self._next_id + 1
                self._callbacks[key] = callback
                return lambda: self._forget(key)
        callback()
        return lambda: None

    def _forget(self, key: int) -> None:
        with self._lock:
            self._callbacks.pop(key, None)

    def stop(self, reason: str) -> None:
        with self._lock:
            if self.stopped:
                return
            self.stopped, self.reason = True, reason
            callbacks, self._callbacks = list(self._callbacks.values()), {}
        for callback in callbacks:
            callback()

    def cancel(self) -> None:
        self.stop(CANCELLED)

    def check(self) -> None:
        """Raise `CallStopped` if the call has stopped (before starting a piece of its work)."""
        if self.stopped:
            raise CallStopped(self.reason)


_CURRENT: contextvars.ContextVar[RewardCall | None] = contextvars.ContextVar("reward_call", default=None)


def current_call() -> RewardCall:
    """The call this thread works for; outside an endpoint's call (a test, the CLI) one that never stops."""
    return _CURRENT.get() or RewardCall()


async def run_in_call(call: RewardCall, function: Callable, *args, stop_at: float | None = None):
    """`asyncio.to_thread(function, *args)` as `call`: stopped at `stop_at` (time.monotonic) if given,
    so that `function` returns what it has; if the awaiting task is cancelled, so is the call (its
    registered work stops), and the cancellation goes on to the caller."""
    import asyncio

    token = _CURRENT.set(call)
    timer = None
    if stop_at is not None:
        timer = asyncio.get_running_loop().call_later(max(0.0, stop_at - time.monotonic()), call.stop, PAST_DEADLINE)
    try:
        return await asyncio.to_thread(function, *args)
    except asyncio.CancelledError:
        call.cancel()
        raise
    finally:
        if timer is not None:
            timer.cancel()
        _CURRENT.reset(token)
