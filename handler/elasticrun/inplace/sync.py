"""Bringing every rank to the same state after the group changed.

A newcomer starts from its own initial weights (or an older checkpoint); a
survivor may have applied half a step when a peer died. After each change the
ranks agree on a source (:func:`.decide.sync_source`: the lowest rank among
those furthest along) and take its model, optimizer and step counter, so the
next step starts from identical parameters everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from elasticrun.inplace.decide import sync_source


def _device(model: torch.nn.Module) -> torch.device:
    """Where the group's small tensors live: NCCL only moves CUDA tensors."""
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def agree_on_source(step: int, device: torch.device) -> tuple[int, int]:
    """(source rank, its step), from every rank's step counter (one all-gather)."""
    mine = torch.tensor([step], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    steps = [int(t.item()) for t in gathered]
    source = sync_source(steps)
    return source, steps[source]


def sync_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
               step: int) -> int:
    """Make ``model`` and ``optimizer`` equal to the source rank's; the step to go on from.

    Model tensors (parameters and buffers) are broadcast in place, so references
    to them (an optimizer's param groups) stay valid. The optimizer's state is
    sent whole as one object: a newcomer's optimizer has no state before its
    first step, so its tensors cannot be broadcast into.
    """
    source, source_step = agree_on_source(step, _device(model))
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if isinstance(tensor, torch.Tensor):
                dist.broadcast(tensor, source)
    if optimizer is not None:
        box: list[Any] = [optimizer.state_dict() if dist.get_rank() == source else None]
        dist.broadcast_object_list(box, source, device=_device(model))
        if dist.get_rank() != source:
            optimizer.load_state_dict(box[0])
    return source_step
