"""``kubectl elasticrun`` against the real API server, on runs made by real handlers.

The plugin runs as users run it: the console script ``kubectl-elasticrun`` as a
subprocess, found by the venv's ``kubectl`` on PATH in the first test (plugin
discovery), on its own elsewhere.  Verbs whose effect is the operator's run with
the real operator process; the read-only user is a real ServiceAccount token.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from elasticrun.api import crd
from elasticrun.api.kube import MERGE_PATCH, run_path, runs_path
from elasticrun.api.model import RunSpec, format_time, new_run_manifest, now

from chartkit import account_client
from conftest import KUBECTL, Cluster, OperatorProcess, wait_for
from rdzv import read_run, rendezvous_all

BIN = Path(sys.executable).parent
PLUGIN = BIN / "kubectl-elasticrun"


def plugin(kubeconfig: Path, *args: str, through_kubectl: bool = False,
           timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``kubectl-elasticrun ARGS`` (or ``kubectl elasticrun ARGS``) with ``KUBECONFIG`` set,
    as a user's shell would run it: the venv's bin first on PATH."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    argv = [KUBECTL, "elasticrun", *args] if through_kubectl else [str(PLUGIN), *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"exit {result.returncode}: {result.stdout}{result.stderr}"
    return result.stdout


def failed(result: subprocess.CompletedProcess[str], code: int = 1) -> str:
    assert result.returncode == code, (f"exit {result.returncode}, wanted {code}: "
                                       f"{result.stdout}{result.stderr}")
    assert result.stdout == ""
    return result.stderr


def create_run(cluster: Cluster, namespace: str, name: str, min_nodes: int = 2,
               max_nodes: int = 4) -> None:
    cluster.client.request("POST", runs_path(namespace), body=new_run_manifest(
        name, namespace, RunSpec(min_nodes=min_nodes, max_nodes=max_nodes)))


def write_status(cluster: Cluster, namespace: str, name: str, status: dict[str, Any]) -> None:
    """A status as a sealer or the operator writes it (merge patch of the subresource)."""
    cluster.client.request("PATCH", run_path(namespace, name, "status"),
                           body={"status": status}, content_type=MERGE_PATCH)


def rows(text: str, title: str) -> list[list[str]]:
    """The rows of one section of the status screen (``Ranks (2):`` ...), split in cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{title} ("))
    found = []
    for line in lines[start + 2:]:
        if not line.startswith("  "):
            break
        found.append(line.split())
    return found


# --------------------------------------------------------------------------- reading


def test_status_through_kubectl_shows_the_round_real_handlers_formed(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    nodes = [make_handler("screen", f"node-{i}", min_nodes=2, pod=f"train-{i}")
             for i in range(2)]
    outcomes = rendezvous_all(nodes)
    ranks = {o.rank: name for name, o in outcomes.items()}
    assert sorted(ranks) == [0, 1]

    text = ok(plugin(cluster.kubeconfig, "status", "screen", "-n", namespace,
                     through_kubectl=True))
    assert f"Run:        {namespace}/screen" in text
    assert "Phase:      Running" in text and "Round:      1" in text
    assert "Size:       2:2 (minNodes:maxNodes)" in text
    store = read_run(cluster.client, namespace, "screen").status.store
    assert store is not None
    assert f"Store:      {store.host}:{store.port} (rank 0: {ranks[0]})" in text
    assert [r[:4] for r in rows(text, "Ranks")] == [
        ["0", ranks[0], ranks[0].replace("node", "train"), "1"],
        ["1", ranks[1], ranks[1].replace("node", "train"), "1"]]
    assert "Lost: none" in text and "Waiting: none" in text

    as_json = json.loads(ok(plugin(cluster.kubeconfig, "status", "screen", "-n", namespace,
                                   "-o", "json")))
    assert [(m["rank"], m["name"]) for m in as_json["members"]] == sorted(ranks.items())
    assert as_json["round"] == 1 and as_json["leader"] == ranks[0]
    as_yaml = yaml.safe_load(ok(plugin(cluster.kubeconfig, "status", "screen", "-n",
                                       namespace, "-o", "yaml")))
    assert as_yaml == as_json

    listed = ok(plugin(cluster.kubeconfig, "list", "-n", namespace)).splitlines()
    assert listed[0].split()[:9] == ["NAME", "PHASE", "ROUND", "MEMBERS", "WAITING", "DESIRED",
                                     "MIN", "MAX", "LOST"]
    assert listed[1].split()[:10] == ["screen", "Running", "1", "2", "0", "<none>", "2", "2",
                                      "0", "false"]
    everywhere = ok(plugin(cluster.kubeconfig, "list", "-A")).splitlines()
    assert [namespace, "screen", "Running"] in [line.split()[:3] for line in everywhere]


def test_status_shows_lost_members_with_reasons_and_times_conditions_and_desired(
        cluster: Cluster, namespace: str) -> None:
    create_run(cluster, namespace, "hurt")
    lost_at = now()
    write_status(cluster, namespace, "hurt", {
        "phase": "Degraded", "round": 2, "signal": 4, "restartRound": 2,
        "store": {"host": "10.1.0.1", "port": 29400},
        "participants": [{"name": "a", "rank": 0, "joinedRound": 1, "pod": "pod-a"}],
        "waiting": [{"name": "d", "pod": "pod-d", "since": format_time(lost_at)}],
        "lostMembers": [
            {"name": "b", "round": 2, "reason": "PodDeleted", "time": format_time(lost_at),
             "message": "pod pod-b was deleted"},
            {"name": "c", "round": 1, "reason": "LeaseExpired", "time": format_time(lost_at)}],
        "conditions": [{"type": "Degraded", "status": "True", "reason": "MemberLost",
                        "message": "b left round 2 (PodDeleted)",
                        "lastTransitionTime": format_time(lost_at)}],
        "desired": 3, "desiredFrom": "Job/hurt", "coming": 2,
    })
    text = ok(plugin(cluster.kubeconfig, "status", "hurt", "-n", namespace))
    assert "Phase:      Degraded" in text
    assert "Round:      2 (being re-formed: members join the next round)" in text
    assert "Desired:    3 from Job/hurt (2 coming)" in text
    stamp = lost_at.strftime("%Y-%m-%dT%H:%M:%SZ")
    lost = rows(text, "Lost")
    assert [r[:4] for r in lost] == [["b", "2", "PodDeleted", stamp], ["c", "1", "LeaseExpired",
                                                                       stamp]]
    assert lost[0][-4:] == ["pod", "pod-b", "was", "deleted"]
    assert [r[:2] for r in rows(text, "Waiting")] == [["d", "pod-d"]]
    (condition,) = rows(text, "Conditions")
    assert condition[:3] == ["Degraded", "True", "MemberLost"]
    assert condition[4:] == ["b", "left", "round", "2", "(PodDeleted)"]

    # A drain of a node that is neither member nor waiting says who is.
    err = failed(plugin(cluster.kubeconfig, "drain", "hurt", "zed", "-n", namespace))
    assert err == ("error: 'zed' is neither a member nor waiting. Members of round 2: a; "
                   "waiting: d. To drain a node that has not joined yet, add --force\n")
    err = failed(plugin(cluster.kubeconfig, "undrain", "hurt", "a", "-n", namespace))
    assert err == "error: 'a' is not drained. Drained nodes: none\n"
    assert crd.DRAIN_ANNOTATION not in read_run(cluster.client, namespace, "hurt").annotations


# --------------------------------------------------------------------------- verbs


def test_restart_gives_a_new_round(operator: OperatorProcess, make_handler: Any,
                                   cluster: Cluster, namespace: str) -> None:
    nodes = [make_handler("again", f"n{i}", min_nodes=2) for i in range(2)]
    rendezvous_all(nodes)
    out = ok(plugin(cluster.kubeconfig, "restart", "again", "-n", namespace))
    assert out.splitlines() == [
        f"elasticrun {namespace}/again: restart",
        f"  annotation {crd.RESTART_ANNOTATION}: <none> -> now",
        "  the operator consumes the annotation and re-forms round 1: every member joins the "
        "next round"]
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in nodes), 15,
             "members to be asked for a new round")
    # The operator removes the annotation once the status that re-forms the round took.
    wait_for(lambda: crd.RESTART_ANNOTATION not in read_run(
        cluster.client, namespace, "again").annotations, 15, "the annotation to be consumed")
    run = read_run(cluster.client, namespace, "again")
    assert run.status.restart_round == 1
    # Asked again while the round re-forms: nothing to do, and it says so.
    assert ok(plugin(cluster.kubeconfig, "restart", "again", "-n", namespace)) == (
        f"elasticrun {namespace}/again: round 1 is already being re-formed (phase Degraded); "
        "nothing changed\n")
    second = rendezvous_all(nodes)
    assert {o.world_size for o in second.values()} == {2}
    text = ok(plugin(cluster.kubeconfig, "status", "again", "-n", namespace))
    assert "Round:      2" in text.splitlines()


