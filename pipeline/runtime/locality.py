"""Where work that touches the driver's disk may run: the pin-to-driver rule, shared by ingest, the sink, pending
and finalize. Pure: it reads the node list it is given (`ray.nodes()` entries), never Ray itself."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def must_pin_to_driver(local: bool, nodes: Sequence[Mapping[str, Any]], driver: str) -> bool:
    """Whether work that reads or writes a path on the driver's disk (`local`) must run on the driver's node
    (`driver`, a Ray node id): only when a live node of the cluster (`ray.nodes()` entries) is on another host, which
    cannot reach that disk. Nodes on the driver's host can (a multi-node cluster of one machine, as in tests)."""
    if not local:
        return False
    alive = [n for n in nodes if n.get("Alive", True)]
    here = next((n["NodeManagerAddress"] for n in alive if n["NodeID"] == driver), None)
    return any(n["NodeManagerAddress"] != here for n in alive)
