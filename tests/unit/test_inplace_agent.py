"""The agent's side of in-place mode as far as it is built: the settings and the round file
the handler writes for its workers after every round (docs/in-place.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elasticrun.api.roundfile import Round, decode_round
from elasticrun.handler.settings import SettingsError, from_parameters


@pytest.fixture(autouse=True)
def pod_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "team")
    monkeypatch.setenv("POD_NAME", "trainer-3")
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    monkeypatch.delenv("ELASTICRUN_ROUND_FILE", raising=False)


def settings(conf: dict[str, Any]) -> Any:
    return from_parameters(run_id="run", endpoint="", min_nodes=1, max_nodes=2,
                           local_addr=None, conf=conf)


def test_in_place_is_off_unless_asked_for() -> None:
    plain = settings({})
    assert (plain.in_place, plain.round_file) == (False, None)
    with pytest.raises(SettingsError, match="in_place"):
        settings({"in_place": "maybe"})


def test_the_round_file_is_given_or_one_per_run_and_node(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    default = settings({"in_place": "1"})
    assert default.in_place
    assert Path(default.round_file).name == "elasticrun-run.trainer-3.round.json"
    assert settings({"in_place": "true", "round_file": str(tmp_path / "a.json")}).round_file \
        == str(tmp_path / "a.json")
    monkeypatch.setenv("ELASTICRUN_ROUND_FILE", str(tmp_path / "b.json"))
    assert settings({"in_place": "yes"}).round_file == str(tmp_path / "b.json")
    monkeypatch.delenv("ELASTICRUN_ROUND_FILE")
    assert Path(settings({"in_place": "1", "node_name": "a/b c"}).round_file).name \
        == "elasticrun-run.a_b_c.round.json"


def test_the_handler_tells_its_workers_the_round(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from elasticrun.handler.executor import tell_workers

    path = tmp_path / "node.json"
    monkeypatch.setenv("ELASTICRUN_ROUND_FILE", "elsewhere")  # restored after the test
    (tmp_path / "node.json.lost").write_text('{"round": 3}')
    tell_workers(settings({"in_place": "1", "round_file": str(path)}), Round(4, 1, 3, "10.1.2.9",
                                                                            29400))
    assert decode_round(path.read_bytes()) == Round(4, 1, 3, "10.1.2.9", 29400)
    assert not (tmp_path / "node.json.lost").exists(), "the new round answers the report"
    import os

    assert os.environ["ELASTICRUN_ROUND_FILE"] == str(path), "the workers inherit the path"


def test_a_loss_is_followed_in_place_and_a_newcomer_restarts_the_workers() -> None:
    from elasticrun.api import rounds
    from elasticrun.handler.step import has_newcomers, in_place_move

    from builders import at, run, sealed, waiting

    full = sealed("a", "b", "c")
    lost = rounds.remove_member(full, "c", "PodFailed", at(1))
    assert lost is not None
    assert in_place_move(run(full), 1, at(1)) == "stay"
    assert in_place_move(run(lost), 1, at(1)) == "follow"
    # The node's own workers reported that their group failed in this round.
    assert in_place_move(run(full), 1, at(1), lost_round=1) == "follow"
    assert in_place_move(run(full), 2, at(1), lost_round=1) == "stay", "answered already"
    # A survivor rejoining (its join notice moves every member) is no newcomer.
    rejoined = lost.replace(join_notice=1)
    assert not has_newcomers(run(rejoined), waiting("a"))
    assert in_place_move(run(rejoined), 1, at(1)) == "follow"
    # A newcomer among the join requests, or in the status; or a round without us.
    assert has_newcomers(run(full, max_nodes=4), waiting("n"))
    assert has_newcomers(run(full.replace(waiting=waiting("n")), max_nodes=4), ())
    assert in_place_move(run(full.replace(join_notice=1), max_nodes=4), 1, at(1),
                         newcomers=True) == "restart"
    assert in_place_move(run(lost), 1, at(1), newcomers=True) == "restart"
    assert in_place_move(run(sealed("a", "b", round_=2)), 1, at(1)) == "restart"
    # Nothing changes while torchrun would not restart (a spare beside a full round).
    assert in_place_move(run(full.replace(waiting=waiting("s")), max_nodes=3), 1, at(1),
                         newcomers=True) == "stay"
    assert in_place_move(run(lost), 0, at(1)) == "stay", "not before a first round"


def test_workers_report_a_lost_round_next_to_the_round_file(tmp_path: Path) -> None:
    from elasticrun.api.roundfile import MAX_BYTES, RoundFileError, decode_lost, lost_file
    from elasticrun.inplace.source import FileRoundSource

    path = tmp_path / "node.json"
    FileRoundSource(path).report_lost(4)
    assert lost_file(path) == tmp_path / "node.json.lost"
    assert decode_lost(lost_file(path).read_bytes()) == 4
    # The long one is a lost round in every other respect: only the size refuses it.
    padded = '{"round": 4, "pad": "' + "x" * MAX_BYTES + '"}'
    for bad, says in (("", "not JSON"), ("[]", "a JSON object"),
                      ('{"round": 0}', "'round'=0 is outside"),
                      ('{"round": true}', "'round' must be a whole number"),
                      (padded, f"more than.*{MAX_BYTES}")):
        with pytest.raises(RoundFileError, match=says):
            decode_lost(bad)
