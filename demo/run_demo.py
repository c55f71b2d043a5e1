#!/usr/bin/env python3
"""elasticrun on a laptop: an elastic training run that loses a node and gains one.

What runs, all on 127.0.0.1:

* a real kube-apiserver + etcd (built once from Go modules, cached);
* the elasticrun operator (``python -m elasticrun.operator``);
* three "pods": a Pod object each, plus a real ``torchrun --rdzv-backend=k8s``
  agent with that pod's name, training a small DDP model over gloo on the CPU,
  checkpointing every epoch.  This script plays kubelet: it marks the Pods
  Running, and deletes a Pod when it kills that pod's agent.

Midway one node is killed (SIGKILL, Pod deleted): the operator removes it, the
survivors restart at once and continue from the checkpoint.  Later a fresh node
starts, waits, and is admitted in the next round.  Training then finishes.

    make demo                       # or: python demo/run_demo.py --help
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from elasticrun.api import crd, rounds
from elasticrun.api.kube import (
    ApiConnectionError,
    ApiError,
    KubeClient,
    load_credentials,
    runs_path,
)
from elasticrun.api.model import ElasticRun, RunSpec, new_run_manifest, parse_run

from controlplane.crds import install_crds
from controlplane.kubelet import Kubelet
from controlplane.localcluster import (
    LocalControlPlane,
    clean_env,
    kill_tree,
    stop_pid,
)
from controlplane.operatorproc import OperatorProcess

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "demo"
RUN = "demo"
TRAIN = ROOT / "deploy" / "examples" / "train.py"
EPOCH_LINE = re.compile(r"rank (\d+)/(\d+) epoch (\d+) done, loss ([0-9.eE+-]+)")
#: A worker's first training step since it started (``train.py``): rank 0's says when
#: training moved again after a round changed.
FIRST_STEP_LINE = re.compile(r"rank 0/\d+ first step done")


# --------------------------------------------------------------------------- output


class Console:
    """Timestamped timeline lines, plus a progress bar redrawn in place on a terminal."""

    def __init__(self, stream: TextIO, color: bool) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.color = color and self.tty
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._bar = ""

    def _paint(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def line(self, kind: str, message: str) -> None:
        codes = {"round": "1;32", "lost": "1;31", "wait": "1;33", "step": "1;36", "train": "1;34",
                 "info": "0"}
        stamp = f"{time.monotonic() - self.started:6.1f}s"
        text = f"{stamp}  {self._paint(f'{kind:<6}', codes.get(kind, '0'))} {message}"
        with self._lock:
            if self.tty and self._bar:
                self.stream.write("\r\033[K")
            self.stream.write(text + "\n")
            if self.tty and self._bar:
                self.stream.write(self._bar)
            self.stream.flush()

    def step(self, message: str) -> None:
        self.line("step", message)

    def progress(self, epoch: int, epochs: int, loss: float, world: int) -> None:
        width = 30
        done = int(width * epoch / max(1, epochs))
        bar = f"[{'#' * done}{'.' * (width - done)}] epoch {epoch}/{epochs} " \
              f"loss {loss:.5f} world size {world}"
        with self._lock:
            if self.tty:
                self._bar = bar
                self.stream.write("\r\033[K" + bar)
                self.stream.flush()
        if not self.tty:
            self.line("train", bar)

    def end_progress(self) -> None:
        with self._lock:
            if self.tty and self._bar:
                self.stream.write("\n")
                self._bar = ""


# --------------------------------------------------------------------------- state


@dataclass
class Node:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    started: float
    killed_at: float | None = None


@dataclass
class Story:
    """What happened, for the summary and for the demo's test."""

    rounds: list[dict[str, Any]] = field(default_factory=list)
    lost: list[dict[str, Any]] = field(default_factory=list)
    #: Members that left on their own (finished or shut down), in order.
    left: list[str] = field(default_factory=list)
    epochs_done: int = 0
    final_loss: float | None = None
    world_sizes: list[int] = field(default_factory=list)
    killed: str | None = None
    killed_at: float | None = None
    joined: str | None = None
    joined_at: float | None = None
    recovery_seconds: float | None = None
    admission_seconds: float | None = None
    #: When the members were told of the newcomer (``status.joinNotice`` reached their
    #: round): their agents stop the workers then.
    told_at: float | None = None
    #: From the kill until rank 0's first training step in the survivors' round: how long
    #: training stood still for the loss (the round, then the workers' restart).
    training_back_after_loss: float | None = None
    #: From the members being told of the newcomer until rank 0's first step in its round.
    training_back_after_admission: float | None = None
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    wall_seconds: float = 0.0
    success: bool = False


