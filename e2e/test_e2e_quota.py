"""Per-tenant quotas through the router: initech (examples/20-tenants.yaml) may send a few requests per
minute; past that it gets 429 with Retry-After, and its neighbours do not notice."""

from __future__ import annotations

import uuid

from e2esupport import Router, Tenant


def test_requests_per_minute_quota(router: Router, tenants: dict[str, Tenant]) -> None:
    initech, acme = tenants["initech"], tenants["acme"]
    assert initech.requests_per_minute is not None
    # Each router replica enforces its share (limit // replicas, at least 1).
    allowed = max(1, initech.requests_per_minute // router.quota_divisor)
    statuses = []
    rejected = None
    for i in range(allowed + 1):
        r = router.complete(initech, f"{uuid.uuid4().hex} request {i}", max_tokens=1)
        statuses.append(r.status)
        if r.status == 429:
            rejected = r
            break
        assert r.status == 200, r.body
    # Other tests may have spent part of this minute's budget: the 429 comes at the latest here.
    assert rejected is not None, f"no 429 after {allowed + 1} requests (limit {allowed}): {statuses}"
    assert statuses.count(200) <= allowed
    assert int(rejected.headers["retry-after"]) >= 1
    err = rejected.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    # The neighbour is unaffected.
    ok = router.complete(acme, f"{uuid.uuid4().hex} neighbour", max_tokens=1)
    assert ok.status == 200, ok.body
