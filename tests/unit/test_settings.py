"""torchrun's command line as the k8s backend reads it (elasticrun.handler.settings)."""

from __future__ import annotations

from typing import Any

import pytest

from elasticrun.handler.settings import SettingsError, from_parameters, parse_endpoint


@pytest.fixture(autouse=True)
def pod_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "team")
    monkeypatch.setenv("POD_NAME", "trainer-3")
    monkeypatch.setenv("POD_IP", "10.1.2.3")


def settings(conf: dict[str, Any] | None = None, endpoint: str = "", run_id: str = "run",
             nnodes: tuple[int, int] = (2, 4)) -> Any:
    return from_parameters(run_id=run_id, endpoint=endpoint, min_nodes=nnodes[0],
                           max_nodes=nnodes[1], local_addr=None, conf=conf or {})


@pytest.mark.parametrize(("endpoint", "expected"), [
    ("", (None, None, None)),
    ("team", (None, "team", None)),
    ("team/run-a", (None, "team", "run-a")),
    ("https://10.0.0.1:6443/", ("https://10.0.0.1:6443", None, None)),
])
def test_endpoint_forms(endpoint: str, expected: tuple[str | None, ...]) -> None:
    assert parse_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint", ["a/b/c", "/run", "host:port", "ns:1/run", "host:"])
def test_bad_endpoints_say_what_to_write(endpoint: str) -> None:
    with pytest.raises(SettingsError, match="rdzv-endpoint"):
        parse_endpoint(endpoint)


@pytest.mark.parametrize("endpoint", ["host:29400", "llama-worker-0:23456",
                                      "svc.team.svc.cluster.local:29500", "10.0.0.7:29400",
                                      "[fd00::7]:29400"])
def test_a_store_host_port_is_ignored_and_logged_once(
        endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    """PyTorchJob v1 injects PET_RDZV_ENDPOINT=<job>-worker-0:<port> for every backend."""
    with caplog.at_level("INFO", logger="elasticrun.handler.settings"):
        assert parse_endpoint(endpoint) == (None, None, None)
        s = settings(endpoint=endpoint, run_id="llama")
    assert (s.namespace, s.run_name, s.api_server) == ("team", "llama", None)
    ignored = [r for r in caplog.records if "ignoring --rdzv-endpoint" in r.getMessage()]
    assert len(ignored) == 1 and endpoint in ignored[0].getMessage()


def test_pod_environment_gives_namespace_node_and_address() -> None:
    s = settings()
    assert (s.namespace, s.node_name, s.pod, s.address) == ("team", "trainer-3", "trainer-3",
                                                            "10.1.2.3")
    assert (s.requested_spec.min_nodes, s.requested_spec.max_nodes) == (2, 4)


def test_endpoint_names_namespace_and_run() -> None:
    s = settings(endpoint="other/named", run_id="none")
    assert (s.namespace, s.run_name) == ("other", "named")


def test_conf_strings_are_parsed_and_named() -> None:
    s = settings({"join_timeout": "120", "last_call_timeout": "0", "keep_alive_interval": "2",
                  "keep_alive_max_attempt": "4", "create_run": "no", "store_port": "29400",
                  "api_timeout": "7", "node_name": "custom", "timeout": "900"})
    spec = s.requested_spec
    assert (spec.join_timeout, spec.last_call_timeout) == (120, 0)
    assert (spec.lease_renew_interval, spec.heartbeat_timeout) == (2, 8)
    assert s.create_run is False and s.store_port == 29400 and s.api_timeout == 7.0
    assert s.node_name == "custom"


@pytest.mark.parametrize(("conf", "message"), [
    ({"join_timeout": "soon"}, "join_timeout='soon': expected a whole number"),
    ({"join_timeout": "-1"}, "must not be negative"),
    ({"create_run": "maybe"}, "expected true or false"),
    ({"lease_interval": "20", "heartbeat_timeout": "10"}, "must be shorter"),
    ({"node_name": "x" * 254}, "1-253 characters"),
    ({"namespace": "Bad_NS"}, "not a valid Kubernetes namespace"),
])
def test_bad_conf_values_raise_a_clear_error(conf: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        settings(conf)


@pytest.mark.parametrize("run_id", ["", "none", "Upper", "under_score", "a" * 254, "-lead"])
def test_run_ids_that_cannot_name_an_elasticrun(run_id: str) -> None:
    with pytest.raises(SettingsError, match="not a valid ElasticRun name"):
        settings(run_id=run_id)


def test_longest_allowed_run_name_is_accepted() -> None:
    name = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
    assert len(name) == 253
    assert settings(run_id=name).run_name == name
