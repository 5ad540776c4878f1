"""The environments (each an endpoint's insides): what a tool call returns.

* `python`: runs the call's `code` in the sandbox (`asyncrl.rewards.sandbox`: namespaces, a uid of
  its own, limits) and returns its output, cut to a length; an error is an observation too.
* `lookup`: the tiny tool task's tool: a digit that is fixed per episode and that nothing in the
  prompt reveals, so a policy can get the answer right only by calling it (`episode_secret`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from asyncrl.environments.formats import ToolCall

EPISODE_TRUTH = "episode"  # a task's ground truth where each episode has its own answer (the lookup tool's)


def episode_truth(ground_truth: str, prompt_id: str, sample_idx: int) -> str:
    """The answer a sample is checked against: its episode's own where the task says so."""
    return episode_secret(prompt_id, sample_idx) if ground_truth == EPISODE_TRUTH else ground_truth


def episode_secret(prompt_id: str, sample_idx: int) -> str:
    """The tiny tool task's answer of one episode: a digit drawn from its identity (the verifier and
    the lookup tool compute the same; a regenerated episode keeps it)."""
    return str(zlib.crc32(f"{prompt_id}/{sample_idx}".encode()) % 10)


@dataclass(frozen=True)
class Episode:
    """Which episode a call belongs to (a prompt's sample)."""

    prompt_id: str
    sample_idx: int


class LookupTool:
    name = "lookup"

    def step(self, call: ToolCall, episode: Episode) -> tuple[str, bool]:
        """(observation text, error)."""
        if call.name != self.name:
            return f"no tool named {call.name!r}", True
        return episode_secret(episode.prompt_id, episode.sample_idx), False


class PythonTool:
    """`{"name": "python", "arguments": {"code": "..."}}`: the code's stdout (and its stderr when it
    failed)."""

    name = "python"

    def __init__(self, wall_s: float = 5.0, memory_mb: int = 256, allow_unisolated: bool = False,
                 allow_no_cgroup: bool = False):
        from asyncrl.rewards.sandbox import SandboxLimits

        self.limits = SandboxLimits(wall_s=wall_s, memory_mb=memory_mb, allow_unisolated=allow_unisolated,
                                    allow_no_cgroup=allow_no_cgroup)

    def step(self, call: ToolCall, episode: Episode) -> tuple[str, bool]:
        from asyncrl.rewards.sandbox import run_program, sandbox_python

        if call.name != self.name:
            return f"no tool named {call.name!r} (the tool is python)", True
        code = call.arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return 'the python tool needs {"code": "<a program>"}', True
        result = run_program({"main.py": code}, [sandbox_python(), "main.py"], limits=self.limits)
        if result.timed_out:
            return f"timed out after {self.limits.wall_s:.0f}s", True
        text = (result.stdout + (("\n" + result.stderr) if result.returncode else "")).strip()
        return text or "(no output)", result.returncode != 0


ENVIRONMENTS: dict[str, type] = {"lookup": LookupTool, "python": PythonTool}


def build_environment(config):
    """The environment an `EnvironmentConfig` names."""
    if config.name == "python":
        return PythonTool(config.python_wall_s, config.python_memory_mb, config.allow_unisolated,
                          config.allow_no_cgroup)
    if config.name == "lookup":
        return LookupTool()
    raise ValueError(f"unknown environment {config.name!r}; expected one of {sorted(ENVIRONMENTS)}")
