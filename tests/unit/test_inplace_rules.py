"""The pure parts of in-place recovery: the round file, the decisions, the file source.

None of them needs torch (the test says so: it fails if one imports it)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from elasticrun.api.roundfile import (
    MAX_BYTES,
    Round,
    RoundFileError,
    decode_round,
    encode_round,
    write_round,
)
from elasticrun.inplace.decide import (
    Verdict,
    applies,
    classify,
    must_regroup,
    place,
    regroups_left,
    store_prefix,
    sync_source,
)
from elasticrun.inplace.source import FileRoundSource, RoundTimeoutError

ROUND = Round(number=7, node_rank=1, num_nodes=3, store_host="10.0.0.12", store_port=29400)


# ---------------------------------------------------------------------- the round file

def test_a_round_survives_encoding() -> None:
    assert decode_round(encode_round(ROUND)) == ROUND
    six = Round(2, 0, 1, "fd00::1", 1)
    assert json.loads(encode_round(six))["store"] == "[fd00::1]:1"
    assert decode_round(encode_round(six)) == six


def test_unknown_keys_are_ignored_so_a_newer_agent_may_add_some() -> None:
    doc = json.loads(encode_round(ROUND)) | {"run": "r", "members": ["a", "b"]}
    assert decode_round(json.dumps(doc)) == ROUND


@pytest.mark.parametrize(("change", "says"), [
    ({"round": 0}, "'round'=0 is outside"),
    ({"round": True}, "'round' must be a whole number"),
    ({"round": "7"}, "'round' must be a whole number"),
    ({"round": 2**31}, "outside"),
    ({"node_rank": 3}, "'node_rank'=3 is outside 0..2"),
    ({"node_rank": -1}, "outside"),
    ({"num_nodes": 0}, "'num_nodes'=0"),
    ({"num_nodes": None}, "'num_nodes' must be a whole number"),
    ({"store": "10.0.0.12"}, "not host:port"),
    ({"store": "10.0.0.12:0"}, "port from 1 to 65535"),
    ({"store": "10.0.0.12:65536"}, "not host:port"),
    ({"store": "bad host:1"}, "not host:port"),
    ({"store": 29400}, "'store' must be a 'host:port' string"),
    ({"store": "h" * 400 + ":1"}, "'store' must be"),
])
def test_a_bad_field_is_named(change: dict[str, object], says: str) -> None:
    doc = json.loads(encode_round(ROUND)) | change
    with pytest.raises(RoundFileError, match=says):
        decode_round(json.dumps(doc))


@pytest.mark.parametrize(("raw", "says"), [
    ("", "not JSON"), ("{", "not JSON"), (b"\xff\xfe", "not JSON"), ("[1]", "a JSON object"),
    ("x" * (MAX_BYTES + 1), "more than"),
])
def test_what_is_not_a_round_file_is_refused(raw: str | bytes, says: str) -> None:
    with pytest.raises(RoundFileError, match=says):
        decode_round(raw)


# ---------------------------------------------------------------------- decisions

def test_ranks_follow_torchruns_layout() -> None:
    placement = place(ROUND, local_rank=2, local_world_size=4)
    assert (placement.rank, placement.world_size, placement.node_rank) == (6, 12, 1)
    env = placement.environ(ROUND)
    assert (env["RANK"], env["WORLD_SIZE"], env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) \
        == ("6", "12", "1", "3")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["ELASTICRUN_ROUND"]) \
        == ("10.0.0.12", "29400", "7")
    # Every worker of every node gets a different rank below the world size.
    ranks = {place(Round(1, n, 3, "h", 1), local, 4).rank for n in range(3) for local in range(4)}
    assert ranks == set(range(12))
    with pytest.raises(ValueError, match="LOCAL_RANK=4"):
        place(ROUND, 4, 4)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=0"):
        place(ROUND, 0, 0)


class DistBackendError(RuntimeError):
    """Named like torch's, which is what classify() looks for."""


@pytest.mark.parametrize(("exc", "verdict"), [
    (RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [1.2.3.4]:5"),
     Verdict.REGROUP),
    (RuntimeError("[../pair.cc:545] Read error [127.0.0.1]:1: Connection reset by peer"),
     Verdict.REGROUP),
    (RuntimeError("[unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation"),
     Verdict.REGROUP),
    (DistBackendError("NCCL error: remote process exited"), Verdict.REGROUP),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), Verdict.RAISE),
    (RuntimeError("CUDA out of memory"), Verdict.RAISE),
    (ValueError("connection closed by peer"), Verdict.RAISE),  # not torch's kind of error
    (KeyboardInterrupt(), Verdict.RAISE),
    (RuntimeError("x" * 5000 + "Connection closed by peer"), Verdict.RAISE),  # only the start
])
def test_only_a_lost_peer_regroups(exc: BaseException, verdict: Verdict) -> None:
    assert classify(exc) is verdict


def test_which_round_applies() -> None:
    assert applies(ROUND, 6) and not applies(ROUND, 7) and not applies(None, 0)
    assert must_regroup(3, 4) and not must_regroup(4, 4)


def test_the_state_comes_from_the_lowest_rank_furthest_along() -> None:
    assert sync_source([5, 5, 0]) == 0
    assert sync_source([0, 12, 12, 3]) == 1  # a newcomer at rank 0 never wins
    assert sync_source([0]) == 0
    with pytest.raises(ValueError, match="no ranks"):
        sync_source([])


def test_every_round_has_its_own_keys() -> None:
    assert store_prefix("run", 3) != store_prefix("run", 4)
    assert regroups_left(0, 1) and not regroups_left(1, 1)


# ---------------------------------------------------------------------- the file source

def test_the_file_source_waits_for_a_newer_round(tmp_path: Path) -> None:
    path = tmp_path / "round.json"
    source = FileRoundSource(path, poll_interval=0.005)
    assert source.latest() is None
    with pytest.raises(RoundTimeoutError, match="no round after 0"):
        source.wait_newer(0, timeout=0.05)
    write_round(path, ROUND)
    assert source.wait_newer(6, timeout=1) == ROUND
    later = Round(8, 0, 2, "10.0.0.13", 29400)
    writer = threading.Timer(0.05, write_round, (path, later))
    writer.start()
    try:
        assert source.wait_newer(7, timeout=5) == later
    finally:
        writer.join()
    assert [p.name for p in tmp_path.iterdir()] == ["round.json"], "no temporary file left"


def test_an_unusable_file_keeps_the_last_round_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "round.json"
    write_round(path, ROUND)
    source = FileRoundSource(path, poll_interval=0.005)
    assert source.latest() == ROUND
    path.write_text('{"round": "eight"}')
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1))
    assert source.latest() == ROUND
    with pytest.raises(RoundTimeoutError, match="unusable: round file: 'num_nodes'"):
        source.wait_newer(7, timeout=0.05)


def test_the_source_comes_from_the_environment(tmp_path: Path) -> None:
    assert FileRoundSource.from_env({}) is None
    source = FileRoundSource.from_env({"ELASTICRUN_ROUND_FILE": str(tmp_path / "r.json")})
    assert source is not None and source.path == tmp_path / "r.json"


def test_the_rules_load_without_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import elasticrun.inplace as i, elasticrun.inplace.decide, elasticrun.inplace.source\n"
            "assert i.classify(RuntimeError('Connection closed by peer')).value == 'regroup'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
