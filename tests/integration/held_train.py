"""A DDP worker that trains until the test says stop: windows that no machine's speed ends.

``deploy/examples/train.py`` runs a fixed number of epochs, so a test that must
watch a healthy round for a while can only guess how many outlast its window:
too few end inside it on a fast machine, too many waste minutes on a slow one.
This worker has no fixed length.  After every epoch rank 0 looks for the file
``--stop-file`` and tells every rank what it saw, so all stop after the same
epoch and exit 0.  The rest is ``train.py``'s: gloo, a checkpoint rank 0
replaces atomically after every epoch, resumption from it, and the same log
lines (``starting at epoch``, ``epoch N done``), which the tests read, and
its way out (``train.leave``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy" / "examples"))
from train import leave  # the example's way out: one home for the workaround

log = logging.getLogger("train")
#: An epoch's length; short enough that the stop is seen quickly, long enough that a
#: waiting test is not competing with a busy loop for the machine's two cores.
EPOCH_SECONDS = 0.2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank {rank}/{world} %(message)s")
    weights = torch.zeros(4)
    epoch = 0
    if args.checkpoint.exists():
        state = torch.load(args.checkpoint, weights_only=True)
        weights, epoch = state["weights"], int(state["epoch"])
    log.info("run %s, restart %s, starting at epoch %d",
             os.environ.get("TORCHELASTIC_RUN_ID", "?"),
             os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), epoch)
    stop = torch.zeros(1)
    while not stop.item():
        time.sleep(EPOCH_SECONDS)
        update = torch.ones(4)
        dist.all_reduce(update)
        weights += update
        epoch += 1
        if rank == 0:
            tmp = args.checkpoint.with_suffix(".tmp")
            torch.save({"weights": weights, "epoch": epoch}, tmp)
            os.replace(tmp, args.checkpoint)
            stop.fill_(float(args.stop_file.exists()))
        dist.broadcast(stop, src=0)
        log.info("epoch %d done, loss %.5f", epoch, 1.0 / epoch)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())
