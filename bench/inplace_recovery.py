"""How long in-place recovery takes on one machine: Gloo, 3 workers, one lost.

    PYTHONPATH=handler python -m bench.inplace_recovery --repeats 5

Each repeat starts 3 workers (forked from one server that imported torch
once) training a small DDP model through :class:`elasticrun.inplace.Group`;
worker 2 ``os._exit``s at step 3. The parent plays the agent: it polls the
worker's exit, serves a fresh TCPStore for round 2 and writes the survivors'
round files. Every time is wall clock on this machine, so the parts add up:

- ``detect``: the death (the worker's last timestamp) to the survivors' failed step;
- ``agent``: the death to the round-2 files written (here a 1 ms poll; in a
  cluster, the rendezvous handler's next round: about 0.2 s in ``make demo``);
- ``regroup``: the round file seen to the new group formed (``init_process_group``);
- ``state``: formed to model, optimizer and step re-synced;
- ``ddp``: re-synced to every DDP re-made;
- ``total``: the death to the survivors' first completed step in round 2.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

DIE_AT = 3
TOTAL = 6


def worker(round_file: str, log_file: str, die: bool) -> None:
    """One training worker; appends JSON lines (events with wall-clock times) to ``log_file``."""
    os.environ.update({"ELASTICRUN_ROUND_FILE": round_file, "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1"})
    import torch  # noqa: PLC0415

    from elasticrun.inplace import Group  # noqa: PLC0415

    torch.set_num_threads(1)

    def say(**fields: Any) -> None:
        with Path(log_file).open("a") as out:
            out.write(json.dumps({"time": time.time(), **fields}) + "\n")

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with Group.from_env(timeout=10.0, round_timeout=30.0) as group:
        group.sync(model, optimizer)
        ddp = group.wrap(model)

        def step() -> None:
            if die and group.step == DIE_AT:
                say(event="dying")
                os._exit(3)
            x = torch.randn(32, 64)
            optimizer.zero_grad()
            ddp(x).pow(2).mean().backward()
            optimizer.step()

        while group.step < TOTAL:
            group.run(step)
            say(event="step", round=group.round.number if group.round else 0,
                step=group.step)
        say(event="done", changes=[vars(c) for c in group.changes])


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def one_repeat(ctx: Any, folder: Path) -> dict[str, float]:
    import torch.distributed as dist  # noqa: PLC0415

    from elasticrun.inplace import Round, write_round  # noqa: PLC0415

    files = [folder / f"node{i}.json" for i in range(3)]
    logs = [folder / f"worker{i}.log" for i in range(3)]
    procs = [ctx.Process(target=worker, args=(str(files[i]), str(logs[i]), i == 2), daemon=True)
             for i in range(3)]
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                            use_libuv=True, timeout=dt.timedelta(seconds=30))]
    try:
        for p in procs:
            p.start()
        for i in range(3):
            write_round(files[i], Round(1, i, 3, "127.0.0.1", stores[0].port))
        deadline = time.monotonic() + 120
        while procs[2].exitcode is None and time.monotonic() < deadline:
            time.sleep(0.001)
        stores.append(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    use_libuv=True, timeout=dt.timedelta(seconds=30)))
        for i in range(2):
            write_round(files[i], Round(2, i, 2, "127.0.0.1", stores[1].port))
        written = time.time()
        for p in procs[:2]:
            p.join(max(1.0, deadline - time.monotonic()))
        died = next(e["time"] for e in _events(logs[2]) if e["event"] == "dying")
        done = [next(e for e in _events(log) if e["event"] == "done") for log in logs[:2]]
        first = [next(e["time"] for e in _events(log)
                      if e["event"] == "step" and e["round"] == 2) for log in logs[:2]]
        change = [d["changes"][0] for d in done]
        return {"detect": max(c["started"] for c in change) - died,
                "agent": written - died,
                "regroup": max(c["formed"] - c["round_seen"] for c in change),
                "state": max(c["state"] - c["formed"] for c in change),
                "ddp": max(c["synced"] - c["state"] for c in change),
                "total": max(first) - died}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "elasticrun.inplace"])
    results = []
    for n in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            results.append(one_repeat(ctx, Path(folder)))
        print(f"repeat {n + 1}: " + ", ".join(f"{k} {v * 1000:.1f} ms"
                                             for k, v in results[-1].items()), flush=True)
    for key in results[0]:
        values = sorted(r[key] * 1000 for r in results)
        print(f"{key:8s} median {statistics.median(values):7.1f} ms  "
              f"min {values[0]:7.1f}  max {values[-1]:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
