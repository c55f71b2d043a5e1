"""The objects the operator keeps beside a run, and the problems it reports once: pure.

Beside the run's status the operator applies the run's own Role and
RoleBinding (:mod:`.runrbac`, ``--per-run-rbac``) and NetworkPolicy
(:mod:`.netpol`, ``--store-policy-port``), deletes them with the run, and
posts one Warning Event per problem something a pod wrote (an unreadable join
request, a bad ServiceAccount name, a Node signal).  What to apply, delete and
report is decided here from the run, its Leases and what the operator already
did for it (:class:`Done`, kept in its :class:`~.runstate.RunState`), so
:func:`~.reconcile.reconcile` puts it in the plan and the executor only
carries it out.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elasticrun.api import rounds, slices
from elasticrun.api.leases import LeaseState
from elasticrun.api.model import ElasticRun
from elasticrun.api.slices import Slice
from elasticrun.operator import netpol, nodesignals, runrbac

#: At most this many problems of one kind are reported one by one per run; past
#: it, one summary Event says the rest are only logged.  Anyone who may write a
#: Lease can make thousands of unreadable ones.
PROBLEM_EVENTS_PER_RUN = 20

#: The problem reasons, each with its own memory of subjects.
UNREADABLE_JOIN = "UnreadableJoin"
INVALID_SERVICE_ACCOUNT = "InvalidServiceAccount"
NODE_SIGNAL = "NodeSignal"


@dataclass(frozen=True)
class Settings:
    """The operator's flags that add objects beside each run."""

    #: Give runs naming a ServiceAccount a Role of their own (``--per-run-rbac``).
    per_run_rbac: bool = False
    #: A NetworkPolicy of the run's own for this store port (0: any port; None: none).
    store_policy_port: int | None = None


@dataclass(frozen=True)
class Problems:
    """The problems reported for one run: by (reason, subject), the problem's text; and
    the reasons past :data:`PROBLEM_EVENTS_PER_RUN` (summarised once)."""

    reported: Mapping[tuple[str, str], str] = field(default_factory=dict)
    summarised: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Done:
    """What the operator already did for the run: fingerprints of the objects it last
    applied (an unchanged object is not applied again), the problems reported, and
    the slices written of its last round told in slices (:mod:`elasticrun.api.slices`)."""

    rbac: str | None = None
    policy: str | None = None
    problems: Problems = field(default_factory=Problems)
    told: tuple[int, frozenset[int]] = (0, frozenset())

    def applied(self, item: Apply) -> Done:
        """What was done once ``item`` took."""
        if item.slot == "rbac":
            return dataclasses.replace(self, rbac=item.fingerprint)
        return dataclasses.replace(self, policy=item.fingerprint)

    def slices_told(self, round_number: int) -> frozenset[int]:
        """The slices of round ``round_number`` written already."""
        told_round, told = self.told
        return told if told_round == round_number else frozenset()

    def wrote(self, written: Slice) -> Done:
        """What was done once ``written`` took."""
        return dataclasses.replace(
            self, told=(written.round, self.slices_told(written.round) | {written.index}))


#: No object beside the run, nothing done for it yet.
NO_SETTINGS = Settings()
NOTHING_DONE = Done()


@dataclass(frozen=True)
class Apply:
    """Server-side apply of ``manifests`` (path, manifest) as field manager ``manager``,
    kept as ``slot``'s ``fingerprint`` once they all took; ``note`` is the log line."""

    slot: str  # "rbac" or "policy": the field of Done it updates (Done.applied)
    fingerprint: str
    manager: str
    manifests: tuple[tuple[str, dict[str, Any]], ...]
    note: str


@dataclass
class Report:
    """Problem Events to post, and the run's problem memory after them."""

    events: list[tuple[str, str, str]] = field(default_factory=list)
    problems: Problems = field(default_factory=Problems)
    #: Problems only logged (past the cap), and problems reported now.
    logged: list[str] = field(default_factory=list)


def fingerprint(manifests: Iterable[dict[str, Any]]) -> str:
    return json.dumps(list(manifests), sort_keys=True)


def applies(run: ElasticRun, leases: Mapping[str, LeaseState], settings: Settings,
            done: Done) -> list[Apply]:
    """The run's objects that differ from what was last applied: its NetworkPolicy, then
    its Role and RoleBinding (with its Leases, :func:`runrbac.lease_names`, so a node's
    Lease is in the Role before its first renewal)."""
    due: list[Apply] = []
    if settings.store_policy_port is not None:
        manifest = netpol.policy(run.name, run.namespace, run.uid, settings.store_policy_port)
        print_ = fingerprint([manifest])
        if print_ != done.policy:
            port = settings.store_policy_port
            due.append(Apply("policy", print_, netpol.MANAGER,
                             ((netpol.path(run.namespace, run.name), manifest),),
                             f"NetworkPolicy {netpol.object_name(run.name)} admits only the "
                             f"run's pods to {f'port {port}' if port else 'its pods'}"))
    account = service_account(run, settings)
    if account is not None and runrbac.service_account_problem(account) is None:
        names = runrbac.lease_names(run, leases)
        told_in = slices.slice_names(run.uid) \
            if run.uid and rounds.members_told_in_slices(run.spec) else []
        role = runrbac.role(run.name, run.namespace, run.uid, names, told_in)
        binding = runrbac.role_binding(run.name, run.namespace, run.uid, account)
        print_ = fingerprint([role, binding])
        if print_ != done.rbac:
            due.append(Apply("rbac", print_, runrbac.MANAGER, tuple(
                (runrbac.path(m["kind"], run.namespace, run.name), m) for m in (role, binding)),
                f"Role {runrbac.object_name(run.name)} allows ServiceAccount {account} this "
                f"run and {len(names)} Lease(s)"))
    return due


