"""``kubectl elasticrun VERB``: the command line, the API calls, and what failures mean.

Credentials are found as kubectl finds them: ``--kubeconfig``, else
``KUBECONFIG``, else ``~/.kube/config``, else the pod's ServiceAccount; the
namespace is ``-n``, else the context's, else the pod's, else ``default``.
Every request is bounded by ``--request-timeout`` and made once: an API server
that does not answer is reported with its address within that bound, never
retried in a loop.  The plugin acts with the user's own rights and needs only
those in :data:`elasticrun.cli.verbs.RIGHTS`.

Exit codes: 0 done (or nothing to change), 1 error, 2 usage.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import urllib3
import yaml

from elasticrun.api import crd
from elasticrun.api.kube import (
    MERGE_PATCH,
    ApiConnectionError,
    ApiError,
    KubeClient,
    load_credentials,
    run_path,
    runs_path,
)
from elasticrun.api.model import ElasticRun, InvalidRunError, parse_run
from elasticrun.api.untrusted import read_time
from elasticrun.cli import screen, verbs

#: Where a pod's ServiceAccount namespace is mounted (as kubectl reads it in a pod).
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DEFAULT_TIMEOUT = 10.0
#: How often a fenced edit (drain, undrain) is tried when someone else edits the run between
#: its read and its patch.
FENCED_TRIES = 3
USER_AGENT = "kubectl-elasticrun/0.1"
RESOURCE = f"{crd.PLURAL}.{crd.GROUP}"


class CliError(Exception):
    """An error the user can act on; the message says how (exit code 1)."""


@dataclass
class Target:
    """Where the plugin talks to: a client, the namespace, and how it found them."""

    client: KubeClient
    namespace: str
    #: The kubeconfig and context, or "in-cluster", for messages.
    source: str

    @property
    def server(self) -> str:
        return self.client.credentials.host


# --------------------------------------------------------------------------- arguments


def _global_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """The kubectl-style options, accepted before and after the verb."""
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument("--kubeconfig", default=default(None),
                        help="kubeconfig file (default: KUBECONFIG, then ~/.kube/config)")
    parser.add_argument("--context", default=default(None), help="kubeconfig context")
    parser.add_argument("-n", "--namespace", default=default(None),
                        help="namespace (default: the context's)")
    parser.add_argument("--request-timeout", type=_seconds, default=default(DEFAULT_TIMEOUT),
                        metavar="SECONDS",
                        help=f"bound of every API request (default {DEFAULT_TIMEOUT:g})")


def _seconds(text: str) -> float:
    try:
        value = float(text.removesuffix("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 600:
        raise argparse.ArgumentTypeError(f"{text!r}: write 0 < SECONDS <= 600")
    return value


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="kubectl elasticrun",
        description="Read and drive ElasticRuns (the rendezvous of torchrun --rdzv-backend=k8s).")
    _global_options(top, suppress=False)
    verbs_parser = top.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name: str, help_text: str, *args: tuple[str, str]) -> argparse.ArgumentParser:
        sub = verbs_parser.add_parser(name, help=help_text, description=help_text)
        _global_options(sub, suppress=True)
        for arg, arg_help in args:
            sub.add_argument(arg, help=arg_help)
        return sub

    run = ("run", "the ElasticRun's name")
    status = verb("status", "round, phase, ranks, waiting and lost nodes, conditions", run)
    status.add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text")
    listing = verb("list", "the runs of the namespace, like kubectl get er")
    listing.add_argument("-A", "--all-namespaces", action="store_true")
    listing.add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text")
    verb("close", "close the run: waiting and late nodes fail with RendezvousClosedError", run)
    verb("reopen", "reopen a closed run: every node forms a new round", run)
    verb("restart", "force a new round now (the operator re-forms the running one)", run)
    drain = verb("drain", "take a node out of the round; if it joins again it waits, unadmitted",
                 run, ("node", "the node's name (as in status: MEMBER or NODE)"))
    drain.add_argument("--force", action="store_true",
                       help="drain a node that is neither a member nor waiting (yet)")
    verb("undrain", "let a drained node be admitted again", run, ("node", "the node's name"))
    verb("resize", "set minNodes and maxNodes; the next round uses them", run,
         ("size", "MIN:MAX (or N for N:N)"))
    return top


# --------------------------------------------------------------------------- connecting


def _default_kubeconfig() -> str | None:
    if os.environ.get("KUBECONFIG"):
        return os.environ["KUBECONFIG"]
    home = Path("~/.kube/config").expanduser()
    return str(home) if home.exists() else None


def _context_namespace(kubeconfig: str, context: str | None) -> str | None:
    from kubernetes import config  # noqa: PLC0415 - heavy import, done once

    contexts, current = config.list_kube_config_contexts(kubeconfig)  # type: ignore[no-untyped-call]
    chosen = current if context is None else next(
        (c for c in contexts if c.get("name") == context), None)
    namespace = ((chosen or {}).get("context") or {}).get("namespace")
    return str(namespace) if namespace else None


def connect(args: argparse.Namespace) -> Target:
    """A client and namespace as kubectl would pick them (see the module's docstring)."""
    kubeconfig = args.kubeconfig or _default_kubeconfig()
    in_cluster = kubeconfig is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    if kubeconfig is None and not in_cluster:
        raise CliError("no kubeconfig: pass --kubeconfig, set KUBECONFIG, or write "
                       "~/.kube/config (the file kubectl uses)")
    try:
        credentials = load_credentials(kubeconfig, args.context)
        if in_cluster:
            source = "in-cluster ServiceAccount"
            namespace = args.namespace or (
                SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
                if SERVICE_ACCOUNT_NAMESPACE.exists() else None)
        else:
            assert kubeconfig is not None
            source = f"kubeconfig {kubeconfig}" + (f", context {args.context}"
                                                   if args.context else "")
            namespace = args.namespace or _context_namespace(kubeconfig, args.context)
    except Exception as exc:  # the official client raises ConfigException, OSError, ...
        where = "the in-cluster ServiceAccount" if in_cluster else f"kubeconfig {kubeconfig}"
        raise CliError(f"cannot load credentials from {where}"
                       + (f" (context {args.context})" if args.context else "")
                       + f": {exc}") from exc
    client = KubeClient(credentials, timeout=args.request_timeout, user_agent=USER_AGENT,
                        connections=2)
    return Target(client, namespace or "default", source)


def _unreachable(target: Target, exc: ApiConnectionError, timeout: float) -> CliError:
    cause = exc.__cause__
    # NewConnectionError is a ConnectTimeoutError in urllib3: it is looked at first.
    if isinstance(cause, urllib3.exceptions.NewConnectionError | ConnectionError):
        reason = "connection refused or no route"
    elif isinstance(cause, urllib3.exceptions.TimeoutError):
        reason = f"no answer within {timeout:g}s (--request-timeout)"
    elif isinstance(cause, urllib3.exceptions.SSLError):
        reason = f"TLS failed ({cause}); check the kubeconfig's certificate authority"
    else:
        reason = str(cause or exc)
    return CliError(f"cannot reach the API server {target.server} ({target.source}): {reason}. "
                    "Check that the cluster is up and that the kubeconfig's server and context "
                    "are the ones you mean (kubectl cluster-info)")


def _call(target: Target, verb: str, api_verb: str, request: Callable[[], dict[str, Any]]
          ) -> dict[str, Any]:
    """One request; forbidden and unreachable become messages that say what to do."""
    try:
        return request()
    except ApiConnectionError as exc:
        raise _unreachable(target, exc, target.client.timeout) from exc
    except ApiError as exc:
        if exc.forbidden:
            raise CliError(verbs.forbidden_message(verb, api_verb, target.namespace,
                                                   exc.message)) from exc
        raise


# --------------------------------------------------------------------------- reading runs


def _created(obj: dict[str, Any]) -> dt.datetime | None:
    return read_time((obj.get("metadata") or {}).get("creationTimestamp"))


def _not_found(target: Target, name: str) -> CliError:
    """No such run: say which runs there are, if the user may list them."""
    where = f"namespace {target.namespace!r}"
    try:
        listed = target.client.request("GET", runs_path(target.namespace))
    except (ApiError, ApiConnectionError):
        names = None
    else:
        names = sorted(str((item.get("metadata") or {}).get("name"))
                       for item in listed.get("items") or ())
    if names is None:
        known = "(the runs there could not be listed)"
    elif names:
        known = "runs there: " + ", ".join(screen.printable(n) for n in names)
    else:
        known = "there are no runs there"
    return CliError(f"no ElasticRun {name!r} in {where}; {known}. Pick another with -n "
                    "NAMESPACE or --context (kubectl elasticrun list -A lists every namespace)")


def read_run(target: Target, verb: str, name: str) -> dict[str, Any]:
    try:
        return _call(target, verb, "get",
                     lambda: target.client.request("GET", run_path(target.namespace, name)))
    except ApiError as exc:
        if exc.not_found:
            raise _not_found(target, name) from exc
        raise CliError(f"reading {target.namespace}/{name}: {exc}") from exc


def _parse(obj: dict[str, Any]) -> ElasticRun:
    try:
        return parse_run(obj)
    except InvalidRunError as exc:
        meta = obj.get("metadata") or {}
        raise CliError(f"ElasticRun {meta.get('namespace')}/{meta.get('name')} cannot be read: "
                       f"{screen.printable(exc, screen.MESSAGE_CHARS)}. Look at it with kubectl "
                       "get er NAME -o yaml; the operator repairs a status it cannot read") \
            from exc


# --------------------------------------------------------------------------- verbs


def _dump(document: Any, output: str) -> str:
    if output == "json":
        return json.dumps(document, indent=2)
    return yaml.safe_dump(document, sort_keys=False).rstrip("\n")


def do_status(target: Target, args: argparse.Namespace) -> str:
    obj = read_run(target, "status", args.run)
    run = _parse(obj)
    if args.output == "text":
        return screen.status_screen(run, _created(obj), dt.datetime.now(dt.UTC))
    return _dump(screen.status_document(run, _created(obj)), args.output)


def do_list(target: Target, args: argparse.Namespace) -> str:
    path = (f"/apis/{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}" if args.all_namespaces
            else runs_path(target.namespace))
    try:
        listed = _call(target, "list", "list", lambda: target.client.request("GET", path))
    except ApiError as exc:
        raise CliError(f"listing ElasticRuns: {exc}") from exc
    items = []
    for obj in listed.get("items") or ():
        meta = obj.get("metadata") or {}
        try:
            run, problem = parse_run(obj), None
        except InvalidRunError as exc:
            run, problem = None, str(exc)
        items.append(screen.Listed(str(meta.get("namespace", "")), str(meta.get("name", "")),
                                   _created(obj), run, problem))
    if args.output != "text":
        return _dump({"items": [screen.status_document(i.run, i.created) if i.run else
                                {"name": i.name, "namespace": i.namespace, "problem": i.problem}
                                for i in items]}, args.output)
    if not items:
        where = "any namespace" if args.all_namespaces else f"namespace {target.namespace!r}"
        return f"No ElasticRuns in {where}."
    return screen.runs_table(items, dt.datetime.now(dt.UTC), args.all_namespaces)


def _edit_for(args: argparse.Namespace) -> Callable[[ElasticRun], verbs.Edit]:
    """The pure verb, with its arguments parsed before any request is made."""
    if args.verb == "resize":
        size = verbs.parse_size(args.size)
        return lambda run: verbs.resize(run, size)
    if args.verb in ("drain", "undrain") and not args.node.strip():
        raise verbs.UsageError("NODE must not be empty")
    edits: dict[str, Callable[[ElasticRun], verbs.Edit]] = {
        "close": verbs.close,
        "reopen": verbs.reopen,
        "restart": verbs.restart,
        "drain": lambda run: verbs.drain(run, args.node, args.force),
        "undrain": lambda run: verbs.undrain(run, args.node),
    }
    return edits[args.verb]


def do_edit(target: Target, args: argparse.Namespace) -> str:
    """Read the run, decide the patch, send it; a fenced patch is tried again after a 409."""
    make_edit = _edit_for(args)
    for attempt in range(FENCED_TRIES):
        run = _parse(read_run(target, args.verb, args.run))
        edit = make_edit(run)
        if edit.patch is None:
            return verbs.describe(run.namespace, run.name, edit)
        patch = edit.patch
        try:
            _call(target, args.verb, "patch", partial(
                target.client.request, "PATCH", run_path(target.namespace, args.run),
                body=patch, content_type=MERGE_PATCH))
        except ApiError as exc:
            if exc.conflict and edit.fenced and attempt + 1 < FENCED_TRIES:
                continue  # someone edited the run between our read and our patch
            if exc.not_found:
                raise _not_found(target, args.run) from exc
            raise CliError(f"{args.verb} {target.namespace}/{args.run}: the API server "
                           f"refused the change: {exc.message}") from exc
        return verbs.describe(run.namespace, run.name, edit)
    raise AssertionError("unreachable")  # pragma: no cover


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    try:
        if args.verb in ("status", "list"):
            target = connect(args)
            out = (do_status if args.verb == "status" else do_list)(target, args)
        else:
            _edit_for(args)  # a malformed argument is a usage error before any request
            target = connect(args)
            out = do_edit(target, args)
    except verbs.UsageError as exc:
        print(f"kubectl elasticrun {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except (CliError, verbs.VerbError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
