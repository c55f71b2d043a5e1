"""The suite's timings in one place: what test nodes run with, and the windows of the
checks that something does *not* happen (``conftest.consistently``).

A "nothing happens" window proves something only when it outlasts the timer it
checks, so each window here is written as the timer plus a margin, never as a
bare number of seconds.  Tests that check "nobody is removed" shorten the
heartbeat (``SHORT_HEARTBEAT``) rather than wait past the default one.
"""

from __future__ import annotations

#: Test nodes' settings unless a test says otherwise (``conftest.TEST_NODE_CONF``): short,
#: so tests stay quick.  ``HEARTBEAT`` is the run's heartbeatTimeoutSeconds.
JOIN_TIMEOUT = 60
LAST_CALL = 1
HEARTBEAT = 15
LEASE_INTERVAL = 5
API_TIMEOUT = 20
CLOSE_TIMEOUT = 10

#: A heartbeat short enough that a window outlasting it stays short, and a renewal
#: interval that still renews three times within it (a loaded 2-core machine delays
#: a renewal by a second at times; two missed renewals are not a loss).
SHORT_HEARTBEAT = 3
SHORT_RENEW = 1

#: What a window adds to the timer it checks: the operator's reconcile after the timer
#: fires, its status write, and the test's read of it, on a machine shared with other
#: test sessions.
MARGIN = 2.0

#: A "nothing happens" window for a change the operator reacts to at once (an event it
#: watches: a spec change, a Pod, a Lease): a few reconciles' worth.
RECONCILES = 2.0


def outlasting(timer: float) -> float:
    """A window that a wrong action driven by ``timer`` (seconds) cannot fit in unseen."""
    return timer + MARGIN
