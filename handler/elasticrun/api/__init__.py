"""The ElasticRun API: the layer the handler, the operator, the plugin and in-place share.

Two kinds of module live here.  The facts and rules (the CRD's names and bounds,
the spec/status model, Leases as data, the round rules, the retry policy) are
pure and need nothing but PyYAML; this package itself imports only those
(:mod:`.crd`, :mod:`.model`).  The one I/O layer is :mod:`.kube`, a REST client
on urllib3 that finds credentials with the official ``kubernetes`` client, and
:mod:`.gateway`, a run's requests through it; only code that makes requests
imports them.  The import contracts in ``pyproject.toml`` keep this true: the
package imports none of its users, and its pure modules no client.
"""

from elasticrun.api.crd import API_VERSION, GROUP, KIND, PLURAL, RUN_LABEL, VERSION
from elasticrun.api.model import (
    Condition,
    ElasticRun,
    InvalidRunError,
    LostMember,
    Participant,
    RunSpec,
    RunStatus,
    StoreAddress,
    WaitingNode,
    parse_run,
)

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "RUN_LABEL",
    "VERSION",
    "Condition",
    "ElasticRun",
    "InvalidRunError",
    "LostMember",
    "Participant",
    "RunSpec",
    "RunStatus",
    "StoreAddress",
    "WaitingNode",
    "parse_run",
]
