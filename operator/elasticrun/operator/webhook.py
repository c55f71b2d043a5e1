"""Mutating admission for training pods that opt in to elasticrun.

A pod opts in with the label ``elasticrun.dev/run: NAME`` (a label, because the
API server can pre-filter webhook calls by label only, so every other pod in the
cluster never reaches this code) and, optionally, the annotations
``elasticrun.dev/nnodes: "MIN:MAX"`` and ``elasticrun.dev/nproc-per-node: "K"``.
The label's value may be left empty (``elasticrun.dev/run: ""``): the webhook
then names the run after the workload that made the pod (:data:`WORKLOAD_LABELS`)
and writes that name into the label, so one shared template (a Trainer runtime,
a JobSet) opts in every workload made from it, each as its own run.
It gets, in every container, the ``PET_*`` environment torchrun reads in place
of its flags, and the downward-API variables the ``k8s`` backend uses to name
the node, so the user's command stays a plain ``torchrun train.py``.

The module is in two layers.  The pure functions (:func:`read_opt_in`,
:func:`plan_mutation`, :func:`mutation_for`) decide everything and are tested
without a cluster.  The kopf handler (:func:`mutate_pod`) and
:func:`configure_webhook` only connect them to kopf's webhook server; the
operator's entry point calls :func:`setup_webhook` (or
:func:`configure_webhook` directly) at start-up.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
import kopf

from elasticrun.api import crd
from elasticrun.api.kube import KubeClient
from elasticrun.api.naming import is_dns_label

log = logging.getLogger(__name__)

RUN_LABEL = crd.RUN_LABEL
NNODES_ANNOTATION = f"{crd.GROUP}/nnodes"
NPROC_ANNOTATION = f"{crd.GROUP}/nproc-per-node"
#: kopf's handler id; it is also the last URL path segment of the webhook
#: (``https://HOST:PORT/elasticrun-pod-env``), which the chart's configuration names.
HANDLER_ID = "elasticrun-pod-env"
WEBHOOK_PATH = f"/{HANDLER_ID}"

#: ``PET_MAX_RESTARTS`` for opted-in containers that set none.  torchrun's default, 0,
#: suits a fixed-size job but not an elastic one: when a node dies, the survivors'
#: workers often fail in a collective before their agent sees the new round, and
#: that failure counts as a restart; with none left the agent exits, its pod
#: fails and every survivor is replaced.  A membership change (a node admitted or
#: removed while the workers are healthy) costs no restart.  ``--max-restarts`` on
#: the command line, or the container's own ``PET_MAX_RESTARTS``, wins.
DEFAULT_MAX_RESTARTS = 10

_COUNT = re.compile(r"^[0-9]+$")  # ASCII digits only: str.isdigit() also accepts "²"
#: torchrun's --nproc-per-node accepts a count or one of these words.
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


#: Labels workload controllers put on the pods they create, outermost workload
#: first.  The run is the outermost workload: every pod of one training job must
#: meet in one rendezvous, and only the outermost object spans all of them.  A
#: JobSet's pods carry its name and their own Job's name (one Job per replicated
#: job and index), so the Job name would split one JobSet into several runs; a
#: TrainJob is realised as a JobSet of the same name, so a TrainJob's pods carry
#: the JobSet's and the Job's labels (and the TrainJob's own, where Trainer sets
#: one), which all resolve to the TrainJob.  A plain Job has only the last one.
WORKLOAD_LABELS = (
    "trainer.kubeflow.org/trainjob-name",
    "jobset.sigs.k8s.io/jobset-name",
    "batch.kubernetes.io/job-name",
)


class OptInError(ValueError):
    """A label or annotation the webhook cannot use; the message says what to write."""


@dataclass(frozen=True)
class OptIn:
    """What an opted-in pod asked for, validated."""

    run: str
    min_nodes: int | None = None
    max_nodes: int | None = None
    nproc_per_node: str | None = None
    #: The label came empty and ``run`` was read from :data:`WORKLOAD_LABELS`;
    #: the mutation writes it into the label, the key the operator watches pods by.
    run_from_workload: bool = False

    @property
    def nnodes(self) -> str | None:
        """torchrun's ``--nnodes`` form; always MIN:MAX so it is never ambiguous."""
        if self.min_nodes is None:
            return None
        return f"{self.min_nodes}:{self.max_nodes}"


@dataclass(frozen=True)
class Mutation:
    """JSON patch operations for one pod, and warnings for the user who created it."""

    ops: list[dict[str, Any]]
    warnings: list[str]
    opt_in: OptIn | None = None


