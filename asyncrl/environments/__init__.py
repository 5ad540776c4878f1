"""Environments a policy acts in over several turns: the policy writes until it calls a tool, the
environment's observation is appended, the policy writes again (`docs/architecture.md`, episodes).

* `formats.py`: how a model writes a tool call and reads its result (a chat template's tool
  format), parsed robustly: a malformed call becomes an observation saying what is wrong.
* `tools.py`: the environments themselves (a Python tool that runs the model's code in the
  sandbox; the tiny tool task's lookup), chosen by name from `ENVIRONMENTS` (the names
  `environment.name` allows).
An environment runs as an endpoint of its own (`actors/environment.py`), called with a timeout and
retries, like a reward endpoint.
"""

