"""The test control plane itself: nothing a test session starts outlives it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

from conftest import Cluster
from controlplane.localcluster import ClusterState, LocalControlPlane, pid_alive, reap_orphans


def test_a_control_plane_left_by_a_killed_session_is_stopped_by_the_next(
        cluster: Cluster, tmp_path: Path) -> None:
    bin_dir = cluster.require_local().bin_dir
    directory = tmp_path / "elasticrun-cp-orphan"
    local = LocalControlPlane(directory, bin_dir=bin_dir, owner_pid=0)
    state = local.start()
    client: subprocess.Popen[bytes] | None = None
    try:
        pids = (state.etcd_pid, state.apiserver_pid)
        # No owner (make cluster) and a live owner: both are left alone.
        assert reap_orphans(tmp_path) == []
        live = dataclasses.replace(state, owner_pid=os.getpid())
        live.save()
        assert reap_orphans(tmp_path) == []
        assert all(pid_alive(pid) for pid in pids)
        # The owner is gone (a pytest killed by SIGKILL): the servers and a client of
        # theirs (an operator or node agent would carry the kubeconfig path) are
        # stopped, the directory removed.
        client = subprocess.Popen(["sleep", "300"], start_new_session=True,
                                  env={"KUBECONFIG": str(state.kubeconfig)})
        dead = subprocess.Popen(["true"])
        dead.wait()
        dataclasses.replace(state, owner_pid=dead.pid).save()
        assert reap_orphans(tmp_path) == [directory]
        assert not any(pid_alive(pid) for pid in (*pids, client.pid))
        assert not directory.exists()
        assert ClusterState.load(directory) is None
    finally:
        local.stop()
        if client is not None and pid_alive(client.pid):
            client.kill()
