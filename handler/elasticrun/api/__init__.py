"""The ElasticRun API: CRD facts, the spec/status model and the pure round logic.

Shared by the in-pod handler and the operator; depends on nothing but PyYAML.
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
