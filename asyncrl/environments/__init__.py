"""Environments a policy acts in over several turns: the policy writes until it calls a tool, the
environment's observation is appended, the policy writes again (`docs/architecture.md`, episodes).

* `formats.py`: how a model writes a tool call and reads its result (a chat template's tool
  format), parsed robustly: a malformed call becomes an observation saying what is wrong.
* `tools.py`: the environments themselves (a Python tool that runs the model's code in the
  sandbox; the tiny tool task's lookup), chosen by name from `ENVIRONMENTS`.
An environment runs as an endpoint of its own (`actors/environment.py`), called with a timeout and
retries, like a reward endpoint.
"""


def check(environment) -> None:
    """Refuse an environment this build does not have, at start-up (`asyncrl.run.wiring` calls it
    before any role starts; the names are the mappings' keys)."""
    from asyncrl.config.checks import ConfigError
    from asyncrl.environments.formats import FORMATS
    from asyncrl.environments.tools import ENVIRONMENTS

    if environment.name not in ("", *ENVIRONMENTS):
        raise ConfigError(f"environment.name={environment.name}: must be empty (one turn) or one of "
                          f"{sorted(ENVIRONMENTS)}")
    if environment.tool_format not in FORMATS:
        raise ConfigError(f"environment.tool_format={environment.tool_format}: must be one of {sorted(FORMATS)}")
