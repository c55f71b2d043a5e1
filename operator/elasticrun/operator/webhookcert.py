"""The webhook's serving certificate when no cert-manager is installed.

The chart's default: at every start the operator makes a throw-away CA, signs
a serving certificate for its Service's DNS names with it, forgets the CA key,
and writes the CA into its own MutatingWebhookConfiguration's ``caBundle``.
Nothing secret is ever stored in the cluster (no Secret, so the operator needs
no Secret access at all), and a restart is a full rotation.  The one permission
this needs is ``get``/``patch`` on that single, named configuration.

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


def generate_serving_cert(directory: Path, names: Sequence[str],
                          now: dt.datetime | None = None) -> ServingCert:
    """Write ``tls.crt``, ``tls.key`` and ``ca.crt`` for ``names`` (DNS names or IPs)."""
    if not names:
        raise ValueError("a serving certificate needs at least one DNS name or IP address")
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
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0])).issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(start + VALIDITY)
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
