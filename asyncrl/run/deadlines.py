"""Every wait of the run on a role has an end: a role that does not answer a call within its bound
is hung (alive, but stuck: a wedged process, a deadlock), named with the call, and treated as
dead, so the run restarts from its checkpoint instead of waiting for ever. The control path
(status, metrics, the ledger, healing and retiring generators, scaling) answers between two steps;
moving the model's bytes (a checkpoint, the weights, a resume) takes longer."""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError

# How long the run waits for a role's answer. A role that does not answer is hung (alive, but
# stuck): it is treated as dead, so the run restarts instead of waiting for ever.
CONTROL_TIMEOUT_S = 120.0  # status, metrics, the ledger, versions: answered between two steps
WORK_TIMEOUT_S = 1800.0  # a checkpoint, the weights, a resume: the model's size in bytes moved
PREPARE_TIMEOUT_S = 4 * 3600.0  # Pre-PPO's selection generates over the prompts before the first step


class RoleDied(RuntimeError):
    """A role's loop ended (its error, with the role named): the run restarts from the checkpoint."""


class RoleHung(RoleDied):
    """A role did not answer a call within its bound: treated as dead."""


def answer(ref, role: str, what: str, timeout_s: float | None = None):
    """`ray.get` of a role's call, bounded: `RoleHung` (naming the role and the call) past
    `timeout_s` (default `CONTROL_TIMEOUT_S`)."""
    timeout_s = CONTROL_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise RoleHung(f"{role} did not answer {what} within {timeout_s:g}s (alive but stuck)") from None
