"""Data parallelism for the policy learner: FSDP2 (`fully_shard`) over `policy.compute.ranks`
processes, gloo on CPU, NCCL on GPU.

Every rank holds a shard of the parameters and of Adam's state, sees the whole batch, and trains
its share of the micro-batches (`parts_of_rank`); gradients are summed over the ranks (each rank's
loss is already scaled by the whole batch's totals), so one sharded step equals the one-rank step.
The ranks form the default process group of their processes: the weight group to the generators
is its own group (`asyncrl.weights.sync.WeightGroup`), so both can exist in the learner.

Every function here that touches the weights is a collective: all ranks call it, in the same order.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the learner's ranks (its default process group)."""

    rank: int
    world: int

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each key summed over the ranks (every rank passes the same keys)."""
        keys = sorted(values)
        total = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(total)
        return dict(zip(keys, total.tolist()))

    def sum_tensor(self, tensor: torch.Tensor) -> None:
        """In place: the sum over the ranks."""
        dist.all_reduce(tensor)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (small Python objects)."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out


def parts_of_rank(parts: list, parallel: DataParallel | None) -> list[tuple[Any, bool]]:
    """This rank's share of `parts` as (part, ghost): all on one rank; dealt round-robin over the
    ranks, every rank getting ceil(n / world) (a ghost, a copy of the first part that the caller
    weighs 0, fills a short share). Every rank then runs as many forwards and backwards, as the
    sharded model's collectives require."""
    if parallel is None:
        return [(part, False) for part in parts]
    per_rank = max(1, math.ceil(len(parts) / parallel.world))
    mine = [(part, False) for part in parts[parallel.rank::parallel.world]]
    return mine + [(parts[0], True)] * (per_rank - len(mine))


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def rendezvous_store(host: str, port: int) -> dist.TCPStore:
    """The store where the learner's ranks meet, held by the process that starts the run (the
    ranks are created at once, so none of them can host it before the others know its address).
    Keep it for the run's life: NCCL may create communicators later through it."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False)


def join(host: str, port: int, world: int, rank: int, backend: str = "gloo", timeout_s: float = 600.0) -> DataParallel:
    """Join the learner's ranks: the default process group, met at the store `host:port`. Blocks
    until every rank has joined (or `timeout_s`); every later collective times out the same."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore("learner", dist.TCPStore(host, port, world, is_master=False, timeout=timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return DataParallel(rank, world)


def shard(module: torch.nn.Module, lm, parallel: DataParallel) -> torch.nn.Module:
    """FSDP2 over the ranks: rank 0's weights everywhere first (the ranks built their models
    independently), then each decoder layer its own unit (`_no_split_modules`: the layers a
    Hugging Face model says must not be split) and `module` the root (the embedding, the final norm
    and a head tied to the embedding stay together in it). Gradients are summed, not averaged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)
    device_type = next(module.parameters()).device.type
    mesh = init_device_mesh(device_type, (parallel.world,))
    layer_classes = set(getattr(lm, "_no_split_modules", None) or [])
    for sub in module.modules():
        if type(sub).__name__ in layer_classes:
            fully_shard(sub, mesh=mesh)
    fully_shard(module, mesh=mesh)
    # The loss of each rank is scaled by the whole batch's totals: the gradients add up (a plain
    # SUM: gloo has no pre-multiplied sum). Each unit has its own setting.
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)
    return module


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def full_weights(module: torch.nn.Module, parallel: DataParallel | None) -> dict[str, torch.Tensor]:
    """The whole parameters and buffers by name, on CPU: on rank 0 (a collective when sharded;
    the other ranks get {}), or a copy of the module's own on one rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if parallel is None:
        return {name: t.detach().cpu().clone() for name, t in module.state_dict().items()}
    return get_model_state_dict(module, options=_options(full_state_dict=True, cpu_offload=True))


def load_full_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor], parallel: DataParallel | None) -> None:
    """Load whole weights (rank 0's; the other ranks pass {} and receive them)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    if parallel is None:
        module.load_state_dict(weights, strict=False)
        return
    set_model_state_dict(module, weights, options=_options(full_state_dict=True, broadcast_from_rank0=True,
                                                           strict=False))


def optimizer_state(module: torch.nn.Module, optimizer, parallel: DataParallel | None) -> dict:
    """The optimizer's state keyed by parameter name (whole tensors, on rank 0 when sharded): the
    same file for any number of ranks, so a run can resume with another `learner_ranks`."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if parallel is None:
        return get_optimizer_state_dict(module, optimizer)
    return get_optimizer_state_dict(module, optimizer, options=_options(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(module: torch.nn.Module, optimizer, state: dict, parallel: DataParallel | None) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if parallel is None:
        set_optimizer_state_dict(module, optimizer, state)
        return
    set_optimizer_state_dict(module, optimizer, state, options=_options(full_state_dict=True, broadcast_from_rank0=True))


def leave() -> None:
    """Every rank leaves together: a rank that tears its gloo pairs down while a peer still talks
    to them aborts the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
