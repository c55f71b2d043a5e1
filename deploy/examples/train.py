"""A tiny DDP training job for the elasticrun examples: CPU (gloo) friendly, checkpointed.

Run by torchrun, which the elasticrun webhook configures through PET_* variables:

    torchrun train.py --epochs 20 --checkpoint /checkpoints/run.pt

Elastic training restarts every worker whenever the group changes (a node is
lost or a new one joins), so the script is written to be restarted at any
time: rank 0 saves a checkpoint atomically after every epoch, and every worker
resumes from the last one. It learns a fixed linear function from synthetic
data, so it needs no dataset and finishes in seconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger("train")
FEATURES = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps-per-epoch", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint", type=Path,
                        default=Path(os.environ.get("CHECKPOINT", "checkpoint.pt")),
                        help="shared by all nodes (default: $CHECKPOINT or ./checkpoint.pt)")
    parser.add_argument("--backend", default="auto", help="gloo, nccl, or auto")
    return parser.parse_args()


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The epoch to start from: 0 without a checkpoint."""
    if not path.exists():
        return 0
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["epoch"])


def save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         epoch: int) -> None:
    """Write then rename, so a worker killed mid-save never leaves a torn checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": epoch}, tmp)
    os.replace(tmp, path)


def batch(epoch: int, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic data, different per rank and step, the same after a restart."""
    generator = torch.Generator().manual_seed(epoch * 1_000_003 + step * 1_009 + rank)
    target = torch.arange(1, FEATURES + 1, dtype=torch.float32) / FEATURES
    x = torch.randn(size, FEATURES, generator=generator)
    y = x @ target + 0.01 * torch.randn(size, generator=generator)
    return x, y.unsqueeze(1)


def main() -> int:
    args = parse_args()
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank {rank}/{world} %(message)s")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Linear(FEATURES, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    start = load(args.checkpoint, model, optimizer)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log.info("run %s, restart %s, starting at epoch %d of %d",
             os.environ.get("TORCHELASTIC_RUN_ID", "?"), restart, start, args.epochs)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if backend == "nccl" else None)
    loss_fn = torch.nn.MSELoss()
    loss = torch.tensor(0.0)
    first_step = True
    for epoch in range(start, args.epochs):
        for step in range(args.steps_per_epoch):
            x, y = batch(epoch, step, rank, args.batch_size)
            optimizer.zero_grad()
            loss = loss_fn(ddp(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            if first_step:
                # When training moves again after a restart: what a lost or added
                # node costs, beyond the round itself.
                log.info("first step done (epoch %d)", epoch)
                first_step = False
        if rank == 0:
            save(args.checkpoint, model, optimizer, epoch + 1)
        dist.barrier()
        log.info("epoch %d done, loss %.5f", epoch + 1, loss.item())
    dist.destroy_process_group()
    return 0


def leave(code: int) -> None:
    """Exit with ``code``, logs flushed, without the interpreter's teardown.

    With torch 2.15 and gloo, a worker that has finished and destroyed its
    process group can still abort in the teardown that follows its last line
    of Python ("terminate called without an active exception", SIGABRT):
    5 of 39 runs of two torchrun agents on torch's own c10d backend, on a
    loaded machine, always in rank 1; none of 40 that left this way.  torchrun
    takes that for a failure and restarts every node's workers, which resume
    from the last checkpoint only to finish again.  Nothing is left that the
    operating system does not release itself.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
