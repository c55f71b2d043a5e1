"""Assignment slices as data: which slice tells a node, their names, what the operator
writes, and what the CRD accepts (``elasticrun.api.slices``)."""

from __future__ import annotations

import collections
import datetime as dt
import json
import os
import subprocess
import sys

from elasticrun.api import crd, slices
from elasticrun.api.model import Assignment, StoreAddress
from elasticrun.api.naming import is_dns_label

T0 = dt.datetime(2026, 12, 7, 18, 0, 0, 123456, tzinfo=dt.UTC)
NAMES = [f"node-{i:04d}" for i in range(2048)]


def place(rank: int, round_: int = 4, world: int = 2048, leader: str = "node-0000") -> Assignment:
    return Assignment(round=round_, rank=rank, world_size=world,
                      store=StoreAddress("10.0.0.1", 29400), leader=leader, since=T0)


def test_a_node_is_told_in_the_same_slice_by_every_process() -> None:
    """Not Python's salted ``hash``: the operator and every member must agree."""
    script = ("import sys; from elasticrun.api import slices; "
              "print([slices.slice_index(n) for n in sys.argv[1:]])")
    answers = {
        subprocess.run([sys.executable, "-c", script, *NAMES[:50]], check=True,
                       capture_output=True, text=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2")}
    assert answers == {f"{[slices.slice_index(n) for n in NAMES[:50]]}\n"}


def test_the_crds_largest_run_fills_every_slice_evenly() -> None:
    sizes = collections.Counter(slices.slice_index(name) for name in NAMES)
    assert sorted(sizes) == list(range(slices.SLICE_COUNT))
    mean = len(NAMES) / slices.SLICE_COUNT
    assert max(sizes.values()) < 1.5 * mean and min(sizes.values()) > 0.5 * mean


def test_slices_are_named_by_the_runs_uid_so_a_run_made_again_never_reads_the_old_ones(
        ) -> None:
    before = slices.slice_names("0b6f0c0e-9d6c-4c55-9a39-4b0d1f6b7a10")
    again = slices.slice_names("d2a5e0f1-1c4e-4f0e-8a59-2f3c5b8e9d71")  # same run name
    assert len(set(before)) == len(before) == slices.SLICE_COUNT
    assert not set(before) & set(again)
    assert all(is_dns_label(name) for name in before + again)


def test_due_slices_hold_every_place_of_theirs_and_skip_those_told() -> None:
    places = {name: place(rank, world=100) for rank, name in enumerate(NAMES[:100])}
    every = slices.due(places, frozenset())
    assert [s.index for s in every] == sorted({slices.slice_index(n) for n in NAMES[:100]})
    assert sorted(n for s in every for n in s.places) == sorted(NAMES[:100])
    assert all(slices.slice_index(n) == s.index
               and slices.read_place(s.manifest("r", "ns", "uid"), "r", n) == places[n]
               for s in every for n in s.places)
    told = frozenset(s.index for s in every[:3])
    rest = slices.due(places, told)
    assert rest == every[3:]  # the same slices, each whole
    assert slices.due(places, frozenset(s.index for s in every)) == []
    assert slices.due({}, frozenset()) == []


def test_a_slice_manifest_is_the_whole_slice_owned_by_its_run() -> None:
    [piece] = slices.due({"node-0007": place(7)}, frozenset())
    manifest = piece.manifest("team.run", "ns", "uid-1")
    assert manifest["metadata"]["name"] == slices.slice_name("uid-1", piece.index)
    assert manifest["metadata"]["ownerReferences"] == [{
        "apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": "team.run", "uid": "uid-1",
        "blockOwnerDeletion": False}]
    assert manifest["spec"] == {
        "run": "team.run", "round": 4, "worldSize": 2048,
        "store": {"host": "10.0.0.1", "port": 29400}, "leader": "node-0000",
        "places": {"node-0007": {"rank": 7, "since": "2026-12-07T18:00:00.123456Z"}}}
    assert slices.read_place(manifest, "team.run", "node-0007") == place(7)
    assert slices.read_place(manifest, "team.run", "node-0008") is None


def test_a_place_costs_its_rank_and_request_once_the_rounds_terms_are_shared() -> None:
    """What makes a slice worth sending whole to each of its ~64 members: the round's
    terms once, then per member little more than its name."""
    names = [n for n in NAMES if slices.slice_index(n) == 0]
    [piece] = slices.due({n: place(rank) for rank, n in enumerate(names)}, frozenset())
    spec = json.dumps(piece.manifest("run", "ns", "uid")["spec"], separators=(",", ":"))
    per_place = (len(spec) - 200) / len(names)
    assert 50 < len(names) < 80 and per_place < 55 + len("node-0000")


def test_a_slice_holds_the_crds_largest_run() -> None:
    """The CRD bounds a slice's places by the largest run it admits (``maxNodes``), and
    even that run's slice, every name hashed into it and 253 characters long, stays
    below etcd's 1.5 MiB request limit."""
    schema = crd.slice_crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    most = crd.spec_maximum("maxNodes")
    assert schema["properties"]["spec"]["properties"]["places"]["maxProperties"] == most
    longest = {f"{i:04d}".ljust(253, "n"): Assignment(
        round=crd.counter_maximum(), rank=i, world_size=most,
        store=StoreAddress("f" * 253, 65535), leader="l" * 253, since=T0) for i in range(most)}
    whole = slices.Slice(0, crd.counter_maximum(), most, StoreAddress("f" * 253, 65535),
                         "l" * 253, {n: slices.Place(a.rank, a.since) for n, a in longest.items()})
    size = len(json.dumps(whole.manifest("r" * 253, "ns", "u" * 36), separators=(",", ":")))
    assert size < 1024 * 1024
