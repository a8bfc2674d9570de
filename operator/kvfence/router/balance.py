"""Choosing an engine replica for a tenant: consistent hashing with bounded load.

Each engine replica has its own prefix cache, and kvfence scopes caches by the tenant's cache namespace
(:func:`kvfence.contract.cache_namespace`). So the router keys replica choice by that namespace: every
request of a tenant goes to the same replica (its *home*), whose cache it keeps warm, as long as that
replica is not overloaded. Load is bounded as in Mirrokni, Thorup and Zadimoghaddam, *Consistent
Hashing with Bounded Loads* (2018; what HAProxy's ``hash-balance-factor`` and Envoy's ring hash with
``hash_balance_factor`` do): a replica may hold at most ``ceil(factor * (in_flight + 1) / replicas)``
requests; a request whose home is at that bound goes to the next replica clockwise on the ring (a
*spill*), so one tenant's burst spreads over the others instead of queueing behind a hot one.

Everything here is pure and built off the hot path (when the set of serving replicas changes): a
:class:`Ring` precomputes, for each point on the ring, the order in which the replicas are tried, so
a request costs one bisection and a short loop over a tuple.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

#: Points per replica on the ring: with 3 replicas the largest share of the ring stays within about
#: 10% of a third.
VNODES = 160
#: Replicas precomputed per ring point (the rest of a key's order is only needed when all of these are
#: at their bound; the caller then takes the least loaded replica).
MAX_ORDER = 8
#: Bound on a replica's load relative to the average (the paper's 1 + epsilon). 1.25: no replica
#: holds more than a quarter above the average, while most requests still find their home.
LOAD_FACTOR = 1.25


def hash64(data: str) -> int:
    """A stable 64-bit hash (the same in every router replica and across restarts, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8"), digest_size=8).digest(), "big")


class Ring:
    """A consistent-hash ring over ``members`` (stable names, e.g. ``ip:port``)."""

    __slots__ = ("members", "points", "prefs")

    def __init__(self, members: Sequence[str], vnodes: int = VNODES) -> None:
        self.members = tuple(members)
        pairs = sorted((hash64(f"{m}#{v}"), i) for i, m in enumerate(self.members) for v in range(vnodes))
        self.points = [p for p, _ in pairs]
        owners = [i for _, i in pairs]
        n = min(len(self.members), MAX_ORDER)
        # For each point, the distinct members in clockwise order from it: the order of preference of
        # a key that lands just before that point.
        self.prefs: list[tuple[int, ...]] = []
        if n:
            size = len(owners)
            for start in range(size):
                seen: list[int] = []
                k = start
                while len(seen) < n:
                    o = owners[k]
                    if o not in seen:
                        seen.append(o)
                    k = (k + 1) % size
                self.prefs.append(tuple(seen))

    def __len__(self) -> int:
        return len(self.members)

    def order(self, key: int) -> tuple[int, ...]:
        """Indices of the members in the order a request with this key tries them (home first)."""
        if not self.prefs:
            return ()
        i = bisect.bisect_left(self.points, key)
        return self.prefs[i if i < len(self.prefs) else 0]


def bound(total_in_flight: int, replicas: int, factor: float = LOAD_FACTOR) -> int:
    """The most requests one replica may hold when one more request arrives."""
    return max(1, math.ceil(factor * (total_in_flight + 1) / replicas))
