"""A kopf operator that serves only elasticrun's pod webhook: what test_webhook.py runs.

It is the production handler (``elasticrun.operator.webhook``), wired the way
the operator's entry point wires it, with the certificate the test fixture
made (kopf's own self-signed mode does not work with OpenSSL >= 3.0.10).

    WEBHOOK_PORT=... WEBHOOK_CERT=... WEBHOOK_KEY=... WEBHOOK_CA=... \
        kopf run --standalone -n NS tests/integration/webhook_operator.py
"""

from __future__ import annotations

import os
from typing import Any

import kopf

from elasticrun.operator import webhook


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.enabled = False
    settings.watching.server_timeout = 10
    webhook.configure_webhook(
        settings, addr="127.0.0.1", port=int(os.environ["WEBHOOK_PORT"]), host="127.0.0.1",
        certfile=os.environ["WEBHOOK_CERT"], pkeyfile=os.environ["WEBHOOK_KEY"],
        cafile=os.environ["WEBHOOK_CA"], managed=None)
