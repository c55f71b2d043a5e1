"""A training worker for the in-place tests, started with multiprocessing's ``spawn``.

Each worker trains a tiny DDP model through :class:`elasticrun.inplace.Group`
and appends one JSON line per event to its own log file (a file, not a
multiprocessing queue: a worker that ``os._exit``s mid-write cannot tear
another's message). Every worker starts from different weights, so equal
parameters after a sync are the sync's doing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

#: The round a worker waits for before ``hold_at`` (the test's newcomer round).
HOLD_FOR_ROUND = 3


def batch(step: int, rank: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(8, 4, generator=generator)
    return x, x.sum(dim=1, keepdim=True)


def worker(round_file: str, log_file: str, seed: int, total: int, die_at: int,
           hold_at: int, pace: float) -> None:
    """Train ``total`` steps; ``os._exit`` at step ``die_at``; before step ``hold_at`` wait
    (bounded) until the node's round file holds round :data:`HOLD_FOR_ROUND`."""
    os.environ.update({"ELASTICRUN_ROUND_FILE": round_file, "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "inplace-test"})
    import torch

    from elasticrun.inplace import FileRoundSource, Group

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker {seed}: %(message)s")

    def say(event: str, group: Group | None = None, **fields: Any) -> None:
        if group is not None:
            fields.update(round=group.round.number if group.round else None, rank=group.rank,
                          world=group.world_size, env_rank=os.environ["RANK"],
                          env_world=os.environ["WORLD_SIZE"], step=group.step,
                          params=[p.detach().flatten().tolist() for p in model.parameters()],
                          momentum=[optimizer.state[p]["momentum_buffer"].flatten().tolist()
                                    for p in model.parameters() if p in optimizer.state])
        with Path(log_file).open("a") as out:
            out.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    say("ready")
    with Group.from_env(timeout=5.0, round_timeout=60.0) as group:
        group.sync(model, optimizer)
        say("synced", group)
        ddp = group.wrap(model)
        loss_fn = torch.nn.MSELoss()

        def train_step() -> None:
            if group.step == die_at:
                os._exit(3)
            x, y = batch(group.step, group.rank)
            optimizer.zero_grad()
            loss_fn(ddp(x), y).backward()
            optimizer.step()

        own = FileRoundSource(Path(round_file))
        while group.step < total:
            if group.step == hold_at:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    latest = own.latest()
                    if latest is not None and latest.number >= HOLD_FOR_ROUND:
                        break
                    time.sleep(0.02)
            group.run(train_step)
            say("step", group)
            time.sleep(pace)
        say("done", group, recoveries=group.recoveries)