def test_drain_removes_the_member_and_undrain_lets_it_back(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str) -> None:
    nodes = [make_handler("drained", f"n{i}", min_nodes=1, max_nodes=2) for i in range(2)]
    first = rendezvous_all(nodes)
    assert {o.world_size for o in first.values()} == {2}
    out = ok(plugin(cluster.kubeconfig, "drain", "drained", "n1", "-n", namespace))
    rank = first["n1"].rank
    assert out.splitlines()[:2] == [f"elasticrun {namespace}/drained: drain",
                                    f"  annotation {crd.DRAIN_ANNOTATION}: <none> -> n1"]
    assert f"n1 is rank {rank} of round 1: the operator removes it (reason Drained)" in out

    def removed() -> bool:
        return "n1" not in read_run(cluster.client, namespace, "drained").status.member_names

    wait_for(removed, 15, "the operator to remove the drained member")
    text = ok(plugin(cluster.kubeconfig, "status", "drained", "-n", namespace))
    assert "Drained:    n1" in text
    assert [r[:3] for r in rows(text, "Ranks")] == [[str(first["n0"].rank), "n0", "<none>"]]
    (lost,) = rows(text, "Lost")
    assert lost[:3] == ["n1", "1", "Drained"]
    assert lost[-4:] == ["drained", "by", "annotation", crd.DRAIN_ANNOTATION]
    assert ok(plugin(cluster.kubeconfig, "drain", "drained", "n1", "-n", namespace)) == (
        f"elasticrun {namespace}/drained: n1 is already drained; nothing changed\n")

    out = ok(plugin(cluster.kubeconfig, "undrain", "drained", "n1", "-n", namespace))
    assert out.splitlines()[:2] == [f"elasticrun {namespace}/drained: undrain",
                                    f"  annotation {crd.DRAIN_ANNOTATION}: n1 -> <none>"]
    assert crd.DRAIN_ANNOTATION not in read_run(cluster.client, namespace,
                                                "drained").annotations
    again = rendezvous_all(nodes)
    assert {o.world_size for o in again.values()} == {2}
    assert read_run(cluster.client, namespace, "drained").status.member_names == {"n0", "n1"}


