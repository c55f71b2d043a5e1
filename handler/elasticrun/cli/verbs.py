"""What each verb of ``kubectl elasticrun`` changes, as pure functions of the run.

A verb is an :class:`Edit`: the merge patch to send (None when the run is
already as asked), the fields it changes (for the message) and what happens
next.  Field and annotation names come from :mod:`elasticrun.api.crd` and the
model, so the plugin writes exactly what the operator and the nodes read; the
bounds and the ``minNodes``/``maxNodes`` rule come from the CRD itself, so a
size the plugin accepts is one the API server accepts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elasticrun.api import crd, rounds
from elasticrun.api.model import ElasticRun

#: The value the restart annotation is set to; the operator reads only its presence.
RESTART_VALUE = "now"

#: The API verbs each plugin verb needs on ``elasticruns`` (``list`` also helps
#: the "run not found" message, which names the runs it can list).  Nothing
#: else: no status writes, no Leases, no Pods.
RIGHTS: Mapping[str, tuple[str, ...]] = {
    "status": ("get",),
    "list": ("list",),
    "close": ("get", "patch"),
    "reopen": ("get", "patch"),
    "restart": ("get", "patch"),
    "drain": ("get", "patch"),
    "undrain": ("get", "patch"),
    "resize": ("get", "patch"),
}


class UsageError(ValueError):
    """The command line is wrong (exit code 2)."""


class VerbError(ValueError):
    """The verb cannot be done to this run as it is (exit code 1)."""


@dataclass(frozen=True)
class Change:
    field: str
    before: str
    after: str


@dataclass(frozen=True)
class Edit:
    """One verb applied to one run: the patch, what it changes, what follows."""

    verb: str
    #: A JSON merge patch of the run; None when nothing needs to change.
    patch: dict[str, Any] | None
    changes: tuple[Change, ...] = ()
    #: What happens next (who acts on the change), or why nothing changed.
    note: str = ""
    #: Whether the patch carries the run's resourceVersion (a compare-and-set:
    #: a concurrent edit of the same list makes it fail with 409, and the
    #: caller reads the run again).
    fenced: bool = False


@dataclass(frozen=True)
class Size:
    min_nodes: int
    max_nodes: int

    def __str__(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes}"


# --------------------------------------------------------------------------- the CRD's rules


def _spec_rule_message(field_path: str) -> str:
    """The message of the CRD's validation rule on ``spec`` for ``field_path``."""
    for version in crd.crd_manifest()["spec"]["versions"]:
        if version["name"] != crd.VERSION:
            continue
        spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
        for rule in spec.get("x-kubernetes-validations", ()):
            if rule.get("fieldPath") == field_path:
                return str(rule["message"])
    raise LookupError(f"the CRD has no rule for spec{field_path}")  # pragma: no cover


def max_below_min_message() -> str:
    """What the API server says of ``maxNodes < minNodes`` (the CRD's own rule)."""
    return _spec_rule_message(".maxNodes")


def node_bounds(field_name: str) -> tuple[int, int]:
    """The CRD's ``minimum`` and ``maximum`` of ``spec.<field_name>``."""
    props = crd.spec_properties()[field_name]
    return int(props["minimum"]), crd.spec_maximum(field_name)


_SIZE = re.compile(r"\s*(\d{1,9})\s*(?::\s*(\d{1,9})\s*)?")


