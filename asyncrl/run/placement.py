"""Where a run's roles go: Ray itself (a local instance or a cluster), what each role asks Ray for
(GPUs, custom resources, a placement group), and spawning a role's actor."""

from __future__ import annotations

import os
from typing import Any

import ray

from asyncrl.errors import StartupError

NAMESPACE = "asyncrl"
LEARNER_NAME = "asyncrl-policy-learner"


class RayStartError(StartupError):
    """Ray could not start on this machine (the message says what to do)."""


def init_ray(config) -> None:
    """Ray for a run: the cluster at `cluster.ray_address` (or RAY_ADDRESS), else a local instance.
    A local start that fails (a machine too busy or too small for Ray's own processes) raises
    `RayStartError` with one line saying what to try."""
    if ray.is_initialized():
        return
    # Few malloc arenas: torch's threads otherwise keep freed activation memory per arena.
    runtime_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}}
    address = config.cluster.ray_address or os.environ.get("RAY_ADDRESS", "")
    try:
        if address:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, runtime_env=runtime_env)
            return
        # The object store carries weight snapshots to the policy endpoint and to evaluation.
        port = {"_metrics_export_port": config.cluster.metrics_export_port} if config.cluster.metrics_export_port else {}
        # address="local": a new instance of the run's own, never another job's Ray found on the machine.
        ray.init(address="local", num_cpus=16, include_dashboard=False, object_store_memory=config.cluster.object_store_mb * 2**20,
                 log_to_driver=False, namespace=NAMESPACE, runtime_env=runtime_env, **port)
    except Exception as exc:  # Ray raises several types here (timeouts, connection errors, RuntimeError)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        raise RayStartError(f"could not start {where} ({first}); {_ray_hint(first, address)}") from exc


def _ray_hint(message: str, address: str) -> str:
    """What to try, from what Ray said."""
    if address:
        return "check that the cluster is up (`ray status`) and reachable from here"
    if "memory" in message.lower():
        return "lower cluster.object_store_mb to fit this machine's free memory"
    return ("the machine may be too busy to start Ray's processes in time: try again when it is quieter, or "
            "start Ray yourself (`ray start --head`) and pass cluster.ray_address=auto")


def spawn(role_shell: type, *args, actor_name: str | None = None, placement: dict | None = None, **kwargs):
    """A role's Ray actor. No CPU reserved (each role budgets its torch threads itself), and async
    methods run concurrently (a learner answers `weights` while it trains). `placement`: what the
    role asks Ray for (`num_gpus`, custom `resources`, a `scheduling_strategy`)."""
    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 64, **(placement or {})}
    if actor_name:
        options.update(name=actor_name, namespace=NAMESPACE)
    return ray.remote(role_shell).options(**options).remote(*args, **kwargs)


def ask(gpus: float, resources: dict) -> dict:
    """What one role asks Ray for."""
    return {**({"num_gpus": gpus} if gpus else {}), **({"resources": dict(resources)} if resources else {})}


def role_placement(placement: str, generator: dict, num_generators: int, learners: list[dict]
                   ) -> tuple[list[dict], list[dict], Any]:
    """Each generator's and learner's Ray options (from `ask`) under `cluster.placement`: any (Ray
    decides), colocated (one STRICT_PACK placement group holding every role) or spread (generators
    over the nodes: a SPREAD group). Returns the generators' options, the learners' options (in the
    order given) and the placement group (or None)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if placement == "any":
        return [dict(generator) for _ in range(num_generators)], [dict(learner) for learner in learners], None

    def bundle(options: dict) -> dict:
        # A bundle reserves something: a sliver of CPU when the role asks for nothing else.
        return {"CPU": 0.01, **({"GPU": options["num_gpus"]} if "num_gpus" in options else {}),
                **options.get("resources", {})}

    bundles = [bundle(generator) for _ in range(num_generators)]
    if placement == "colocated":
        bundles += [bundle(learner) for learner in learners]
    group = placement_group(bundles, strategy="STRICT_PACK" if placement == "colocated" else "SPREAD")
    ray.get(group.ready(), timeout=300)

    def in_bundle(options: dict, index: int) -> dict:
        return {**options, "scheduling_strategy": PlacementGroupSchedulingStrategy(group, index)}

    generators = [in_bundle(generator, i) for i in range(num_generators)]
    placed = ([in_bundle(learner, num_generators + i) for i, learner in enumerate(learners)]
              if placement == "colocated" else [dict(learner) for learner in learners])
    return generators, placed, group
