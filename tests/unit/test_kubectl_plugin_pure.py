"""kubectl elasticrun without a server: what each verb patches, what the screen shows."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import pytest

from elasticrun.api import crd
from elasticrun.api.model import ElasticRun, parse_run
from elasticrun.cli import screen, verbs
from elasticrun.cli.main import main

NOW = dt.datetime(2026, 12, 1, 17, 0, 0, tzinfo=dt.UTC)
T = "2026-12-01T16:59:00.000000Z"


def make_run(status: dict[str, Any] | None = None, annotations: dict[str, str] | None = None,
             **spec: Any) -> ElasticRun:
    return parse_run({
        "metadata": {"name": "r", "namespace": "ml", "resourceVersion": "42",
                     "annotations": annotations or {}},
        "spec": {"minNodes": 2, "maxNodes": 4, **spec},
        "status": status or {},
    })


RUNNING = {
    "phase": "Running", "round": 3, "signal": 5, "restartRound": 2,
    "store": {"host": "10.0.0.1", "port": 29400}, "sealedAt": T,
    "participants": [
        {"name": "node-b", "rank": 1, "pod": "train-b", "joinedRound": 2, "address": "10.0.0.2"},
        {"name": "node-a", "rank": 0, "pod": "train-a", "joinedRound": 1, "address": "10.0.0.1"},
    ],
    "waiting": [{"name": "node-d", "pod": "train-d", "since": T}],
    "lostMembers": [{"name": "node-c", "round": 2, "reason": "PodDeleted",
                     "message": "pod train-c was deleted", "time": T}],
    "conditions": [{"type": "RoundComplete", "status": "True", "reason": "Sealed",
                    "message": "round 3 has 2 members", "lastTransitionTime": T}],
    "desired": 3, "desiredFrom": "Job/train", "coming": 1,
}


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(("text", "expected"), [("2:4", (2, 4)), ("3", (3, 3)),
                                                (" 1 : 2048 ", (1, 2048))])
def test_a_size_is_min_colon_max_or_one_count(text: str, expected: tuple[int, int]) -> None:
    size = verbs.parse_size(text)
    assert (size.min_nodes, size.max_nodes) == expected


@pytest.mark.parametrize("text", ["", "2:", ":4", "two:four", "2-4", "2:4:6", "-1:3", "1.5:2"])
def test_a_malformed_size_says_how_to_write_one(text: str) -> None:
    with pytest.raises(verbs.UsageError, match=r"write MIN:MAX \(for example 2:4\)"):
        verbs.parse_size(text)


def test_min_above_max_is_refused_with_the_crds_own_message() -> None:
    with pytest.raises(verbs.UsageError) as refused:
        verbs.parse_size("5:2")
    crd_text = yaml_rule_message()
    assert crd_text.startswith("maxNodes must be greater than or equal to minNodes")
    assert str(refused.value) == f"'5:2': {crd_text}"


def yaml_rule_message() -> str:
    spec = crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "properties"]["spec"]
    (rule,) = [r for r in spec["x-kubernetes-validations"] if r["fieldPath"] == ".maxNodes"]
    return str(rule["message"])


@pytest.mark.parametrize(("text", "problem"), [("0:2", "minNodes must be 1 to 2048"),
                                               ("2:4096", "maxNodes must be 1 to 2048")])
def test_sizes_outside_the_crds_bounds_are_refused(text: str, problem: str) -> None:
    with pytest.raises(verbs.UsageError, match=problem):
        verbs.parse_size(text)


def test_resize_patches_both_fields_and_names_only_those_that_change() -> None:
    edit = verbs.resize(make_run(), verbs.parse_size("2:6"))
    assert edit.patch == {"spec": {"minNodes": 2, "maxNodes": 6}}
    assert edit.changes == (verbs.Change("spec.maxNodes", "4", "6"),)
    assert "next round" in edit.note
    unchanged = verbs.resize(make_run(), verbs.parse_size("2:4"))
    assert unchanged.patch is None
    assert unchanged.note == "the size is already 2:4; nothing changed"


# --------------------------------------------------------------------------- verbs


def test_close_and_reopen_set_spec_closed_as_the_readme_did() -> None:
    edit = verbs.close(make_run(RUNNING))
    assert edit.patch == {"spec": {"closed": True}}
    assert edit.changes == (verbs.Change("spec.closed", "false", "true"),)
    assert verbs.close(make_run(RUNNING, closed=True)).patch is None
    reopened = verbs.reopen(make_run({**RUNNING, "phase": "Closed"}, closed=True))
    assert reopened.patch == {"spec": {"closed": False}}
    assert verbs.reopen(make_run(RUNNING)).patch is None


def test_a_succeeded_run_is_not_reopened() -> None:
    succeeded = make_run({"phase": "Succeeded", "finishedAt": T}, closed=True)
    with pytest.raises(verbs.VerbError, match="a finished run is not reopened"):
        verbs.reopen(succeeded)


def test_restart_sets_the_operators_annotation_once_and_only_on_a_running_round() -> None:
    edit = verbs.restart(make_run(RUNNING))
    assert edit.patch == {"metadata": {"annotations": {crd.RESTART_ANNOTATION: "now"}}}
    assert "re-forms round 3" in edit.note
    pending = verbs.restart(make_run(RUNNING, annotations={crd.RESTART_ANNOTATION: "now"}))
    assert pending.patch is None and "already requested" in pending.note
    reforming = verbs.restart(make_run({**RUNNING, "restartRound": 3, "phase": "Degraded"}))
    assert reforming.patch is None and "already being re-formed" in reforming.note
    with pytest.raises(verbs.VerbError, match=r"not formed one yet .*minNodes \(2\)"):
        verbs.restart(make_run({"phase": "Forming"}))


def test_drain_appends_to_the_list_fenced_by_the_resource_version() -> None:
    run = make_run(RUNNING, annotations={crd.DRAIN_ANNOTATION: "x, node-z,,x"})
    edit = verbs.drain(run, "node-b")
    assert edit.patch == {"metadata": {"resourceVersion": "42", "annotations": {
        crd.DRAIN_ANNOTATION: "x,node-z,node-b"}}}
    assert edit.fenced
    assert "rank 1 of round 3" in edit.note and "Drained" in edit.note
    assert verbs.drain(run, "node-d").patch is not None  # a waiting node
    assert verbs.drain(run, "x").patch is None  # already drained


def test_drain_of_a_stranger_lists_members_and_waiting_nodes_unless_forced() -> None:
    run = make_run(RUNNING)
    with pytest.raises(verbs.VerbError) as refused:
        verbs.drain(run, "node-q")
    assert str(refused.value) == (
        "'node-q' is neither a member nor waiting. Members of round 3: node-a, node-b; "
        "waiting: node-d. To drain a node that has not joined yet, add --force")
    forced = verbs.drain(run, "node-q", force=True)
    assert forced.patch is not None
    assert forced.patch["metadata"]["annotations"] == {crd.DRAIN_ANNOTATION: "node-q"}


def test_undrain_removes_one_name_and_the_annotation_with_the_last() -> None:
    run = make_run(RUNNING, annotations={crd.DRAIN_ANNOTATION: "node-a,node-b"})
    edit = verbs.undrain(run, "node-a")
    assert edit.patch is not None
    assert edit.patch["metadata"]["annotations"] == {crd.DRAIN_ANNOTATION: "node-b"}
    last = verbs.undrain(make_run(RUNNING, annotations={crd.DRAIN_ANNOTATION: "node-b"}),
                         "node-b")
    assert last.patch is not None
    assert last.patch["metadata"]["annotations"] == {crd.DRAIN_ANNOTATION: None}
    with pytest.raises(verbs.VerbError, match=r"'node-c' is not drained. Drained nodes: "
                                              r"node-a, node-b"):
        verbs.undrain(run, "node-c")


def test_the_drain_list_is_the_one_the_operator_reads() -> None:
    run = make_run(RUNNING, annotations={crd.DRAIN_ANNOTATION: " b ,a,,b"})
    assert verbs.drain_list(run) == ["b", "a"]
    assert set(verbs.drain_list(run)) == run.drained


def test_describe_prints_every_change_and_what_follows() -> None:
    edit = verbs.resize(make_run(), verbs.parse_size("3:6"))
    assert verbs.describe("ml", "r", edit).splitlines() == [
        "elasticrun ml/r: resize", "  spec.minNodes: 2 -> 3", "  spec.maxNodes: 4 -> 6",
        "  takes effect in the next round (kubectl elasticrun restart RUN forms one now)"]
    assert verbs.describe("ml", "r", verbs.close(make_run(closed=True))) == (
        "elasticrun ml/r: spec.closed is already true; nothing changed")


def test_forbidden_names_the_verbs_the_plugin_verb_needs() -> None:
    text = verbs.forbidden_message("close", "patch", "ml", 'User "u" cannot patch ...')
    assert text.startswith("forbidden: close needs get, patch on elasticruns.elasticrun.dev in "
                           "namespace 'ml', and you may not patch them")
    assert "kubectl auth can-i patch elasticruns.elasticrun.dev -n ml" in text
    assert set(verbs.RIGHTS) == {"status", "list", "close", "reopen", "restart", "drain",
                                 "undrain", "resize"}


# --------------------------------------------------------------------------- the screen


def test_the_status_screen_shows_ranks_waiting_lost_and_conditions() -> None:
    run = make_run(RUNNING, annotations={crd.DRAIN_ANNOTATION: "node-b"})
    text = screen.status_screen(run, NOW - dt.timedelta(hours=2), NOW)
    lines = text.splitlines()
    assert lines[:4] == ["Run:        ml/r   (age 120m)", "Phase:      Running",
                         "Round:      3", "Size:       2:4 (minNodes:maxNodes)"]
    assert "Desired:    3 from Job/train (1 coming)" in lines
    assert "Store:      10.0.0.1:29400 (rank 0: node-a)" in lines
    assert "Sealed:     2026-12-01T16:59:00Z (60s ago)" in lines
    assert "Drained:    node-b" in lines
    ranks = lines.index("Ranks (2):")
    assert [line.split() for line in lines[ranks + 1:ranks + 4]] == [
        ["RANK", "MEMBER", "POD", "JOINED", "ADDRESS"],
        ["0", "node-a", "train-a", "1", "10.0.0.1"],
        ["1", "node-b", "(drained)", "train-b", "2", "10.0.0.2"]]
    waiting = lines.index("Waiting (1):")
    assert lines[waiting + 2].split() == ["node-d", "train-d", "60s", "ago"]
    lost = lines.index("Lost (1):")
    assert lines[lost + 2].split() == ["node-c", "2", "PodDeleted", "2026-12-01T16:59:00Z",
                                       "(60s", "ago)", "pod", "train-c", "was", "deleted"]
    conditions = lines.index("Conditions (1):")
    assert lines[conditions + 2].split()[:4] == ["RoundComplete", "True", "Sealed", "60s"]


def test_an_empty_run_says_none_for_each_section() -> None:
    text = screen.status_screen(make_run({"phase": "Pending"}), None, NOW)
    assert "Round:      0 (no round formed yet)" in text
    for section in ("Ranks", "Waiting", "Lost", "Conditions"):
        assert f"{section}: none" in text


def test_a_re_forming_round_and_a_pending_restart_are_said() -> None:
    run = make_run({**RUNNING, "phase": "Degraded", "restartRound": 3,
                    "participants": RUNNING["participants"][:1]},
                   annotations={crd.RESTART_ANNOTATION: "now"})
    text = screen.status_screen(run, None, NOW)
    assert "Round:      3 (being re-formed: members join the next round)" in text
    assert "Store:      10.0.0.1:29400 (rank 0 lost)" in text
    assert "Restart:    requested (elasticrun.dev/restart)" in text


def test_names_written_by_nodes_cannot_drive_the_terminal() -> None:
    hostile = "evil\x1b[2J\rnode" + "x" * 300
    run = make_run({**RUNNING, "participants": [
        {**RUNNING["participants"][1], "name": hostile, "rank": 0}], "lostMembers": [
        {"name": "n", "round": 1, "reason": "Left", "message": "\x1b]0;owned\x07" * 40}]})
    text = screen.status_screen(run, None, NOW)
    assert "\x1b" not in text and "\r" not in text and "\x07" not in text
    assert "evil\\x1b[2J\\rnode" in text
    assert all(len(line) < 400 for line in text.splitlines())


def test_printable_escapes_and_cuts() -> None:
    assert screen.printable("a\tb\x00") == "a\\tb\\x00"
    assert screen.printable("é") == "é"
    assert screen.printable("y" * 100, 10) == "yyyyyyy..."


@pytest.mark.parametrize(("seconds", "shown"), [(5, "5s"), (119, "119s"), (125, "2m5s"),
                                                (600, "10m"), (3 * 3600 + 60, "3h1m"),
                                                (10 * 3600, "10h"), (49 * 3600, "2d1h"),
                                                (30 * 86400, "30d")])
def test_ages_read_like_kubectls(seconds: int, shown: str) -> None:
    assert screen.age(NOW - dt.timedelta(seconds=seconds), NOW) == shown


def test_the_status_document_holds_what_the_screen_shows() -> None:
    doc = screen.status_document(make_run(RUNNING), NOW)
    assert doc["round"] == 3 and doc["phase"] == "Running" and doc["leader"] == "node-a"
    assert [(m["rank"], m["name"]) for m in doc["members"]] == [(0, "node-a"), (1, "node-b")]
    assert doc["lost"] == [{"name": "node-c", "round": 2, "reason": "PodDeleted",
                            "message": "pod train-c was deleted",
                            "time": "2026-12-01T16:59:00Z", "detectionSeconds": None}]
    assert doc["desired"] == {"size": 3, "source": "Job/train", "coming": 1}
    assert doc["waiting"] == [{"name": "node-d", "pod": "train-d",
                               "since": "2026-12-01T16:59:00Z"}]


def test_the_list_table_has_the_useful_columns_and_marks_unreadable_runs() -> None:
    items = [screen.Listed("ml", "r", NOW - dt.timedelta(seconds=30), make_run(RUNNING)),
             screen.Listed("ml", "bad", None, None, "status.round: expected an integer")]
    lines = screen.runs_table(items, NOW, all_namespaces=True).splitlines()
    assert lines[0].split() == ["NAMESPACE", "NAME", "PHASE", "ROUND", "MEMBERS", "WAITING",
                                "DESIRED", "MIN", "MAX", "LOST", "CLOSED", "AGE"]
    assert lines[1].split() == ["ml", "r", "Running", "3", "2", "1", "3", "2", "4", "1",
                                "false", "30s"]
    assert lines[2].split()[:3] == ["ml", "bad", "<invalid>"]
    assert lines[3] == "ml/bad: status.round: expected an integer"
    # The columns line up: every cell of a column starts where its header does.
    starts = [m.start() for m in re.finditer(r"\S+", lines[0])]
    assert [m.start() for m in re.finditer(r"\S+", lines[1])] == starts


# --------------------------------------------------------------------------- usage


@pytest.mark.parametrize("argv", [[], ["frobnicate", "r"], ["status"], ["drain", "r"],
                                  ["resize", "r", "2-4"], ["resize", "r", "5:2"],
                                  ["--request-timeout", "soon", "list"]])
def test_usage_errors_exit_2_before_any_request(argv: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # No kubeconfig exists at this path: a request would have been exit 1, not 2.
    assert main(["--kubeconfig", "/nonexistent/kubeconfig", *argv]) == 2
    assert capsys.readouterr().err


def test_no_credentials_is_an_error_that_names_the_file(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert main(["status", "r", "--kubeconfig", "/nonexistent/kubeconfig"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot load credentials from kubeconfig "
                          "/nonexistent/kubeconfig")
