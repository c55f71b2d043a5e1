"""The self-signed webhook's CA, shared by every operator replica through one Secret."""

from __future__ import annotations

import base64
import datetime as dt
from pathlib import Path
from typing import Any, cast

import pytest
from cryptography import x509

from elasticrun.api.kube import ApiError, KubeClient
from elasticrun.operator import webhookcert
from elasticrun.operator.webhookcert import ca_secret, make_ca, read_ca, shared_ca


class Secrets:
    """One namespace's Secrets with create-once and resourceVersion compare-and-set."""

    def __init__(self) -> None:
        self.stored: dict[str, Any] | None = None
        self.calls: list[str] = []
        self.version = 0
        #: Stored by "another replica" between our GET and our POST.
        self.race: dict[str, Any] | None = None

    def request(self, method: str, path: str, *, body: Any = None, **_: Any) -> dict[str, Any]:
        self.calls.append(method)
        if method == "GET":
            if self.stored is None:
                raise ApiError(404, "NotFound", "not found", {})
            return self.stored
        if self.race is not None:
            self.stored, self.race = self.race, None
        if method == "POST" and self.stored is not None:
            raise ApiError(409, "AlreadyExists", "exists", {})
        if method == "PUT" and (self.stored or {}).get("metadata", {}).get(
                "resourceVersion") != body["metadata"].get("resourceVersion"):
            raise ApiError(409, "Conflict", "modified", {})
        self.version += 1
        self.stored = {**body, "metadata": {**body["metadata"],
                                            "resourceVersion": str(self.version)}}
        return self.stored


def client(api: Secrets) -> KubeClient:
    return cast(KubeClient, api)


def pem(ca: webhookcert.SigningCA) -> bytes:
    return ca.cert.public_bytes(webhookcert.serialization.Encoding.PEM)


def test_the_first_replica_stores_a_ca_and_the_second_signs_with_the_same(
        tmp_path: Path) -> None:
    api = Secrets()
    first = shared_ca(client(api), "ops", "er-webhook-ca")
    assert api.calls == ["GET", "POST"]
    second = shared_ca(client(api), "ops", "er-webhook-ca")
    assert api.calls[2:] == ["GET"] and pem(second) == pem(first)
    certs = [webhookcert.generate_serving_cert(tmp_path / str(i), ["er.ops.svc"], ca=ca)
             for i, ca in enumerate((first, second))]
    assert certs[0].ca_pem == certs[1].ca_pem == pem(first)
    for cert in certs:
        serving = x509.load_pem_x509_certificate(cert.certfile.read_bytes())
        serving.verify_directly_issued_by(first.cert)
        assert serving.not_valid_after_utc <= first.cert.not_valid_after_utc


def test_a_replica_that_loses_the_race_to_create_uses_the_winners_ca() -> None:
    api = Secrets()
    winner = make_ca()
    api.race = ca_secret("ops", "ca", winner)
    got = shared_ca(client(api), "ops", "ca")
    assert api.calls == ["GET", "POST", "GET"] and pem(got) == pem(winner)


@pytest.mark.parametrize("data", [
    None, "x", {}, {"ca.crt": "not base64!", "ca.key": "x"},
    {"ca.crt": base64.b64encode(b"-----BEGIN CERTIFICATE-----\nAAAA\n").decode(), "ca.key": ""},
])
def test_an_unusable_secret_is_replaced_on_its_resource_version(data: Any) -> None:
    api = Secrets()
    api.stored = {"metadata": {"name": "ca", "resourceVersion": "7"}, "data": data}
    api.version = 7
    got = shared_ca(client(api), "ops", "ca")
    assert api.calls == ["GET", "PUT"]
    assert read_ca(api.stored) is not None and pem(read_ca(api.stored)) == pem(got)  # type: ignore[arg-type]


def test_a_ca_whose_key_is_another_or_that_is_about_to_expire_is_not_used() -> None:
    one, other = make_ca(), make_ca()
    mixed = ca_secret("ops", "ca", one)
    mixed["data"]["ca.key"] = ca_secret("ops", "ca", other)["data"]["ca.key"]
    assert read_ca(mixed) is None
    assert read_ca(ca_secret("ops", "ca", one)) is not None
    late = one.cert.not_valid_after_utc - webhookcert.RENEW_BEFORE + dt.timedelta(seconds=1)
    assert read_ca(ca_secret("ops", "ca", one), at=late) is None


def test_a_secret_that_keeps_changing_is_an_error_after_bounded_attempts() -> None:
    class Churn(Secrets):
        def request(self, method: str, path: str, *, body: Any = None,
                    **kw: Any) -> dict[str, Any]:
            if method == "GET":
                self.calls.append(method)
                return {"metadata": {"resourceVersion": str(len(self.calls))}, "data": {}}
            self.calls.append(method)
            raise ApiError(409, "Conflict", "modified", {})

    api = Churn()
    with pytest.raises(RuntimeError, match="after 3 attempts"):
        shared_ca(client(api), "ops", "ca")
    assert api.calls == ["GET", "PUT"] * 3
