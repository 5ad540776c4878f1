"""The environments (each an endpoint's insides): what a tool call returns.

* `python`: runs the call's `code` in the sandbox (`asyncrl.rewards.sandbox`: namespaces, a uid of
  its own, limits) and returns its output, cut to a length; an error is an observation too.
* `lookup`: the tiny tool task's tool: a digit that is fixed per episode and that nothing in the
  prompt reveals, so a policy can get the answer right only by calling it (`episode_secret`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from asyncrl.config import EnvironmentConfig
from asyncrl.environments.formats import ToolCall
from asyncrl.rewards.verifiers import EPISODE_TRUTH, episode_secret, episode_truth
from asyncrl.user_code import load_attribute, split_class_path

__all__ = ["EPISODE_TRUTH", "ENVIRONMENTS", "Environment", "Episode", "LookupTool", "PythonTool", "build_environment",
           "episode_secret", "episode_truth", "tool_specs"]


@dataclass(frozen=True)
class Episode:
    """Which episode a call belongs to (a prompt's sample)."""

    prompt_id: str
    sample_idx: int


class LookupTool:
    name = "lookup"
    spec = {"name": "lookup", "description": "The answer of this episode: a digit.",
            "parameters": {"type": "object", "properties": {}}}

    def step(self, call: ToolCall, episode: Episode) -> tuple[str, bool]:
        """(observation text, error)."""
        if call.name != self.name:
            return f"no tool named {call.name!r}", True
        return episode_secret(episode.prompt_id, episode.sample_idx), False


class PythonTool:
    """`{"name": "python", "arguments": {"code": "..."}}`: the code's stdout (and its stderr when it
    failed)."""

    name = "python"
    spec = {"name": "python", "description": "Run a Python program; what it prints comes back.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                           "required": ["code"]}}

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


class Environment(Protocol):
    """What an environment is (a built-in, or a class of the user's: `environment.class_path`): one
    object per environment endpoint, answering tool calls of many episodes at once (each call names
    its episode: keep per-episode state by it). Calls come from worker threads."""

    def step(self, call: ToolCall, episode: Episode) -> tuple[str, bool]:
        """One tool call -> (the observation's text, whether it is an error). Raising is an error
        observation too; the episode goes on."""


def step_answer(environment: Environment, call: ToolCall, episode: Episode) -> tuple[str, bool]:
    """`environment.step`, its answer checked: (text, is_error). Anything else is an error observation
    saying what came back (the episode goes on, as when `step` raises). Observations are text: an
    image from a tool (a screenshot) is not supported yet, and says so."""
    answer = environment.step(call, episode)
    text = answer[0] if isinstance(answer, tuple) and len(answer) == 2 else answer
    if isinstance(answer, tuple) and len(answer) == 2 and isinstance(text, str):
        return text, bool(answer[1])
    kind = f"{type(text).__module__}.{type(text).__qualname__}"
    if _is_image(text):
        return (f"error: the environment answered {call.name} with an image ({kind}): tool observations are text; "
                f"images from tools are not supported yet (docs/environments.md)"), True
    return f"error: the environment's step must return (text, is_error), not {kind}", True


def _is_image(value) -> bool:
    """A PIL image, image bytes, or a chat content part / dict holding one."""
    if type(value).__module__.startswith("PIL."):
        return True
    if isinstance(value, (bytes, bytearray)):
        head = bytes(value[:12])  # PNG, JPEG, GIF, WebP (a RIFF container, as WAV is: its form type says which)
        return head.startswith((b"\x89PNG", b"\xff\xd8\xff", b"GIF8")) or (head[:4], head[8:]) == (b"RIFF", b"WEBP")
    if isinstance(value, dict):
        return bool({"image", "image_url", "images"} & set(value)) or value.get("type") in ("image", "image_url")
    return isinstance(value, list) and any(_is_image(v) for v in value)


_BUILT_IN: dict[str, type] = {"lookup": LookupTool, "python": PythonTool}
# The built-in environments by `environment.name`.
ENVIRONMENTS: dict[str, Callable[[EnvironmentConfig], Environment]] = {
    "lookup": lambda config: LookupTool(),
    "python": lambda config: PythonTool(config.python_wall_s, config.python_memory_mb, config.allow_unisolated,
                                        config.allow_no_cgroup),
}


def build_environment(config: EnvironmentConfig) -> Environment:
    """The environment an `EnvironmentConfig` names: a built-in, or the user's class built with
    `options`."""
    if config.class_path:
        environment_class = load_attribute(*split_class_path(config.class_path), what="class")
        environment = environment_class(**config.options)
        if not callable(getattr(environment, "step", None)):
            raise TypeError(f"environment.class_path={config.class_path}: the class has no step(call, episode) "
                            f"method (docs/environments.md)")
        return environment
    return ENVIRONMENTS[config.name](config)


def tool_specs(config: EnvironmentConfig) -> list[dict]:
    """The tools an `EnvironmentConfig` offers, as OpenAI `tools` entries: what a prompt lists through
    the chat template. A class of the user's lists its class attribute `spec` (one function's
    `{"name", "description", "parameters"}`, or a list of them) where it has one, else nothing."""
    if config.class_path:
        spec = getattr(load_attribute(*split_class_path(config.class_path), what="class"), "spec", None)
    else:
        spec = _BUILT_IN[config.name].spec if config.name else None
    specs = [] if spec is None else spec if isinstance(spec, list) else [spec]
    return [{"type": "function", "function": s} for s in specs]
