"""A reward call's cancellation, as the scorer's thread sees it.

An endpoint scores in a worker thread (`asyncio.to_thread`, which carries context variables into
it). When the caller's deadline cancels the call (`reward.timeout_s`: the router cancels it, Ray or
Serve cancels the endpoint's coroutine), the thread itself cannot be stopped, but the work it
hands out can: a scorer asks `current_call()` for the call it serves and registers what stops its
work (`on_cancel`): a `kind: python` endpoint kills the worker processes still running the call's
samples and drops those not begun; a `kind: openai` judge sends none of the call's requests not yet
sent. A late call then leaves no work behind it on the endpoint.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Callable


class CallCancelled(RuntimeError):
    """Work of a reward call that was cancelled (its caller's deadline passed)."""


class RewardCall:
    """One call of an endpoint: cancelled once, running every callback registered before or after."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], object]] = []
        self.cancelled = False

    def on_cancel(self, callback: Callable[[], object]) -> None:
        """Run `callback` when the call is cancelled (at once if it already is)."""
        with self._lock:
            if not self.cancelled:
                self._callbacks.append(callback)
                return
        callback()

    def cancel(self) -> None:
        with self._lock:
            if self.cancelled:
                return
            self.cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def check(self) -> None:
        """Raise `CallCancelled` if the call is cancelled (before starting a piece of its work)."""
        if self.cancelled:
            raise CallCancelled("the reward call was cancelled: its caller's deadline passed")


_CURRENT: contextvars.ContextVar[RewardCall | None] = contextvars.ContextVar("reward_call", default=None)


def current_call() -> RewardCall:
    """The call this thread works for; outside an endpoint's call (a test, the CLI) one that is never cancelled."""
    return _CURRENT.get() or RewardCall()


async def run_cancellable(function: Callable, *args):
    """`asyncio.to_thread(function, *args)` as one `RewardCall`: if the awaiting task is cancelled,
    so is the call (its registered work stops), and the cancellation goes on to the caller."""
    import asyncio

    call = RewardCall()
    token = _CURRENT.set(call)
    try:
        return await asyncio.to_thread(function, *args)
    except asyncio.CancelledError:
        call.cancel()
        raise
    finally:
        _CURRENT.reset(token)
