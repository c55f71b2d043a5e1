"""The webhook's serving certificate when no cert-manager is installed.

The chart's default.  Every replica serves the webhook, so every replica's
serving certificate must chain to the one CA in the MutatingWebhookConfiguration's
``caBundle``: the CA is kept in one Secret of the operator's namespace
(``--webhook-ca-secret``, :func:`shared_ca`).  The first replica to start makes
it (POST; a replica that loses that race reads the winner's), every replica
signs its own serving certificate for the Service's DNS names with it, and
writes the CA into the configuration, which stays the same whoever writes it.
The operator needs ``get``/``update`` on that Secret and ``create`` on Secrets
of its namespace, and ``get``/``patch`` on that single, named configuration.
Rotation: delete the Secret and restart the Deployment.

Without ``--webhook-ca-secret`` (one replica, outside the chart) the CA is made
in memory at every start and its key forgotten: nothing is stored, and a
restart is a full rotation.

kopf can self-sign too, but its generator needs oscrypto, which fails to load
libcrypto from OpenSSL >= 3.0.10; ``cryptography`` has no such problem.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ipaddress
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from elasticrun.api.kube import JSON_PATCH, ApiConnectionError, ApiError, KubeClient

log = logging.getLogger(__name__)

WEBHOOK_CONFIGURATIONS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
#: The CA key is discarded at once, so a long life costs little; a restart renews anyway.
VALIDITY = dt.timedelta(days=5 * 365)


#: A stored CA closer than this to its end is replaced.
RENEW_BEFORE = dt.timedelta(days=30)
CA_CERT_KEY, CA_KEY_KEY = "ca.crt", "ca.key"


@dataclass(frozen=True)
class SigningCA:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class ServingCert:
    certfile: Path
    pkeyfile: Path
    cafile: Path
    ca_pem: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def make_ca(now: dt.datetime | None = None) -> SigningCA:
    """A new CA for the webhook's serving certificates."""
    start = (now or dt.datetime.now(dt.UTC)) - dt.timedelta(minutes=5)  # clock skew
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("elasticrun-webhook-ca")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(start + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return SigningCA(ca_cert, ca_key)


def generate_serving_cert(directory: Path, names: Sequence[str],
                          now: dt.datetime | None = None,
                          ca: SigningCA | None = None) -> ServingCert:
    """Write ``tls.crt``, ``tls.key`` and ``ca.crt`` for ``names`` (DNS names or IPs),
    signed by ``ca`` (default: a new one whose key is forgotten)."""
    if not names:
        raise ValueError("a serving certificate needs at least one DNS name or IP address")
    start = (now or dt.datetime.now(dt.UTC)) - dt.timedelta(minutes=5)  # clock skew
    signing = ca or make_ca(now)
    ca_cert, ca_key, ca_name = signing.cert, signing.key, signing.cert.subject
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0])).issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(min(start + VALIDITY, ca_cert.not_valid_after_utc))
        .add_extension(_san(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    paths = ServingCert(directory / "tls.crt", directory / "tls.key", directory / "ca.crt", ca_pem)
    paths.cafile.write_bytes(ca_pem)
    paths.certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(paths.pkeyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    return paths


def read_ca(body: Any, at: dt.datetime | None = None) -> SigningCA | None:
    """The CA kept in the Secret ``body``; None when it is missing, unreadable, not a CA,
    not its key's, or within :data:`RENEW_BEFORE` of its end (then it is replaced)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, dict):
        return None
    try:
        cert = x509.load_pem_x509_certificate(base64.b64decode(str(data.get(CA_CERT_KEY))))
        key = serialization.load_pem_private_key(base64.b64decode(str(data.get(CA_KEY_KEY))),
                                                 password=None)
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except (ValueError, TypeError, x509.ExtensionNotFound):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not constraints.ca \
            or key.public_key() != cert.public_key():
        return None
    if cert.not_valid_after_utc - RENEW_BEFORE <= (at or dt.datetime.now(dt.UTC)):
        return None
    return SigningCA(cert, key)


def ca_secret(namespace: str, name: str, ca: SigningCA) -> dict[str, Any]:
    key_pem = ca.key.private_bytes(serialization.Encoding.PEM,
                                   serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption())
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "elasticrun-operator"}},
            "data": {CA_CERT_KEY: base64.b64encode(
                         ca.cert.public_bytes(serialization.Encoding.PEM)).decode(),
                     CA_KEY_KEY: base64.b64encode(key_pem).decode()}}


def shared_ca(client: KubeClient, namespace: str, name: str, attempts: int = 3) -> SigningCA:
    """The CA every replica signs with: read from the Secret, or made and stored there.

    Two replicas starting together both find no Secret; one POST wins and the
    other gets 409 and reads the winner's.  An unusable Secret is replaced
    (PUT on the resourceVersion read), so one that was tampered with or is
    close to expiry costs one restart of the other replicas, not a broken
    webhook.
    """
    path = f"/api/v1/namespaces/{namespace}/secrets/{name}"
    for _ in range(attempts):
        try:
            body: dict[str, Any] | None = client.request("GET", path)
        except ApiError as exc:
            if not exc.not_found:
                raise
            body = None
        ca = read_ca(body) if body is not None else None
        if ca is not None:
            return ca
        made = make_ca()
        secret = ca_secret(namespace, name, made)
        try:
            if body is None:
                client.request("POST", f"/api/v1/namespaces/{namespace}/secrets", body=secret)
            else:
                secret["metadata"]["resourceVersion"] = (body.get("metadata") or {}).get(
                    "resourceVersion")
                client.request("PUT", path, body=secret)
                log.warning("replaced the unusable webhook CA in Secret %s/%s", namespace, name)
        except ApiError as exc:
            if exc.conflict:
                continue  # another replica stored its CA first: use that one
            raise
        return made
    raise RuntimeError(f"could not read or store the webhook CA in Secret {namespace}/{name} "
                       f"after {attempts} attempts (another writer keeps changing it?)")


def ca_bundle_patch(configuration: dict[str, Any], ca_b64: str) -> list[dict[str, Any]]:
    """JSON patch that sets every webhook's caBundle; guarded by each webhook's name.

    The ``test`` ops make the patch fail instead of writing the wrong entry if
    someone reorders the webhooks between our read and our write.
    """
    ops: list[dict[str, Any]] = []
    for index, hook in enumerate(configuration.get("webhooks") or []):
        if (hook.get("clientConfig") or {}).get("caBundle") == ca_b64:
            continue
        ops.append({"op": "test", "path": f"/webhooks/{index}/name", "value": hook["name"]})
        ops.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle",
                    "value": ca_b64})
    return ops


def inject_ca_bundle(client: KubeClient, configuration: str, ca_pem: bytes) -> int:
    """Point the named MutatingWebhookConfiguration at ``ca_pem``; returns webhooks changed."""
    path = f"{WEBHOOK_CONFIGURATIONS}/{configuration}"
    current = client.request("GET", path)
    ops = ca_bundle_patch(current, base64.b64encode(ca_pem).decode("ascii"))
    if ops:
        client.request("PATCH", path, body=ops, content_type=JSON_PATCH)
    return len(ops) // 2


async def keep_ca_bundle(client: KubeClient, configuration: str, ca_pem: bytes,
                         interval: float) -> None:
    """Re-check the configuration's caBundle every ``interval`` seconds and repair it.

    The caBundle is written at start; an apply of the chart's configuration
    (``helm upgrade --force``, a GitOps sync) blanks it, and admission would
    fail until the next restart.  One GET per interval; a PATCH only when it
    differs.  Runs until cancelled.
    """
    while True:
        await asyncio.sleep(interval)
        try:
            changed = await asyncio.to_thread(inject_ca_bundle, client, configuration, ca_pem)
        except (ApiError, ApiConnectionError) as exc:
            log.warning("checking the caBundle of %s failed: %s", configuration, exc)
            continue
        if changed:
            log.warning("repaired the caBundle of %d webhook(s) in %s", changed, configuration)
