"""In-place recovery end to end on Gloo, without Kubernetes: the test plays the agent.

Three worker processes train a DDP model; the test writes each node's round
file and serves each round's TCPStore on 127.0.0.1 (a fresh one per round, as
each round's rank 0 would). One worker ``os._exit``s mid-training; the two
survivors, in the same processes, re-form the group when the round-2 files
appear and train on with world size 2 and identical parameters. Then a
newcomer joins in round 3 without anyone restarting, receives the state, and
all three finish with identical parameters.
"""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing as mp
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import inplacekit

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

TOTAL, DIE_AT, HOLD_AT, PACE = 20, 4, 10, 0.02
WAIT = 60.0


def _events(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]


def _in_common(one: Path, other: Path, round_: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The events of ``round_`` that two workers logged at the same step, paired."""
    steps = {e["step"]: e for e in _events(one) if e.get("round") == round_}
    return [(steps[e["step"]], e) for e in _events(other)
            if e.get("round") == round_ and e["step"] in steps]


def _wait_for(what: str, check: Callable[[], Any], procs: list[Any]) -> Any:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.02)
    codes = [p.exitcode for p in procs]
    raise AssertionError(f"timed out waiting for {what}; exit codes {codes}")


def _store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         use_libuv=True, timeout=dt.timedelta(seconds=30))


@pytest.mark.torchrun
@pytest.mark.timeout(150)
def test_survivors_recover_in_place_and_a_newcomer_joins(tmp_path: Path) -> None:
    from elasticrun.inplace import Round, write_round

    files = [tmp_path / f"node{i}.json" for i in range(4)]
    logs = [tmp_path / f"worker{i}.log" for i in range(4)]
    # One server imports torch once and forks every worker from it: four imports of
    # torch at once take most of a minute on a busy two-core machine.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "elasticrun.inplace", "inplacekit"])
    procs = [ctx.Process(target=inplacekit.worker, daemon=True,
                         args=(str(files[i]), str(logs[i]), 100 + i, TOTAL,
                               DIE_AT if i == 2 else -1, HOLD_AT if i < 2 else -1, PACE))
             for i in range(4)]  # 0-2: the first round's nodes; 3: the newcomer
    stores: list[Any] = []

    def publish(members: list[int]) -> None:
        stores.append(_store())
        for rank, node in enumerate(members):
            write_round(files[node], Round(len(stores), rank, len(members), "127.0.0.1",
                                           stores[-1].port))

    def last(i: int, event: str, round_: int | None = None) -> dict[str, Any] | None:
        found = [e for e in _events(logs[i]) if e["event"] == event
                 and (round_ is None or e.get("round") == round_)]
        return found[-1] if found else None

    try:
        for p in procs:
            p.start()
        _wait_for("every worker to start", lambda: all(last(i, "ready") for i in range(4)),
                  procs)
        publish([0, 1, 2])
        synced = [_wait_for(f"worker {i} in round 1", lambda i=i: last(i, "synced"), procs)
                  for i in range(3)]
        assert len({json.dumps(e["params"]) for e in synced}) == 1, "round 1 starts equal"

        _wait_for("worker 2 to die", lambda: procs[2].exitcode is not None, procs)
        assert procs[2].exitcode == 3
        publish([0, 1])
        after = [_wait_for(f"survivor {i} stepping in round 2",
                           lambda i=i: last(i, "step", round_=2), procs) for i in range(2)]
        for i, event in enumerate(after):
            assert event["pid"] == procs[i].pid, "the survivor is the same process"
            assert (event["world"], event["env_world"], event["rank"], event["env_rank"]) \
                == (2, "2", i, str(i))
        shared = _in_common(logs[0], logs[1], round_=2)
        assert shared, "the survivors logged no step of round 2 in common"
        for mine, theirs in shared:
            assert mine["params"] == theirs["params"], f"step {mine['step']}"
            assert mine["momentum"] == theirs["momentum"]
        assert not any(e["event"] == "step" and e["round"] == 1 and e["step"] > DIE_AT
                       for e in _events(logs[0])), "no step past the loss in round 1"

        publish([0, 1, 3])
        newcomer = _wait_for("the newcomer's sync", lambda: last(3, "synced"), procs)
        assert (newcomer["round"], newcomer["world"], newcomer["rank"]) == (3, 3, 2)
        at_join = _wait_for("survivor 0 at the newcomer's step", lambda: next(
            (e for e in _events(logs[0]) if e["event"] == "step"
             and e["step"] == newcomer["step"]), None), procs)
        assert at_join["round"] == 3 and DIE_AT < newcomer["step"] <= HOLD_AT + 1
        assert newcomer["params"] == at_join["params"], "the newcomer trains on the same state"
        assert newcomer["momentum"] == at_join["momentum"]

        done = [_wait_for(f"worker {i} to finish", lambda i=i: last(i, "done"), procs)
                for i in (0, 1, 3)]
        assert {(e["round"], e["world"], e["step"]) for e in done} == {(3, 3, TOTAL)}
        assert len({json.dumps(e["params"]) for e in done}) == 1
        assert [e["pid"] for e in done] == [procs[0].pid, procs[1].pid, procs[3].pid]
        assert len(done[0]["recoveries"]) == 2  # the loss, then the newcomer
        for i in (0, 1, 3):
            procs[i].join(WAIT)
            assert procs[i].exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        # The fork server (multiprocessing's own process) ends with its pipe; stop it now.
        from multiprocessing import forkserver

        forkserver._forkserver._stop()  # type: ignore[attr-defined]