def test_close_and_reopen(operator: OperatorProcess, make_handler: Any, cluster: Cluster,
                          namespace: str) -> None:
    rendezvous_all([make_handler("shut", "n0", min_nodes=1)])
    out = ok(plugin(cluster.kubeconfig, "close", "shut", "-n", namespace))
    assert out.splitlines()[:2] == [f"elasticrun {namespace}/shut: close",
                                    "  spec.closed: false -> true"]
    wait_for(lambda: read_run(cluster.client, namespace, "shut").status.phase == "Closed", 15,
             "the operator to close the run")
    text = ok(plugin(cluster.kubeconfig, "status", "shut", "-n", namespace))
    assert "Phase:      Closed" in text and "spec.closed: true" in text
    assert ["Closed", "True", "ClosedBySpec"] in [r[:3] for r in rows(text, "Conditions")]
    assert ok(plugin(cluster.kubeconfig, "close", "shut", "-n", namespace)).endswith(
        "spec.closed is already true; nothing changed\n")

    out = ok(plugin(cluster.kubeconfig, "reopen", "shut", "-n", namespace))
    assert "  spec.closed: true -> false" in out.splitlines()
    wait_for(lambda: read_run(cluster.client, namespace, "shut").status.phase != "Closed", 15,
             "the operator to reopen the run")
    condition = read_run(cluster.client, namespace, "shut").status.condition("Closed")
    assert condition is not None and (condition.status, condition.reason) == ("False",
                                                                              "Reopened")


