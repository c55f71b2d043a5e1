"""The retry-and-error policy and the request bodies of the run gateway, without a server."""

from __future__ import annotations

import pytest

from elasticrun.api.gateway import announce_patch, status_body
from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.model import RunStatus
from elasticrun.api.ordering import newer, older
from elasticrun.api.policy import (
    REQUEUE_AFTER_API_ERROR,
    REQUEUE_AFTER_ERROR,
    RETRY_DELAYS,
    Failure,
    classify,
    requeue_delay,
    retry_delay,
)


def api_error(status: int) -> ApiError:
    return ApiError(status, "Reason", "message", {})


@pytest.mark.parametrize(("error", "failure"), [
    (ApiConnectionError("refused"), Failure.TRANSIENT),
    (api_error(429), Failure.TRANSIENT),
    (api_error(503), Failure.TRANSIENT),
    (api_error(403), Failure.FORBIDDEN),
    (api_error(404), Failure.NOT_FOUND),
    (api_error(409), Failure.CONFLICT),
    (api_error(400), Failure.REFUSED),
    (api_error(422), Failure.REFUSED),
])
def test_every_failure_has_one_meaning(error: ApiError | ApiConnectionError,
                                       failure: Failure) -> None:
    assert classify(error) is failure


def test_retry_delays_grow_then_stay_at_the_last() -> None:
    delays = [retry_delay(attempt) for attempt in range(len(RETRY_DELAYS) + 3)]
    assert delays == sorted(delays) and delays[-1] == delays[-4] == RETRY_DELAYS[-1]


def test_the_operator_retries_api_failures_sooner_than_bugs() -> None:
    assert requeue_delay(api_error(500)) == REQUEUE_AFTER_API_ERROR
    assert requeue_delay(ApiConnectionError("reset")) == REQUEUE_AFTER_API_ERROR
    assert requeue_delay(KeyError("x")) == REQUEUE_AFTER_ERROR > REQUEUE_AFTER_API_ERROR


def test_status_body_is_fenced_by_the_resource_version() -> None:
    body = status_body("ns", "r", "42", RunStatus(round=2).to_dict())
    assert body["metadata"] == {"name": "r", "namespace": "ns", "resourceVersion": "42"}
    assert body["kind"] == "ElasticRun" and body["status"]["round"] == 2


def test_announce_tests_both_counters_before_moving_them() -> None:
    ops = announce_patch(RunStatus(round=3, signal=7, join_notice=2))
    assert ops[:2] == [{"op": "test", "path": "/status/joinNotice", "value": 2},
                       {"op": "test", "path": "/status/signal", "value": 7}]
    assert ops[2:] == [{"op": "replace", "path": "/status/joinNotice", "value": 3},
                       {"op": "replace", "path": "/status/signal", "value": 8},
                       # the round is disturbed: its members' quiet watches wake
                       {"op": "add", "path": "/status/stableRound", "value": 0}]


def test_resource_versions_compare_as_numbers() -> None:
    assert newer("10", "9") and not newer("9", "10")
    assert newer("b", "a") and not newer("a", "a")  # opaque: any other write is newer
    meta = {"metadata": {"resourceVersion": "9"}}
    assert older(meta, {"metadata": {"resourceVersion": "10"}})
    assert not older(meta, {"metadata": {"resourceVersion": "x"}})
