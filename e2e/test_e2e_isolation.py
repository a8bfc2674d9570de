"""Isolation through the router: each tenant sees its own class only, and its prefix cache is its own,
also under concurrent mixed traffic (the concurrency leak test)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from e2esupport import Response, Router, Tenant, cached_tokens


def test_models_lists_only_the_tenants_own_class(router: Router, tenants: dict[str, Tenant]) -> None:
    for t in tenants.values():
        r = router.request("GET", "/v1/models", key=t.api_key)
        assert r.status == 200, r.body
        assert [m["id"] for m in r.json()["data"]] == [t.model], t.id


def test_another_class_model_is_refused(router: Router, tenants: dict[str, Tenant]) -> None:
    acme, initech = tenants["acme"], tenants["initech"]
    r = router.request(
        "POST",
        "/v1/completions",
        key=acme.api_key,
        body={"model": initech.model, "prompt": "x", "max_tokens": 1},
    )
    assert r.status == 403, r.body
    assert r.json()["error"]["code"] == "model_not_allowed"


def test_each_tenant_is_answered_by_its_class(router: Router, tenants: dict[str, Tenant]) -> None:
    for t in tenants.values():
        r = router.complete(t, f"{uuid.uuid4().hex} hello")
        assert r.status == 200, (t.id, r.body)
        assert r.json()["model"] == t.model


def _prefix(run: str, k: int) -> str:
    # Long enough for several KV blocks (16 tokens each) of the reference engine's byte tokenizer. k
    # comes first: prefixes k and j differ in their first block, so a tenant's own requests on
    # different k share no cached block with each other.
    return (
        f"[{k}:{run}] You are a careful assistant. Policy section {k}: "
        "answer briefly, cite sources, never guess. "
    )


def test_prefix_cache_is_per_tenant(router: Router, tenants: dict[str, Tenant]) -> None:
    acme, globex = tenants["acme"], tenants["globex"]  # same class (gold), scope Tenant
    p = _prefix(uuid.uuid4().hex, 0)
    first = router.complete(acme, p + "Q1")
    assert first.status == 200, first.body
    again = router.complete(acme, p + "Q2")
    assert cached_tokens(again) > 0, "the prefix cache does not work for the tenant itself"
    other = router.complete(globex, p + "Q3")
    assert other.status == 200, other.body
    assert cached_tokens(other) == 0, "globex hit acme's cached prefix"


def test_concurrent_mixed_tenants_never_hit_each_others_prefixes(
    router: Router, tenants: dict[str, Tenant]
) -> None:
    """The concurrency leak test. acme warms N prefixes; then acme, globex and initech send requests
    on those prefixes all at once. globex (same engine as acme) and initech (another engine) send each
    prefix for the first time: any cached token would have come from acme. acme's must hit (the cache
    works under load). Finally every answer is compared with a repeat of the same request (the oracle:
    the same prompt gives the same answer, cached or cold)."""
    acme, globex, initech = tenants["acme"], tenants["globex"], tenants["initech"]
    run, n = uuid.uuid4().hex, 30  # 30 + 30 + 3 requests in flight at once
    for k in range(n):
        r = router.complete(acme, _prefix(run, k) + "warm-up")
        assert r.status == 200, r.body
    jobs: list[tuple[Tenant, str]] = []
    for k in range(n):
        jobs.append((acme, _prefix(run, k) + f"acme question {k}"))
        jobs.append((globex, _prefix(run, k) + f"globex question {k}"))
    # initech's quotas are tight on purpose (the quota test): a few requests only.
    jobs += [(initech, _prefix(run, k) + f"initech question {k}") for k in range(3)]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results: list[Response] = list(pool.map(lambda j: router.complete(j[0], j[1], max_tokens=8), jobs))
    for (t, prompt), r in zip(jobs, results, strict=True):
        assert r.status == 200, (t.id, r.status, r.body)
        if t.id == "acme":
            assert cached_tokens(r) > 0, f"acme missed its own warmed prefix: {prompt!r}"
        else:
            assert cached_tokens(r) == 0, f"{t.id} was served cached tokens of another tenant: {prompt!r}"
    # Oracle: determinism regardless of cache state and neighbours.
    for (t, prompt), r in list(zip(jobs, results, strict=True))[::5]:
        again = router.complete(t, prompt, max_tokens=8)
        assert again.status == 200
        assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"], (t.id, prompt)


def _house_style() -> str:
    """The shared prefix examples/10-trustclasses.yaml declares for gold (completion form)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "10-trustclasses.yaml"
    docs = yaml.safe_load_all(path.read_text())
    gold = next(d for d in docs if d and d["metadata"]["name"] == "gold")
    (decl,) = gold["spec"]["prefixCache"]["sharedPrefixes"]
    return str(decl["text"])


def test_declared_shared_prefix_is_a_hit_for_every_tenant_and_nothing_private_is_shared(
    router: Router, tenants: dict[str, Tenant]
) -> None:
    acme, globex = tenants["acme"], tenants["globex"]  # gold, scope Tenant, one declared prefix
    house = _house_style()
    shared = (1 + len(house.encode())) // 16 * 16  # BOS + bytes, the full blocks inside the prefix
    assert shared >= 64
    secret = house + f" [{uuid.uuid4().hex}] acme's private context: contract 77-A renews in May. "
    first = router.complete(acme, secret + "Q1")
    assert first.status == 200, first.body
    assert cached_tokens(first) == shared  # even acme's very first request: the declared part is pinned
    again = router.complete(acme, secret + "Q2")
    assert cached_tokens(again) > shared  # acme's own private blocks after it
    # globex sends acme's private text: only the declared part is a hit, exactly as for a prompt
    # nobody has sent (B's first request after A warmed a private prefix is as slow as cold)
    other = router.complete(globex, secret + "Q3")
    cold = router.complete(globex, house + f" [{uuid.uuid4().hex}] a context nobody has sent before. Q4")
    assert cached_tokens(other) == cached_tokens(cold) == shared
    # one token changed inside the declared prefix: nothing is shared
    changed = router.complete(globex, house.replace("careful", "Careful", 1) + f" [{uuid.uuid4().hex}] Q5")
    assert changed.status == 200 and cached_tokens(changed) == 0
