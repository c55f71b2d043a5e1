"""A kopf operator that serves only elasticrun's pod webhook: what test_webhook.py runs.

It is the production handler (``elasticrun.operator.webhook``), set up through
the same flags and call the operator's entry point uses
(``add_webhook_arguments`` + ``setup_webhook``), given in ``WEBHOOK_ARGS``:
either the test CA's certificate (kopf's own self-signed mode does not work
with OpenSSL >= 3.0.10) or ``--webhook-self-signed``, the chart's default.

    WEBHOOK_ARGS="--webhook-port 9443 --webhook-cert ..." \
        kopf run --standalone -n NS tests/integration/webhook_operator.py
"""

from __future__ import annotations

import argparse
import os
import shlex
from typing import Any

import kopf

from elasticrun.operator import webhook


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.enabled = False
    settings.watching.server_timeout = 10
    parser = argparse.ArgumentParser()
    webhook.add_webhook_arguments(parser)
    webhook.setup_webhook(settings, parser.parse_args(shlex.split(os.environ["WEBHOOK_ARGS"])),
                          memo)
