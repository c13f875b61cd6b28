"""Routed experts of the engine's requests (``return_routed_experts``): which forward's routing each
token keeps."""

from __future__ import annotations

from typing import Optional

import numpy as np


def keep_route(choice, routed: Optional[np.ndarray], row: int) -> None:
    """Row ``row`` of a forward's routing ((rows, moe_layers, top_k), or None) appended to
    ``choice.routes`` when its request asked: the routing of the position that chose its latest token."""
    if routed is not None and choice.request.params.return_routed_experts:
        choice.routes.append(routed[row])


def routed_experts(choice) -> Optional[np.ndarray]:
    """(T, moe_layers, top_k) int64: a finished choice's routing, token by token (None if not asked);
    token t's is that of the forward which chose it (its prompt's last position for t = 0)."""
    if not choice.request.params.return_routed_experts:
        return None
    routes = choice.routes
    return np.stack(routes) if routes else np.zeros((0, 0, 0), dtype=np.int64)


__all__ = ["keep_route", "routed_experts"]