def test_resize_writes_the_spec_and_refuses_what_the_crd_refuses(
        cluster: Cluster, namespace: str) -> None:
    create_run(cluster, namespace, "sized", 2, 4)
    out = ok(plugin(cluster.kubeconfig, "resize", "sized", "3:6", "-n", namespace))
    assert out.splitlines() == [
        f"elasticrun {namespace}/sized: resize", "  spec.minNodes: 2 -> 3",
        "  spec.maxNodes: 4 -> 6",
        "  takes effect in the next round (kubectl elasticrun restart RUN forms one now)"]
    spec = read_run(cluster.client, namespace, "sized").spec
    assert (spec.min_nodes, spec.max_nodes) == (3, 6)

    # The API server's own refusal of the same size, for comparison with the plugin's.
    refused = cluster.kubectl("patch", "er", "sized", "-n", namespace, "--type", "merge", "-p",
                              '{"spec":{"minNodes":5,"maxNodes":2}}', check=False)
    assert refused.returncode != 0
    crd_message = "maxNodes must be greater than or equal to minNodes (write e.g. minNodes: 2, " \
                  "maxNodes: 4)"
    assert crd_message in refused.stderr
    err = failed(plugin(cluster.kubeconfig, "resize", "sized", "5:2", "-n", namespace), 2)
    assert err.endswith(f"error: '5:2': {crd_message}\n")
    err = failed(plugin(cluster.kubeconfig, "resize", "sized", "2to4", "-n", namespace), 2)
    assert "'2to4' is not a size: write MIN:MAX (for example 2:4), or N for N:N" in err
    err = failed(plugin(cluster.kubeconfig, "resize", "sized", "1:4000", "-n", namespace), 2)
    assert "maxNodes must be 1 to 2048 (the CRD's bounds), found 4000" in err
    spec = read_run(cluster.client, namespace, "sized").spec
    assert (spec.min_nodes, spec.max_nodes) == (3, 6)


# --------------------------------------------------------------------------- errors


def test_a_missing_run_lists_the_runs_there(cluster: Cluster, namespace: str) -> None:
    for name in ("beta", "alpha"):
        create_run(cluster, namespace, name)
    for verb in (["status", "gamma"], ["close", "gamma"], ["drain", "gamma", "n0"]):
        err = failed(plugin(cluster.kubeconfig, *verb, "-n", namespace))
        assert err == (f"error: no ElasticRun 'gamma' in namespace {namespace!r}; runs there: "
                       "alpha, beta. Pick another with -n NAMESPACE or --context (kubectl "
                       "elasticrun list -A lists every namespace)\n")
    err = failed(plugin(cluster.kubeconfig, "status", "gamma", "-n", f"{namespace}-empty"))
    assert f"in namespace '{namespace}-empty'; there are no runs there." in err
    # Through kubectl, the plugin's exit codes and messages reach the user unchanged.
    err = failed(plugin(cluster.kubeconfig, "close", "gamma", "-n", namespace,
                        through_kubectl=True))
    assert err.startswith("error: no ElasticRun 'gamma'")
    err = failed(plugin(cluster.kubeconfig, "resize", "alpha", "4:2", "-n", namespace,
                        through_kubectl=True), 2)
    assert "maxNodes must be greater than or equal to minNodes" in err


def test_a_read_only_user_is_told_which_right_it_lacks(cluster: Cluster, namespace: str,
                                                      tmp_path: Path) -> None:
    """A real ServiceAccount token with get/list/watch on runs: it reads, it cannot close."""
    create_run(cluster, namespace, "guarded")
    account_client(cluster, namespace, "reader", [
        {"apiGroups": [crd.GROUP], "resources": [crd.PLURAL],
         "verbs": ["get", "list", "watch"]}], tmp_path)
    reader = tmp_path / "reader.kubeconfig"
    # No -n: the namespace comes from the kubeconfig's context, as kubectl's does.
    assert "Run:        " + f"{namespace}/guarded" in ok(plugin(reader, "status", "guarded"))
    err = failed(plugin(reader, "close", "guarded"))
    assert err.startswith(
        f"error: forbidden: close needs get, patch on elasticruns.elasticrun.dev in namespace "
        f"'{namespace}', and you may not patch them (the API server said: ")
    assert f'User "system:serviceaccount:{namespace}:reader" cannot patch resource ' \
           '"elasticruns"' in err
    assert err.endswith(f"kubectl auth can-i patch elasticruns.elasticrun.dev -n {namespace}\n")
    assert read_run(cluster.client, namespace, "guarded").spec.closed is False

    account_client(cluster, namespace, "nobody", [], tmp_path)
    err = failed(plugin(tmp_path / "nobody.kubeconfig", "status", "guarded"))
    assert err.startswith(f"error: forbidden: status needs get on elasticruns.elasticrun.dev "
                          f"in namespace '{namespace}', and you may not get them")


