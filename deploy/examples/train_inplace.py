"""The example job of ``train.py``, written to survive membership changes in place.

    torchrun --rdzv-backend=k8s --rdzv-conf in_place=1 train_inplace.py --steps 1000

Each step runs inside ``group.run``: when a node is lost, the step's
collective fails within ``--timeout`` seconds, the worker waits for the next
round the node's agent writes to ``$ELASTICRUN_ROUND_FILE``, re-forms the
process group with the survivors in the same process, takes the state of the
lowest surviving rank, and runs the step again. A newcomer joins the same
way: it receives the model, the optimizer and the step counter from a
survivor, so it needs no checkpoint. Without ``$ELASTICRUN_ROUND_FILE`` this
is an ordinary DDP script that torchrun restarts on a change (checkpoints are
still written, for that case and for the job's end).

See docs/in-place.md for what is built and what is not yet.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch

from elasticrun import inplace

log = logging.getLogger("train_inplace")
FEATURES = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds before a collective with a frozen peer fails")
    parser.add_argument("--checkpoint", type=Path,
                        default=Path(os.environ.get("CHECKPOINT", "checkpoint.pt")))
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--sleep", type=float, default=0.0,
                        help="seconds of pretend work per step (demos and tests)")
    return parser.parse_args()


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic data, different per rank and step."""
    generator = torch.Generator().manual_seed(step * 1_009 + rank)
    target = torch.arange(1, FEATURES + 1, dtype=torch.float32) / FEATURES
    x = torch.randn(size, FEATURES, generator=generator)
    return x, (x @ target).unsqueeze(1)


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = 0
    if args.checkpoint.exists():
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    loss_fn = torch.nn.MSELoss()
    with inplace.Group.from_env(timeout=args.timeout) as group:
        group.sync(model, optimizer, step=start)  # the furthest rank's state wins
        ddp = group.wrap(model)  # re-made on every new group

        def train_step() -> float:
            x, y = batch(group.step, group.rank, args.batch_size)
            optimizer.zero_grad()  # a retried step starts clean
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizer.step()
            if args.sleep:
                time.sleep(args.sleep)
            return float(loss.item())

        while group.step < args.steps:
            loss = group.run(train_step)
            if group.step % args.log_every == 0:
                log.info("step %d loss %.5f rank %d/%d round %s pid %d", group.step, loss,
                         group.rank, group.world_size,
                         group.round.number if group.round else "-", os.getpid())
            if group.step % args.checkpoint_every == 0 and group.rank == 0:
                tmp = args.checkpoint.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": group.step}, tmp)
                os.replace(tmp, args.checkpoint)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
