"""What a worker process of a `kind: python` endpoint runs (`asyncrl.rewards.user_function`): kept
apart, and light to import, because every worker imports it when it starts, and a worker killed
for a hang or a cancelled call is replaced by a new one that the next call waits for.

A worker's address space is limited (`worker_memory_mb`, RLIMIT_AS): a function that allocates past
it meets a MemoryError, and its worker exits with `OUT_OF_MEMORY_EXIT` rather than serve on (what
the function holds in its module, a cache that grew, would meet the limit again at the next call);
the endpoint answers the call as out of memory and the pool starts a fresh worker."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import resource
import sys
from typing import Any, Callable

from asyncrl.user_code import load_attribute

_FUNCTION: Callable | None = None  # in a worker process: the function it calls
OUT_OF_MEMORY_EXIT = 87  # a worker's exit status after its function ran out of memory (Python's own are 0-2)


def load_function(path: str, name: str) -> Callable:
    function = load_attribute(path, name)
    if not callable(function):
        raise ValueError(f"{path}: {name} is not a function")
    return function


def load_in_worker(path: str, name: str, memory_mb: int = 0) -> None:
    """A worker's start: it dies with the endpoint (a killed replica leaves no orphan scoring on),
    limits its address space to `memory_mb` (0: no limit), then loads the function."""
    global _FUNCTION
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    _FUNCTION = load_function(path, name)


def _run(result):
    return asyncio.run(result) if inspect.isawaitable(result) else result


@contextlib.contextmanager
def _exit_when_out_of_memory():
    """A MemoryError ends the worker (`OUT_OF_MEMORY_EXIT`) instead of reaching the endpoint."""
    try:
        yield
    except MemoryError:
        os._exit(OUT_OF_MEMORY_EXIT)


def plain(value: Any) -> Any:
    """What users' functions return, as Python numbers: numpy scalars and arrays and torch tensors
    (0-d or of the batch's length) through their own `tolist`, inside dicts and lists too, as verl
    and TRL accept them. Neither library is imported here: a worker stays light."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if type(value).__module__.split(".")[0] in ("numpy", "torch") and callable(getattr(value, "tolist", None)):
        return plain(value.tolist())
    return value


def call_verl(arguments: dict) -> Any:
    """One verl-style call in a worker: with the arguments the function names (all of them when it
    takes **kwargs)."""
    parameters = inspect.signature(_FUNCTION).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    with _exit_when_out_of_memory():
        return plain(_run(_FUNCTION(**{k: v for k, v in arguments.items() if takes_any or k in parameters})))


def call_trl(prompts: list, completions: list, columns: dict) -> Any:
    with _exit_when_out_of_memory():
        return plain(_run(_FUNCTION(prompts=prompts, completions=completions, **columns)))
