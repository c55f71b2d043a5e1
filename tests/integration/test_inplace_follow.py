"""In-place mode's agent side against the real API server: nodes are handler threads.

With ``--rdzv-conf in_place=1`` torchrun is not asked to restart for a lost
member (``num_nodes_waiting()`` stays 0): each node's follower joins the next
round itself and writes the node's new place to its round file, which is what
``elasticrun.inplace`` workers poll. A newcomer still restarts the workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elasticrun.api.roundfile import Round, decode_round

from conftest import wait_for
from rdzv import rendezvous_all, start_rendezvous


def _round(path: Path) -> Round | None:
    try:
        return decode_round(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None


def test_followers_re_form_a_round_that_lost_a_member_without_restarts(
        make_handler: Any, tmp_path: Path) -> None:
    files = {f"n{i}": tmp_path / f"n{i}.json" for i in range(4)}
    nodes = [make_handler("inplace", f"n{i}", min_nodes=2, max_nodes=3, in_place=1,
                          round_file=str(files[f"n{i}"])) for i in range(3)]
    first = rendezvous_all(nodes)
    assert all(o.error is None for o in first.values()), first
    for name, outcome in first.items():
        written = _round(files[name])
        assert written is not None and (written.node_rank, written.num_nodes) \
            == (outcome.rank, 3)
        assert written.store_port == outcome.info.bootstrap_store_info.master_port
    leaver = next(h for h in nodes if first[h.settings.node_name].rank == 2)
    survivors = [h for h in nodes if h is not leaver]
    round_one = _round(files["n0"])
    assert round_one is not None

    leaver.shutdown()
    after = wait_for(lambda: all(
        (r := _round(files[h.settings.node_name])) is not None and r.num_nodes == 2
        for h in survivors) and [_round(files[h.settings.node_name]) for h in survivors],
        40, "the survivors' round files to name a round of two")
    assert all(h.num_nodes_waiting() == 0 for h in survivors), "torchrun never restarts"
    assert {r.node_rank for r in after if r} == {0, 1}
    assert len({(r.number, r.store) for r in after if r}) == 1, "one round, one store"
    assert after[0] is not None and after[0].number > round_one.number

    # A newcomer: torchrun restarts the members' workers (its agent assigns worker
    # ranks together with every agent of its round), as without in-place mode.
    newcomer = make_handler("inplace", "n3", min_nodes=2, max_nodes=3, in_place=1,
                            round_file=str(files["n3"]))
    thread, box = start_rendezvous(newcomer)
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in survivors), 30,
             "the members to ask torchrun for a restart")
    assert [_round(files[h.settings.node_name]) for h in survivors] == after, \
        "the followers did not move"
    second = rendezvous_all(survivors)  # what torchrun's restart does
    thread.join(60)
    assert "info" in box, box.get("error")
    assert all(o.error is None and o.world_size == 3 for o in second.values())
    trio = [*survivors, newcomer]
    rounds = [_round(files[h.settings.node_name]) for h in trio]
    assert {r.node_rank for r in rounds if r} == {0, 1, 2}
    assert len({(r.number, r.store, r.num_nodes) for r in rounds if r}) == 1
    assert all(h.num_nodes_waiting() == 0 for h in trio)