def test_node_written_strings_cannot_drive_the_terminal(cluster: Cluster,
                                                        namespace: str) -> None:
    """The schema lets a node write any characters into names and messages; none reach the
    terminal as control sequences (clear screen, carriage return, a window title)."""
    create_run(cluster, namespace, "noisy")
    hostile = "n\x1b[2J\rx"
    write_status(cluster, namespace, "noisy", {
        "phase": "Running", "round": 1, "signal": 1, "store": {"host": "10.1.0.1", "port": 1},
        "participants": [{"name": hostile, "rank": 0, "joinedRound": 1, "pod": "p\x07"}],
        "lostMembers": [{"name": "gone", "round": 1, "reason": "Left",
                         "message": "\x1b]0;owned\x07" + "m" * 1000}]})
    for args in (["status", "noisy"], ["list"]):
        out = ok(plugin(cluster.kubeconfig, *args, "-n", namespace))
        assert not any(ch in out for ch in "\x1b\r\x07"), repr(out)
    text = ok(plugin(cluster.kubeconfig, "status", "noisy", "-n", namespace))
    assert [r[:3] for r in rows(text, "Ranks")] == [["0", "n\\x1b[2J\\rx", "p\\x07"]]
    assert max(len(line) for line in text.splitlines()) < 300


def _closed_port() -> int:
    """A port of this machine nobody listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_context_picks_the_server_and_the_namespace(cluster: Cluster, namespace: str,
                                                       tmp_path: Path) -> None:
    """``--context`` as kubectl's: its cluster, its user, its namespace (no ``-n``)."""
    create_run(cluster, namespace, "ctx")
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    base = config["contexts"][0]["context"]
    config["clusters"].append({"name": "dead", "cluster": {
        "server": f"https://127.0.0.1:{_closed_port()}", "insecure-skip-tls-verify": True}})
    config["contexts"] = [{"name": "team", "context": {**base, "namespace": namespace}},
                          {"name": "dead", "context": {**base, "cluster": "dead"}}]
    config["current-context"] = "dead"
    two = tmp_path / "two-contexts"
    two.write_text(yaml.safe_dump(config))
    err = failed(plugin(two, "status", "ctx"))
    assert err.startswith("error: cannot reach the API server https://127.0.0.1:")
    # KUBECONFIG points elsewhere: --kubeconfig wins, as in kubectl.
    text = ok(plugin(tmp_path / "absent", "status", "ctx", "--kubeconfig", str(two),
                     "--context", "team"))
    assert text.startswith(f"Run:        {namespace}/ctx")
    err = failed(plugin(two, "--context", "nope", "list"))
    assert err.startswith(f"error: cannot load credentials from kubeconfig {two} (context "
                          "nope): ")


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections and never says a word (a hung API server)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server,
                                               "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    return path


def test_an_unreachable_api_server_is_named_within_the_timeout(silent_server: int,
                                                               tmp_path: Path) -> None:
    hung = _kubeconfig(tmp_path / "hung", f"https://127.0.0.1:{silent_server}")
    started = time.monotonic()
    err = failed(plugin(hung, "status", "r", "--request-timeout", "2"))
    assert time.monotonic() - started < 15
    assert err.startswith(f"error: cannot reach the API server https://127.0.0.1:{silent_server}"
                          f" (kubeconfig {hung}): no answer within 2s (--request-timeout). ")
    closed = _closed_port()
    refused = _kubeconfig(tmp_path / "refused", f"https://127.0.0.1:{closed}")
    err = failed(plugin(refused, "close", "r"))
    assert f"cannot reach the API server https://127.0.0.1:{closed}" in err
    assert "connection refused or no route" in err
