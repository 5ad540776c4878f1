"""What a worker process of a `kind: python` endpoint runs (`asyncrl.rewards.user_function`): kept
apart, and light to import, because every worker imports it when it starts, and a worker killed
for a hang or a cancelled call is replaced by a new one that the next call waits for."""

from __future__ import annotations

import asyncio
import inspect
import sys
from typing import Any, Callable

from asyncrl.user_code import load_attribute

_FUNCTION: Callable | None = None  # in a worker process: the function it calls


def load_function(path: str, name: str) -> Callable:
    function = load_attribute(path, name)
    if not callable(function):
        raise ValueError(f"{path}: {name} is not a function")
    return function


def load_in_worker(path: str, name: str) -> None:
    """A worker's start: it dies with the endpoint (a killed replica leaves no orphan scoring on),
    then loads the function."""
    global _FUNCTION
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    _FUNCTION = load_function(path, name)


def _run(result):
    return asyncio.run(result) if inspect.isawaitable(result) else result


def call_verl(arguments: dict) -> Any:
    """One verl-style call in a worker: with the arguments the function names (all of them when it
    takes **kwargs)."""
    parameters = inspect.signature(_FUNCTION).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return _run(_FUNCTION(**{k: v for k, v in arguments.items() if takes_any or k in parameters}))


def call_trl(prompts: list, completions: list, columns: dict) -> Any:
    return _run(_FUNCTION(prompts=prompts, completions=completions, **columns))