# --------------------------------------------------------------------------- validation


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` as torchrun reads ``--nnodes``; bounds from the CRD."""
    value = text.strip()
    example = f'write e.g. {NNODES_ANNOTATION}: "2:4" (MIN:MAX) or "4" (a fixed size)'
    parts = value.split(":")
    if len(parts) > 2 or not all(_COUNT.match(p.strip()) for p in parts):
        raise OptInError(f"{NNODES_ANNOTATION}: {text!r} is not a node count; {example}")
    low, high = int(parts[0]), int(parts[-1])
    ceiling = crd.spec_maximum("maxNodes")
    if low < 1:
        raise OptInError(f"{NNODES_ANNOTATION}: {text!r} asks for {low} nodes; MIN must be at "
                         f"least 1; {example}")
    if low > high:
        raise OptInError(f"{NNODES_ANNOTATION}: {text!r} has MIN {low} above MAX {high}; "
                         f'write the smaller number first, e.g. "{high}:{low}"')
    if high > ceiling:
        raise OptInError(f"{NNODES_ANNOTATION}: {text!r} exceeds the ElasticRun limit of "
                         f'{ceiling} nodes; write e.g. "{min(low, ceiling)}:{ceiling}"')
    return low, high


def parse_nproc_per_node(text: str) -> str:
    value = text.strip()
    if value in _NPROC_WORDS or (_COUNT.match(value) and int(value) >= 1):
        return value
    raise OptInError(f"{NPROC_ANNOTATION}: {text!r} is not a process count; write a whole "
                     f'number of at least 1 (e.g. "8") or one of {", ".join(_NPROC_WORDS)}')


def read_opt_in(labels: Mapping[str, str] | None,
                annotations: Mapping[str, str] | None) -> OptIn | None:
    """The pod's request, ``None`` for a pod that did not opt in; raises :class:`OptInError`."""
    labels = labels or {}
    annotations = annotations or {}
    if RUN_LABEL not in labels:
        return None
    run = labels[RUN_LABEL]
    from_workload = run == ""
    if from_workload:
        run = run_from_workload(labels)
    elif not is_dns_label(run):
        raise OptInError(f"label {RUN_LABEL}: {run!r} cannot name an ElasticRun; use 1-63 "
                         "lower-case letters, digits and '-', starting and ending with a letter "
                         f"or digit, e.g. {RUN_LABEL}: {_suggest_name(run)}")
    low = high = None
    if annotations.get(NNODES_ANNOTATION) is not None:
        low, high = parse_nnodes(annotations[NNODES_ANNOTATION])
    nproc = None
    if annotations.get(NPROC_ANNOTATION) is not None:
        nproc = parse_nproc_per_node(annotations[NPROC_ANNOTATION])
    return OptIn(run=run, min_nodes=low, max_nodes=high, nproc_per_node=nproc,
                 run_from_workload=from_workload)


def run_from_workload(labels: Mapping[str, str]) -> str:
    """The run name for an empty run label: the first of :data:`WORKLOAD_LABELS` set.

    The name must be a DNS label like any run name (a Job may be named
    ``train.v2``); the error then says to write the run name into the label.
    """
    for key in WORKLOAD_LABELS:
        value = labels.get(key)
        if not value:
            continue
        if not is_dns_label(value):
            raise OptInError(f"label {RUN_LABEL} is empty and the run name taken from {key}: "
                             f"{value!r} is not a valid ElasticRun name; write one into the "
                             f"label, e.g. {RUN_LABEL}: {_suggest_name(value)}")
        return value
    raise OptInError(f"label {RUN_LABEL} is empty and the pod carries none of "
                     f"{', '.join(WORKLOAD_LABELS)} to name the run after; write the run name "
                     f"into the label, e.g. {RUN_LABEL}: my-run")


def _suggest_name(value: str) -> str:
    cleaned = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")[:63].strip("-")
    return cleaned or "my-run"


# --------------------------------------------------------------------------- mutation


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def desired_env(opt_in: OptIn) -> list[dict[str, Any]]:
    """The variables an opted-in container needs, in the order they must appear.

    ``PET_LOCAL_ADDR`` refers to ``$(POD_IP)``, which the kubelet expands only
    from variables listed *before* it, so it comes last.
    """
    env: list[dict[str, Any]] = [
        {"name": "PET_RDZV_BACKEND", "value": "k8s"},
        {"name": "PET_RDZV_ID", "value": opt_in.run},
    ]
    if opt_in.nnodes is not None:
        env.append({"name": "PET_NNODES", "value": opt_in.nnodes})
    if opt_in.nproc_per_node is not None:
        env.append({"name": "PET_NPROC_PER_NODE", "value": opt_in.nproc_per_node})
    env.append({"name": "PET_MAX_RESTARTS", "value": str(DEFAULT_MAX_RESTARTS)})
    env += [
        {"name": "POD_NAME", **_field("metadata.name")},
        {"name": "POD_NAMESPACE", **_field("metadata.namespace")},
        {"name": "POD_UID", **_field("metadata.uid")},
        {"name": "POD_IP", **_field("status.podIP")},
        {"name": "PET_LOCAL_ADDR", "value": "$(POD_IP)"},
    ]
    return env


#: The label a StatefulSet's controller puts on each of its Pods (Kubernetes 1.28+): its ordinal.
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"


def index_env(labels: Any) -> list[dict[str, Any]]:
    """``ELASTICRUN_POD_INDEX`` from the Pod's :data:`POD_INDEX_LABEL`, when it has one.

    The handler ranks newcomers by their Pod's index
    (``elasticrun.handler.settings.pod_index``); an Indexed Job's Pods carry
    it as ``JOB_COMPLETION_INDEX`` already, a StatefulSet's only as a label,
    which a container reads through the downward API.
    """
    if not isinstance(labels, Mapping) or POD_INDEX_LABEL not in labels:
        return []
    return [{"name": "ELASTICRUN_POD_INDEX",
             **_field(f"metadata.labels['{POD_INDEX_LABEL}']")}]


def plan_mutation(pod: Mapping[str, Any]) -> Mutation:
    """JSON patch ops that add the missing variables to every container.

    Variables a container does not define yet are added; a container's own value
    wins (a warning says so when it differs from what elasticrun would have
    set), and a pod that was already mutated yields no ops.  Two exceptions,
    both from the pod's own metadata: an empty run label is replaced by the
    workload's name (:func:`run_from_workload`), and an ``elasticrun.dev/nnodes``
    annotation replaces a different ``PET_NNODES``, because launchers set that
    variable themselves (Trainer's torch plugin to ``numNodes``, a reserved
    name a TrainJob cannot change) and the annotation is the only place such
    a pod can state its elastic size.  ``PET_NODE_RANK``, ``PET_MASTER_ADDR``
    and ``PET_MASTER_PORT`` from a launcher stay: torchrun reads them only for
    its static rendezvous, and with ``k8s`` the ranks come from the rendezvous.
    Raises :class:`OptInError` for a bad label or annotation.
    """
    meta = pod.get("metadata") or {}
    opt_in = read_opt_in(meta.get("labels"), meta.get("annotations"))
    if opt_in is None:
        return Mutation([], [])
    wanted = desired_env(opt_in) + index_env(meta.get("labels"))
    ops: list[dict[str, Any]] = []
    warnings: list[str] = []
    if opt_in.run_from_workload:
        ops.append({"op": "replace", "path": f"/metadata/labels/{_pointer(RUN_LABEL)}",
                    "value": opt_in.run})
    containers = (pod.get("spec") or {}).get("containers") or []
    for index, container in enumerate(containers):
        existing = {item.get("name"): item for item in container.get("env") or []}
        missing = [var for var in wanted if var["name"] not in existing]
        ops += _nnodes_override(opt_in, index, container, warnings)
        for var in wanted:
            mine = existing.get(var["name"])
            if mine is not None and "value" in var and mine.get("value") != var["value"] \
                    and var["name"] not in ("PET_LOCAL_ADDR", "PET_NNODES"):
                warnings.append(f"container {container.get('name')!r} sets {var['name']}="
                                f"{mine.get('value')!r}; elasticrun leaves it as is (it would "
                                f"set {var['value']!r})")
        if not missing:
            continue
        base = f"/spec/containers/{index}/env"
        if container.get("env") is None:
            ops.append({"op": "add", "path": base, "value": missing})
        else:
            ops += [{"op": "add", "path": f"{base}/-", "value": var} for var in missing]
    return Mutation(ops, warnings, opt_in)


def _pointer(key: str) -> str:
    """``key`` as one JSON-pointer segment (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def _nnodes_override(opt_in: OptIn, index: int, container: Mapping[str, Any],
                     warnings: list[str]) -> list[dict[str, Any]]:
    """Replace a container's ``PET_NNODES`` that differs from the annotation's size."""
    if opt_in.nnodes is None:
        return []
    ops: list[dict[str, Any]] = []
    for position, item in enumerate(container.get("env") or []):
        if item.get("name") != "PET_NNODES" or item == {"name": "PET_NNODES",
                                                        "value": opt_in.nnodes}:
            continue
        ops.append({"op": "replace", "path": f"/spec/containers/{index}/env/{position}",
                    "value": {"name": "PET_NNODES", "value": opt_in.nnodes}})
        warnings.append(f"container {container.get('name')!r} sets PET_NNODES="
                        f"{item.get('value')!r}; {NNODES_ANNOTATION} makes it "
                        f"{opt_in.nnodes!r}")
    return ops


def mutation_for(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) for one pod; ``[]`` when nothing is to change."""
    return plan_mutation(pod).ops


def mutated(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the pod with its mutation applied (what the API server would store)."""
    result: dict[str, Any] = jsonpatch.apply_patch(copy.deepcopy(dict(pod)), mutation_for(pod))
    return result


# --------------------------------------------------------------------------- the handler

async def mutate_pod(body: kopf.Body, patch: kopf.Patch, warnings: list[str],
                     **_: Any) -> None:
    """Inject the torchrun environment; nothing else.

    Admission has no side effects: the webhook writes no object.  It runs with
    the operator's rights, so anything it created would be created for a
    caller who may not create it, and a pod refused by a later admission step
    would leave it behind.  A missing ElasticRun is created by the first
    node's handler from the injected ``PET_NNODES`` (with the pod's own rights).
    """
    pod: dict[str, Any] = dict(body)
    try:
        plan = plan_mutation(pod)
    except OptInError as exc:
        raise kopf.AdmissionError(str(exc), code=400) from exc
    warnings.extend(plan.warnings)
    if plan.ops:
        ops = plan.ops
        patch.fns.append(lambda raw: jsonpatch.apply_patch(raw, ops, in_place=True))


# --------------------------------------------------------------------------- wiring


def configure_webhook(settings: kopf.OperatorSettings, *, addr: str, port: int,
                      host: str | None, certfile: str | None, pkeyfile: str | None,
                      cafile: str | None, managed: str | None) -> None:
    """Serve the webhook on ``addr:port`` over TLS with the given certificate.

    ``managed`` names a MutatingWebhookConfiguration that kopf creates and keeps
    pointed at ``https://HOST:PORT/...`` (for a local operator; it needs create
    and patch on mutatingwebhookconfigurations).  In a cluster leave it ``None``:
    the Helm chart owns the configuration and routes through a Service.
    A certificate is required because kopf's self-signed mode depends on a
    library that fails with OpenSSL >= 3.0.10; use :func:`generate_serving_cert`
    (``elasticrun.operator.webhookcert``) to make one at start-up.
    """
    if not certfile or not pkeyfile:
        raise ValueError("the webhook needs a serving certificate and key (--webhook-cert and "
                         "--webhook-key, or --webhook-self-signed DNS-NAME to make one)")
    first = settings.admission.server is None
    settings.admission.server = kopf.WebhookServer(
        addr=addr, port=port, host=host, certfile=certfile, pkeyfile=pkeyfile, cafile=cafile)
    settings.admission.managed = managed
    if first:  # a startup handler kopf retries configures the same settings again
        register_handler()


def register_handler(registry: kopf.OperatorRegistry | None = None) -> None:
    """Register :func:`mutate_pod` with kopf (once per operator: see configure_webhook).

    Not done at import time: kopf refuses to start when admission handlers are
    registered but no webhook server is configured, and the operator serves the
    webhook only when asked to (``--webhook-port``).
    """
    kopf.on.mutate("pods", id=HANDLER_ID, labels={RUN_LABEL: kopf.PRESENT},
                   operations=["CREATE"], side_effects=False, registry=registry)(mutate_pod)


def add_webhook_arguments(parser: argparse.ArgumentParser) -> None:
    """The operator's webhook flags, as the Helm chart passes them."""
    group = parser.add_argument_group("admission webhook (off unless --webhook-port is given)")
    group.add_argument("--webhook-port", type=int, default=None,
                       help="serve the pod-mutating webhook over HTTPS on this port")
    group.add_argument("--webhook-addr", default="0.0.0.0",
                       help="address to listen on (default: all interfaces)")
    group.add_argument("--webhook-host", default=None,
                       help="host name in the webhook URL kopf registers (with --webhook-managed)")
    group.add_argument("--webhook-cert", default=None, help="serving certificate (PEM)")
    group.add_argument("--webhook-key", default=None, help="serving certificate's key (PEM)")
    group.add_argument("--webhook-ca", default=None,
                       help="CA bundle that signed --webhook-cert (for the caBundle)")
    group.add_argument("--webhook-self-signed", action="append", default=[], metavar="DNS_NAME",
                       help="make a CA and serving certificate for this name at start "
                            "(repeatable), instead of --webhook-cert/--webhook-key")
    group.add_argument("--webhook-ca-secret", default=None, metavar="NAME",
                       help="with --webhook-self-signed: keep the CA in this Secret of "
                            "--webhook-ca-secret-namespace, made by the first replica, so "
                            "every replica's certificate chains to the one caBundle")
    group.add_argument("--webhook-ca-secret-namespace",
                       default=os.environ.get("POD_NAMESPACE", ""),
                       help="namespace of --webhook-ca-secret (default: $POD_NAMESPACE)")
    group.add_argument("--webhook-cert-dir", default="/tmp/elasticrun-webhook",
                       help="where --webhook-self-signed writes the certificate")
    group.add_argument("--webhook-configuration", default=None, metavar="NAME",
                       help="MutatingWebhookConfiguration whose caBundle the operator sets to "
                            "its self-signed CA")
    group.add_argument("--webhook-ca-check-seconds", type=float, default=30.0,
                       metavar="SECONDS",
                       help="re-check the --webhook-configuration caBundle this often and "
                            "repair it (default 30)")
    group.add_argument("--webhook-managed", default=None, metavar="NAME",
                       help="let kopf create and manage a configuration of this name "
                            "(local development only)")


def setup_webhook(settings: kopf.OperatorSettings, args: argparse.Namespace,
                  client: KubeClient | None = None) -> bytes | None:
    """Apply :func:`add_webhook_arguments`' flags; a no-op without ``--webhook-port``.

    With ``--webhook-self-signed`` it makes the certificate first and, with
    ``--webhook-configuration``, writes the new CA into that configuration, so
    the API server trusts the fresh certificate of every operator start.
    ``client`` (the operator's own, honouring its ``--kubeconfig``) is used for
    that; default: in-cluster or KUBECONFIG.
    It blocks on the API server: call it from a thread in an async startup handler.
    Returns the self-signed CA written into the configuration (None otherwise),
    for :func:`elasticrun.operator.webhookcert.keep_ca_bundle`.
    """
    if not args.webhook_port:
        return None
    from elasticrun.operator import webhookcert  # noqa: PLC0415 - only when self-signing

    certfile, pkeyfile, cafile = args.webhook_cert, args.webhook_key, args.webhook_ca
    written: bytes | None = None
    if args.webhook_self_signed:
        ca = None
        if args.webhook_ca_secret:
            if not args.webhook_ca_secret_namespace:
                raise ValueError("--webhook-ca-secret needs --webhook-ca-secret-namespace "
                                 "(or POD_NAMESPACE)")
            ca = webhookcert.shared_ca(client or KubeClient.from_config(timeout=10),
                                       args.webhook_ca_secret_namespace, args.webhook_ca_secret)
        cert = webhookcert.generate_serving_cert(Path(args.webhook_cert_dir),
                                                 args.webhook_self_signed, ca=ca)
        certfile, pkeyfile, cafile = str(cert.certfile), str(cert.pkeyfile), str(cert.cafile)
        if args.webhook_configuration:
            webhookcert.inject_ca_bundle(client or KubeClient.from_config(timeout=10),
                                         args.webhook_configuration,
                                         cert.ca_pem)
            written = cert.ca_pem
    configure_webhook(settings, addr=args.webhook_addr, port=args.webhook_port,
                      host=args.webhook_host, certfile=certfile, pkeyfile=pkeyfile,
                      cafile=cafile, managed=args.webhook_managed)
    return written


__all__: Sequence[str] = (
    "HANDLER_ID", "NNODES_ANNOTATION", "NPROC_ANNOTATION", "POD_INDEX_LABEL", "RUN_LABEL",
    "WEBHOOK_PATH",
    "WORKLOAD_LABELS", "Mutation", "OptIn", "OptInError", "add_webhook_arguments",
    "configure_webhook",
    "desired_env", "index_env", "mutate_pod", "mutated", "mutation_for", "parse_nnodes",
    "parse_nproc_per_node", "plan_mutation", "read_opt_in", "register_handler",
    "run_from_workload",
    "setup_webhook",
)