def parse_size(text: str) -> Size:
    """``MIN:MAX`` (or ``N`` for ``N:N``, as torchrun's ``--nnodes``), checked as the CRD does."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise UsageError(f"{text!r} is not a size: write MIN:MAX (for example 2:4), or N for "
                         "N:N")
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) is not None else low
    for name, value in (("minNodes", low), ("maxNodes", high)):
        lowest, highest = node_bounds(name)
        if not lowest <= value <= highest:
            raise UsageError(f"{text!r}: {name} must be {lowest} to {highest} (the CRD's "
                             f"bounds), found {value}")
    if high < low:
        raise UsageError(f"{text!r}: {max_below_min_message()}")
    return Size(low, high)


# --------------------------------------------------------------------------- verbs


def close(run: ElasticRun) -> Edit:
    """``spec.closed: true``: waiting and late nodes fail with RendezvousClosedError."""
    if run.spec.closed:
        return Edit("close", None, note="spec.closed is already true; nothing changed")
    return Edit("close", {"spec": {"closed": True}},
                (Change("spec.closed", "false", "true"),),
                "waiting and late nodes fail with RendezvousClosedError; the operator "
                "marks the run Closed")


def reopen(run: ElasticRun) -> Edit:
    """``spec.closed: false``: every node forms a new round (a Succeeded run stays finished)."""
    if run.status.phase == "Succeeded":
        raise VerbError(f"the run succeeded (phase Succeeded, finished "
                        f"{run.status.finished_at or 'at an unknown time'}): a finished run is "
                        "not reopened; create a new run")
    if not run.spec.closed:
        return Edit("reopen", None, note="spec.closed is already false; nothing changed")
    return Edit("reopen", {"spec": {"closed": False}},
                (Change("spec.closed", "true", "false"),),
                "the operator reopens the run and every node forms a new round")


def restart(run: ElasticRun) -> Edit:
    """The restart annotation: the operator re-forms the running round once."""
    status = run.status
    if crd.RESTART_ANNOTATION in run.annotations:
        return Edit("restart", None, note=f"a restart is already requested (annotation "
                    f"{crd.RESTART_ANNOTATION}); the operator has not consumed it yet")
    if rounds.request_restart(status) is None:
        if status.round == 0:
            raise VerbError(f"no round to restart: the run has not formed one yet (phase "
                            f"{status.phase}); a round forms once minNodes "
                            f"({run.spec.min_nodes}) nodes have joined")
        return Edit("restart", None, note=f"round {status.round} is already being re-formed "
                    f"(phase {status.phase}); nothing changed")
    return Edit("restart", {"metadata": {"annotations": {crd.RESTART_ANNOTATION: RESTART_VALUE}}},
                (Change(f"annotation {crd.RESTART_ANNOTATION}", "<none>", RESTART_VALUE),),
                f"the operator consumes the annotation and re-forms round {status.round}: "
                "every member joins the next round")


def drain_list(run: ElasticRun) -> list[str]:
    """The drain annotation's names, in their order, without repeats or blanks.

    The same names as :attr:`ElasticRun.drained`, which the operator reads; the
    order is kept so that an edit changes only the name it is about.
    """
    raw = run.annotations.get(crd.DRAIN_ANNOTATION, "")
    return list(dict.fromkeys(name.strip() for name in raw.split(",") if name.strip()))


def _drain_patch(run: ElasticRun, names: Sequence[str]) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": run.resource_version,
                         "annotations": {crd.DRAIN_ANNOTATION: ",".join(names) or None}}}


def _names(values: Sequence[str] | frozenset[str]) -> str:
    return ", ".join(sorted(values)) or "none"


def drain(run: ElasticRun, node: str, force: bool = False) -> Edit:
    """Add ``node`` to the drain annotation: it leaves the round and is not admitted again.

    Only a member or a waiting node, unless ``force`` (a node that has not
    joined yet, drained in advance): a misspelt name would otherwise drain
    nobody without a word.
    """
    status = run.status
    names = drain_list(run)
    if node in names:
        return Edit("drain", None, note=f"{node} is already drained; nothing changed")
    if not force and node not in status.member_names | status.waiting_names:
        raise VerbError(
            f"{node!r} is neither a member nor waiting. Members of round {status.round}: "
            f"{_names(status.member_names)}; waiting: {_names(status.waiting_names)}. "
            "To drain a node that has not joined yet, add --force")
    after = [*names, node]
    member = status.participant(node)
    if member is not None:
        note = (f"{node} is rank {member.rank} of round {status.round}: the operator removes "
                "it (reason Drained) and the others form a new round; if it joins again it "
                "waits without being admitted")
    else:
        note = f"{node} is not a member: if it joins, it waits without being admitted"
    return Edit("drain", _drain_patch(run, after),
                (Change(f"annotation {crd.DRAIN_ANNOTATION}", ",".join(names) or "<none>",
                        ",".join(after)),), note, fenced=True)


def undrain(run: ElasticRun, node: str) -> Edit:
    """Remove ``node`` from the drain annotation (the annotation goes when it is empty)."""
    names = drain_list(run)
    if node not in names:
        raise VerbError(f"{node!r} is not drained. Drained nodes: {_names(frozenset(names))}")
    after = [name for name in names if name != node]
    return Edit("undrain", _drain_patch(run, after),
                (Change(f"annotation {crd.DRAIN_ANNOTATION}", ",".join(names),
                        ",".join(after) or "<none>"),),
                f"{node} may be admitted again: it joins the next round that forms", fenced=True)


def resize(run: ElasticRun, size: Size) -> Edit:
    """``spec.minNodes``/``spec.maxNodes``; they take effect in the next round."""
    spec = run.spec
    changes = tuple(
        Change(f"spec.{name}", str(before), str(after))
        for name, before, after in (("minNodes", spec.min_nodes, size.min_nodes),
                                    ("maxNodes", spec.max_nodes, size.max_nodes))
        if before != after)
    if not changes:
        return Edit("resize", None, note=f"the size is already {size}; nothing changed")
    return Edit("resize", {"spec": {"minNodes": size.min_nodes, "maxNodes": size.max_nodes}},
                changes,
                "takes effect in the next round (kubectl elasticrun restart RUN forms one now)")


# --------------------------------------------------------------------------- messages


def describe(namespace: str, name: str, edit: Edit) -> str:
    """What a verb did, as printed: one line per change, then what happens next."""
    who = f"elasticrun {namespace}/{name}"
    if edit.patch is None:
        return f"{who}: {edit.note}"
    lines = [f"{who}: {edit.verb}"]
    lines += [f"  {c.field}: {c.before} -> {c.after}" for c in edit.changes]
    if edit.note:
        lines.append(f"  {edit.note}")
    return "\n".join(lines)


def forbidden_message(verb: str, api_verb: str, namespace: str, server_message: str) -> str:
    """The API server refused ``api_verb``: which right the user lacks, and how to get it."""
    resource = f"{crd.PLURAL}.{crd.GROUP}"
    needs = RIGHTS[verb]
    return (f"forbidden: {verb} needs {', '.join(needs)} on {resource} in namespace "
            f"{namespace!r}, and you may not {api_verb} them (the API server said: "
            f"{server_message}). Ask for a Role with verbs [{', '.join(needs)}] on {resource} "
            f"bound to you; check with: kubectl auth can-i {api_verb} {resource} -n {namespace}")
