"""The torchrun rendezvous backend ``k8s``.

``pip install elasticrun`` registers it through the ``torchrun.handlers`` entry
point; then ``torchrun --nnodes=2:4 --rdzv-backend=k8s --rdzv-id=RUN train.py``
is all a user writes.

torch imports its entry points while ``torch.distributed.elastic.rendezvous``
itself is still being imported, so nothing here may import torch at module
level: the handler module is loaded on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

    from elasticrun.handler.handler import K8sRendezvousHandler, create_handler

__all__ = ["K8sRendezvousHandler", "create_handler", "get_rendezvous_handler_creator"]


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from elasticrun.handler.handler import create_handler  # noqa: PLC0415

    return create_handler(params)


def get_rendezvous_handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point: torch calls this with no arguments and registers what it returns."""
    return _create


def __getattr__(name: str) -> Any:
    if name in ("K8sRendezvousHandler", "create_handler"):
        from elasticrun.handler import handler  # noqa: PLC0415

        return getattr(handler, name)
    raise AttributeError(name)
