"""The engine replicas of each trust class, as the router sees them.

A trust class's engine is a Service; its replicas are the endpoints of that Service's EndpointSlices
(:mod:`kvfence.router.slices`), or, without ``--endpoint-slices``, the one address of the Service's
name (kube-proxy then picks a replica per connection). Per endpoint the router keeps what the slice
says (ready or not), what its own probes and requests say (healthy or not), a connection pool and
the requests in flight. Only endpoints that are both ready and healthy *serve*: they alone are on the
class's consistent-hash ring (:mod:`kvfence.router.balance`), so a request never goes to a replica
that is starting, failing its readiness probe, terminating or unreachable.

Drain: an endpoint that leaves (gone from the slices, not ready, terminating) leaves the ring at once,
so no new request goes to it; requests already on it keep their connection and finish (its pool is
closed, which closes idle connections now and the busy ones when their answer ends).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvfence.router.balance import Ring, bound
from kvfence.router.upstream import Pool

PoolFactory = Callable[[str, int], Pool]


@dataclass(frozen=True, slots=True)
class Member:
    """One endpoint as a source lists it."""

    host: str  # an IP (from a slice) or a Service's DNS name
    port: int
    ready: bool = True


class Endpoint:
    """One engine replica (``host:port``) of one trust class."""

    __slots__ = (
        "_factory",
        "_pool",
        "failures",
        "healthy",
        "host",
        "inflight",
        "key",
        "labels",
        "last_error",
        "last_probe",
        "port",
        "ready",
    )

    def __init__(self, trust_class: str, host: str, port: int, factory: PoolFactory) -> None:
        self.host, self.port = host, port
        self.key = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.labels = (trust_class, self.key)  # metric labels, built once
        self._factory = factory
        self._pool: Pool | None = None
        self.ready = True  # what the source says
        self.healthy = True  # optimistic until a probe or a connection says otherwise
        self.failures = 0
        self.last_error = ""
        self.last_probe = -1e9  # never: probed at the next round
        self.inflight = 0

    @property
    def pool(self) -> Pool:
        p = self._pool
        if p is None:
            p = self._pool = self._factory(self.host, self.port)
        return p

    @property
    def serving(self) -> bool:
        return self.ready and self.healthy

    def close(self) -> None:
        """Stop using it: idle connections close now, busy ones when their answer ends."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class ClassEndpoints:
    """The endpoints of one trust class and the ring of those that serve."""

    __slots__ = (
        "_factory",
        "base",
        "hit_labels",
        "inflight",
        "members",
        "name",
        "policy",
        "ring",
        "serving",
        "spill_labels",
    )

    def __init__(self, name: str, base: str, factory: PoolFactory, policy: str = "affinity") -> None:
        self.name = name
        self.hit_labels, self.spill_labels = (name, "hit"), (name, "spill")  # metric labels, built once
        self.base = base  # the path prefix of the engine's URL ("" usually)
        self._factory = factory
        self.policy = policy
        self.members: dict[str, Endpoint] = {}
        self.serving: list[Endpoint] = []
        self.ring = Ring(())
        self.inflight = 0

    def set_members(self, members: Iterable[Member]) -> list[Endpoint]:
        """Replace the member list (a slice changed); returns the endpoints that left (closed here:
        in-flight requests on them finish, no new ones start)."""
        new: dict[str, Endpoint] = {}
        for m in members:
            ep = Endpoint(self.name, m.host, m.port, self._factory)
            ep = self.members.get(ep.key) or ep
            ep.ready = m.ready
            new[ep.key] = ep
        gone = [ep for key, ep in self.members.items() if key not in new]
        for ep in gone:
            ep.close()
            self.inflight -= ep.inflight  # they finish, but no longer count towards the load bound
        self.members = new
        self.refresh()
        return gone

    def refresh(self) -> None:
        """Rebuild the ring after a change of membership, readiness or health (never per request)."""
        serving = sorted((ep for ep in self.members.values() if ep.serving), key=lambda e: e.key)
        if [e.key for e in serving] != [e.key for e in self.serving]:
            self.ring = Ring([e.key for e in serving])
        self.serving = serving

    def pick(self, key: int, exclude: tuple[Endpoint, ...] = ()) -> tuple[Endpoint, bool] | None:
        """The endpoint for a request whose affinity key is ``key`` and whether it is the key's home
        (False: a spill to the next replica because the home is at its load bound, or a retry).
        ``exclude``: endpoints a retry must avoid. None when no endpoint serves."""
        serving = self.serving
        if not serving:
            return None
        if self.policy == "random":
            choices = [e for e in serving if e not in exclude] if exclude else serving
            return (random.choice(choices), False) if choices else None
        if len(serving) == 1 and not exclude:
            # One replica is every key's home and never at its bound (the bound exceeds the class's
            # in-flight count, which is all its own): what the walk below would return, without it.
            return serving[0], True
        cap = bound(self.inflight, len(serving))
        home = True
        for i in self.ring.order(key):
            ep = serving[i]
            if ep.inflight < cap and ep not in exclude:
                return ep, home
            home = False
        # More replicas than the ring precomputes, all of those at the bound: the least loaded one.
        rest = [e for e in serving if e not in exclude]
        return (min(rest, key=lambda e: e.inflight), False) if rest else None

    def begin(self, ep: Endpoint) -> None:
        """A request goes to ``ep`` (picked by :meth:`pick`)."""
        ep.inflight += 1
        self.inflight += 1

    def end(self, ep: Endpoint) -> None:
        """A request on ``ep`` ended (answered, failed, or abandoned)."""
        ep.inflight -= 1
        if self.members.get(ep.key) is ep:
            self.inflight -= 1

    def close(self) -> None:
        for ep in self.members.values():
            ep.close()
        self.members = {}
        self.serving = []
        self.ring = Ring(())