class Demo:
    def __init__(self, args: argparse.Namespace, console: Console) -> None:
        self.args = args
        self.console = console
        self.workdir: Path = args.workdir.resolve()
        self.cp = LocalControlPlane(self.workdir / "cluster")
        self.client: KubeClient | None = None
        self.operator: OperatorProcess | None = None
        self.kubelet: Kubelet | None = None
        self.nodes: dict[str, Node] = {}
        self.story = Story()
        self.current: ElasticRun | None = None
        self._stop = threading.Event()
        self._epoch_cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._watch: Any = None

    # ------------------------------------------------------------------ set-up

    def setup(self) -> None:
        c = self.console
        if self.workdir.exists():
            LocalControlPlane(self.workdir / "cluster").stop()
            shutil.rmtree(self.workdir)
        (self.workdir / "logs").mkdir(parents=True)
        c.line("info", "starting a local kube-apiserver + etcd (first run builds them: minutes)")
        state = self.cp.start()
        self.client = KubeClient(load_credentials(str(state.kubeconfig)), timeout=15)
        install_crds(self.client, crd.crd_manifests(), manager="elasticrun-demo", timeout=30)
        self.client.request("POST", "/api/v1/namespaces", body={
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        spec = RunSpec(min_nodes=2, max_nodes=3, join_timeout=300, last_call_timeout=5,
                       heartbeat_timeout=5, lease_renew_interval=1)
        self.client.request("POST", runs_path(NAMESPACE), body=new_run_manifest(RUN, NAMESPACE,
                                                                                spec))
        c.line("info", f"kube-apiserver {state.url} is up; ElasticRun {NAMESPACE}/{RUN} "
                       f"created (min 2, max 3 nodes)")
        self.operator = OperatorProcess(state.kubeconfig, [NAMESPACE], self.workdir / "logs")
        self.operator.start()
        c.line("info", f"operator running (metrics http://127.0.0.1:{self.operator.metrics_port}"
                       "/metrics)")
        self.kubelet = Kubelet(self.client, NAMESPACE)
        c.line("info", "watch it yourself in another terminal:")
        c.line("info", f"  export KUBECONFIG={state.kubeconfig}")
        c.line("info", f"  kubectl get er -n {NAMESPACE} -w      "
                       f"kubectl describe er {RUN} -n {NAMESPACE}")

    # ------------------------------------------------------------------ nodes

    def start_node(self, name: str) -> Node:
        assert self.kubelet is not None
        self.kubelet.create(name, RUN)
        log = self.workdir / "logs" / f"{name}.log"
        env = {**clean_env(), "POD_NAME": name, "POD_NAMESPACE": NAMESPACE, "POD_IP": "127.0.0.1",
               "KUBECONFIG": str(self.cp.state.kubeconfig),  # type: ignore[union-attr]
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        argv = [str(Path(sys.executable).parent / "torchrun"), "--nnodes=2:3",
                "--nproc-per-node=1", "--rdzv-backend=k8s", f"--rdzv-id={RUN}",
                "--max-restarts=10", "--monitor-interval=0.1", "--local-addr=127.0.0.1",
                str(TRAIN), "--epochs", str(self.args.epochs),
                "--steps-per-epoch", str(self.args.steps_per_epoch),
                "--checkpoint", str(self.workdir / "checkpoint.pt")]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=self.workdir)
        node = Node(name, proc, log, time.monotonic())
        self.nodes[name] = node
        thread = threading.Thread(target=self._read_output, args=(node,), daemon=True)
        thread.start()
        self._threads.append(thread)
        return node

    def _read_output(self, node: Node) -> None:
        assert node.proc.stdout is not None
        with open(node.log, "w") as log:
            for raw in node.proc.stdout:
                line = raw.decode(errors="replace")
                log.write(line)
                m = EPOCH_LINE.search(line)
                if m and m.group(1) == "0":
                    self._epoch(int(m.group(3)), float(m.group(4)), int(m.group(2)))
                elif FIRST_STEP_LINE.search(line):
                    self._training_back(time.monotonic())

    def _epoch(self, epoch: int, loss: float, world: int) -> None:
        with self._epoch_cond:
            self.story.epochs_done = max(self.story.epochs_done, epoch)
            self.story.final_loss = loss
            self._epoch_cond.notify_all()
        self.console.progress(epoch, self.args.epochs, loss, world)

    def _training_back(self, at: float) -> None:
        """Rank 0's workers took their first step at ``at``: training moves again.

        The first such step after the kill ends the stand-still of the loss, the
        first after the members were told of the newcomer ends the admission's.
        """
        with self._epoch_cond:  # one node's output thread at a time
            self._back_at(at)

    def _back_at(self, at: float) -> None:
        s, c = self.story, self.console
        if s.killed_at is not None and s.training_back_after_loss is None and at > s.killed_at:
            s.training_back_after_loss = at - s.killed_at
            c.line("train", f"  -> training back {s.training_back_after_loss:.2f}s after the "
                            "kill: the survivors' workers restarted and loaded the checkpoint")
        elif s.told_at is not None and s.training_back_after_admission is None \
                and at > s.told_at:
            s.training_back_after_admission = at - s.told_at
            c.line("train", f"  -> training back {s.training_back_after_admission:.2f}s after "
                            f"the members were told of {s.joined}")

    def wait_for_epoch(self, epoch: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._epoch_cond:
            while self.story.epochs_done < epoch:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"training did not reach epoch {epoch}")
                if self._stop.is_set():
                    raise KeyboardInterrupt
                self._epoch_cond.wait(min(remaining, 0.5))

    def kill_node(self) -> None:
        """SIGKILL the highest-ranked node's agent and workers, then delete its Pod."""
        run = self.current
        assert run is not None and self.kubelet is not None
        victim = max(run.status.participants, key=lambda p: p.rank).name
        node = self.nodes[victim]
        self.console.step(f"killing {victim}: SIGKILL to its agent and workers, Pod deleted")
        kill_tree(node.proc.pid)
        node.killed_at = time.monotonic()
        self.kubelet.delete(victim)
        self.story.killed, self.story.killed_at = victim, node.killed_at

    # ------------------------------------------------------------------ timeline

    def watch_run(self) -> None:
        """Print what changed in the ElasticRun, as the API server reports it."""
        assert self.client is not None
        previous: ElasticRun | None = None
        rv = ""
        while not self._stop.is_set():
            try:
                watch = self.client.watch(runs_path(NAMESPACE),
                                          {"fieldSelector": f"metadata.name={RUN}",
                                           "resourceVersion": rv}, 30)
                self._watch = watch
                for event in watch:
                    if self._stop.is_set():
                        break
                    if event.get("type") not in ("ADDED", "MODIFIED"):
                        continue
                    run = parse_run(event["object"])
                    rv = run.resource_version
                    self._report(previous, run)
                    previous = self.current = run
            except (ApiError, ApiConnectionError) as exc:
                if isinstance(exc, ApiError) and exc.gone:
                    rv = ""
                self._stop.wait(0.5)

    def _report(self, old: ElasticRun | None, new: ElasticRun) -> None:
        c, s, o = self.console, new.status, old.status if old else None
        if (o is None or s.round > o.round) and s.round and s.participants:
            ranks = ", ".join(f"rank {p.rank} {p.name}" for p in s.participants)
            store = f"{s.store.host}:{s.store.port}" if s.store else "?"
            c.line("round", f"round {s.round} sealed: {len(s.participants)} members "
                            f"({ranks}); store on {store}")
            self.story.rounds.append({"round": s.round, "members": sorted(s.member_names),
                                      "ranks": {p.name: p.rank for p in s.participants}})
            self.story.world_sizes.append(len(s.participants))
            self._timings(set(s.member_names))
        if o is not None and s.phase != o.phase and s.phase == "Succeeded":
            c.line("round", f"run Succeeded: round {s.round} finished training (its members "
                            "passed torch's exit barrier, or all left after finishing)")
        elif o is not None and s.phase != o.phase and s.phase == "Closed":
            c.line("round", "run Closed: waiting and late nodes are refused")
        self._report_waiting(new, old)
        seen = {(m.name, m.round, m.reason) for m in (o.lost_members if o else ())}
        for m in s.lost_members:
            if (m.name, m.round, m.reason) in seen:
                continue
            if m.reason in rounds.DEPARTURES:  # shut down on its own: not a loss
                c.line("round", f"{m.name} left round {m.round} ({m.message or 'shut down'})")
                self.story.left.append(m.name)
                continue
            detection = ""
            if m.name == self.story.killed and self.story.killed_at is not None:
                detection = f", {time.monotonic() - self.story.killed_at:.2f}s after the kill"
            c.line("lost", f"{m.name} removed from round {m.round}: {m.reason} "
                           f"({m.message or ''}){detection}")
            self.story.lost.append({"name": m.name, "round": m.round, "reason": m.reason,
                                    "detection_seconds": m.detection_seconds})

    def _report_waiting(self, new: ElasticRun, old: ElasticRun | None) -> None:
        """Nodes that asked to join, and the members' notice of them."""
        c, s, o = self.console, new.status, old.status if old else None
        known = o.waiting_names if o else frozenset()
        for w in s.waiting:
            if w.name in known or (o is not None and w.name in o.member_names):
                continue
            if s.round == 0:
                c.line("wait", f"{w.name} joined; the first round is sealed when "
                               f"{new.spec.max_nodes} nodes are in, or {new.spec.min_nodes} "
                               f"and {new.spec.last_call_timeout}s have passed")
            else:
                c.line("wait", f"{w.name} is waiting: the members see num_nodes_waiting() > 0 "
                               "and restart their workers for a new round")
        if o is not None and s.round and s.join_notice >= s.round > o.join_notice:
            if self.story.joined_at is not None and self.story.told_at is None:
                self.story.told_at = time.monotonic()
            c.line("wait", f"round {s.round}'s members are told a node waits (joinNotice): "
                           "their num_nodes_waiting() > 0, they restart their workers")

    def _timings(self, members: set[str]) -> None:
        now = time.monotonic()
        if self.story.killed_at and self.story.recovery_seconds is None \
                and self.story.killed not in members:
            self.story.recovery_seconds = now - self.story.killed_at
            self.console.line("round", f"  -> recovered {self.story.recovery_seconds:.2f}s "
                                       f"after {self.story.killed} was killed")
        if self.story.joined_at and self.story.admission_seconds is None \
                and self.story.joined in members:
            self.story.admission_seconds = now - self.story.joined_at
            self.console.line("round", f"  -> {self.story.joined} admitted "
                                       f"{self.story.admission_seconds:.2f}s after it started")

    # ------------------------------------------------------------------ the story

    def run(self) -> Story:
        started = time.monotonic()
        self.setup()
        watcher = threading.Thread(target=self.watch_run, daemon=True)
        watcher.start()
        self._threads.append(watcher)
        for i in range(3):
            self.start_node(f"node-{i}")
        self.console.step("started node-0, node-1, node-2 (torchrun --rdzv-backend=k8s)")
        self.wait_for_epoch(self.args.kill_at, self.args.timeout)
        self.kill_node()
        self.wait_for_epoch(self.args.join_at, self.args.timeout)
        self.story.joined, self.story.joined_at = "node-3", time.monotonic()
        self.start_node("node-3")
        self.console.step("started node-3, a fresh node")
        deadline = time.monotonic() + self.args.timeout
        for node in self.nodes.values():
            if node.killed_at is not None:
                continue
            remaining = max(1.0, deadline - time.monotonic())
            try:
                self.story.exit_codes[node.name] = node.proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                self.story.exit_codes[node.name] = None
        self.console.end_progress()
        time.sleep(0.5)  # let the last status changes reach the timeline
        self.story.wall_seconds = time.monotonic() - started
        self.story.success = (self.story.epochs_done >= self.args.epochs and
                              all(code == 0 for code in self.story.exit_codes.values()))
        return self.story

    def cleanup(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.close()
        for node in self.nodes.values():
            if node.proc.poll() is None:
                kill_tree(node.proc.pid, signal.SIGTERM)
                try:
                    node.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    kill_tree(node.proc.pid)
                    stop_pid(node.proc.pid, timeout=5)
        if self.operator is not None:
            self.operator.stop()
        if not self.args.keep:
            self.cp.stop()
        if self.client is not None:
            self.client.close()


def summary(story: Story, console: Console, args: argparse.Namespace) -> None:
    c = console
    c.line("info", "-" * 60)
    c.line("info", f"training {'finished' if story.success else 'did NOT finish'}: "
                   f"{story.epochs_done}/{args.epochs} epochs, final loss "
                   f"{story.final_loss if story.final_loss is not None else '-'}")
    c.line("info", f"rounds: {len(story.rounds)} (world sizes {story.world_sizes})")
    if story.recovery_seconds is not None:
        back = story.training_back_after_loss
        c.line("info", f"lost {story.killed}: new round {story.recovery_seconds:.2f}s after the "
                       "kill, training back "
                       + (f"{back:.2f}s after it" if back is not None else "not seen")
                       + " (the workers restarted from the last checkpoint)")
    if story.admission_seconds is not None:
        back = story.training_back_after_admission
        c.line("info", f"{story.joined} admitted {story.admission_seconds:.2f}s after it "
                       "started; training stood still "
                       + (f"{back:.2f}s" if back is not None else "(end not seen)")
                       + " from the members' notice (their workers restarted for it)")
    c.line("info", f"agents' exit codes: {story.exit_codes}; wall time "
                   f"{story.wall_seconds:.0f}s")
    if args.keep:
        c.line("info", "the control plane is still running (--keep); stop it with "
                       f"python -m controlplane.localcluster down --dir "
                       f"{args.workdir / 'cluster'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--steps-per-epoch", type=int, default=150)
    parser.add_argument("--kill-at", type=int, default=8, help="epoch at which a node is killed")
    parser.add_argument("--join-at", type=int, default=16, help="epoch at which node-3 starts")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="bound on each phase, in seconds")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".demo")
    parser.add_argument("--keep", action="store_true",
                        help="leave the control plane running at the end")
    parser.add_argument("--summary-json", type=Path, default=None,
                        help="also write what happened as JSON (used by the demo's test)")
    parser.add_argument("--no-color", action="store_true")
    return parser.parse_args(argv)


@contextlib.contextmanager
def interrupts_as_keyboard() -> Iterator[None]:
    """SIGTERM cleans up like Ctrl-C does."""
    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(sys.stdout, color=not args.no_color)
    demo = Demo(args, console)
    story = demo.story
    try:
        with interrupts_as_keyboard():
            story = demo.run()
    except KeyboardInterrupt:
        console.end_progress()
        console.line("info", "interrupted: cleaning up")
    except (TimeoutError, RuntimeError, ApiError, ApiConnectionError) as exc:
        console.end_progress()
        console.line("lost", f"demo failed: {exc}")
    finally:
        demo.cleanup()
    summary(story, console, args)
    if args.summary_json:
        args.summary_json.write_text(json.dumps(story.__dict__, indent=2, default=str))
    return 0 if story.success else 1


if __name__ == "__main__":
    sys.exit(main())