def service_account(run: ElasticRun, settings: Settings) -> str | None:
    """The ServiceAccount the run names for a Role of its own, if per-run RBAC is on."""
    account = run.annotations.get(runrbac.SERVICE_ACCOUNT_ANNOTATION)
    return account if settings.per_run_rbac and account else None


def owned_paths(run: ElasticRun, settings: Settings) -> list[str]:
    """The objects to delete with the run (owned by it, but a cluster may run no garbage
    collector): its slices where rounds are told in slices, its RoleBinding and Role,
    its NetworkPolicy."""
    paths: list[str] = []
    if rounds.members_told_in_slices(run.spec) and run.uid:
        paths += [slices.slice_path(run.namespace, name) for name in slices.slice_names(run.uid)]
    if settings.per_run_rbac:
        paths += [runrbac.path(kind, run.namespace, run.name) for kind in ("RoleBinding", "Role")]
    if settings.store_policy_port is not None:
        paths.append(netpol.path(run.namespace, run.name))
    return paths


def report(problems: Problems, reason: str, found: Mapping[str, str | None],
           present: Iterable[str] | None = None) -> Report:
    """One Warning Event per subject with a problem (something a pod wrote), once.

    ``found`` maps each subject looked at to its problem (None: none now, so a later
    one is reported anew); ``present`` (when given) is every subject that still exists:
    the problems of the others are forgotten.  A subject is reported again only after
    its problem went away, whatever it is changed to meanwhile; past
    :data:`PROBLEM_EVENTS_PER_RUN` subjects of one reason the run gets one summary
    Event, and the rest are only logged.
    """
    reported = dict(problems.reported)
    summarised = set(problems.summarised)
    out = Report()
    for subject, problem in found.items():
        if problem is None:
            reported.pop((reason, subject), None)
            continue
        if (reason, subject) in reported:
            continue
        if sum(1 for r, _ in reported if r == reason) >= PROBLEM_EVENTS_PER_RUN:
            out.logged.append(problem)
            if reason not in summarised:
                summarised.add(reason)
                out.events.append(("Warning", reason, (
                    f"more than {PROBLEM_EVENTS_PER_RUN} objects of this run have {reason} "
                    "problems; further ones are only logged by the operator")))
            continue
        reported[(reason, subject)] = problem
        out.events.append(("Warning", reason, problem))
    if present is not None:
        keep = set(present)
        for gone in [k for k in reported if k[0] == reason and k[1] not in keep]:
            del reported[gone]
        if sum(1 for r, _ in reported if r == reason) < PROBLEM_EVENTS_PER_RUN:
            summarised.discard(reason)
    out.problems = Problems(reported, frozenset(summarised))
    return out


def node_signal_problems(run: ElasticRun, found: Mapping[str, nodesignals.Shown],
                         leases: Mapping[str, LeaseState]) -> dict[str, str | None]:
    """Per (pod, signal) shown by the Node of one of the run's pods, the Event's text,
    naming the member or waiting node on that pod."""
    entries = {p.pod: f"member {p.name}" for p in run.status.participants if p.pod}
    for joining in [w for w in run.status.waiting] + [
            s.join for s in leases.values() if s.join is not None]:
        if joining.pod:
            entries.setdefault(joining.pod, f"waiting node {joining.name}")
    problems: dict[str, str | None] = {}
    for pod, entry in sorted(found.items()):
        who = entries.get(pod, "no node yet")
        for signal in entry.signals:
            problems[f"{pod} {signal.name}"] = (
                f"pod {pod} ({who}) on Node {entry.node} shows {signal.name} "
                f"({signal.policy})")
    return problems


def problem_reports(run: ElasticRun, leases: Mapping[str, LeaseState],
                    node_signals: Mapping[str, nodesignals.Shown] | None, settings: Settings,
                    problems: Problems) -> Report:
    """Every problem report of one reconcile, in order: the ServiceAccount name,
    unreadable join requests on the run's Leases, what the run's Nodes show."""
    steps: list[tuple[str, Mapping[str, str | None], Iterable[str] | None]] = []
    account = service_account(run, settings)
    if account is not None:
        steps.append((INVALID_SERVICE_ACCOUNT, {
            runrbac.SERVICE_ACCOUNT_ANNOTATION: runrbac.service_account_problem(account)}, None))
    steps.append((UNREADABLE_JOIN, {node: state.problem for node, state in leases.items()},
                  leases))
    if node_signals is not None:
        shown = node_signal_problems(run, node_signals, leases)
        steps.append((NODE_SIGNAL, shown, shown))
    out = Report(problems=problems)
    for reason, found, present in steps:
        step = report(out.problems, reason, found, present)
        out.events += step.events
        out.logged += step.logged
        out.problems = step.problems
    return out
