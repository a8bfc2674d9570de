"""Spoofing through the router: a client cannot choose its cache namespace or identity, whatever it
sends (body fields, kvfence headers, tenant headers), and a bad key gets nowhere."""

from __future__ import annotations

import uuid

from e2esupport import Router, Tenant, cached_tokens

from kvfence.contract import Identity, cache_namespace, sign

FORGED_KEY = bytes(range(32))


def _warm(router: Router, victim: Tenant) -> str:
    prefix = f"{uuid.uuid4().hex} Confidential preamble of the victim tenant, long enough for blocks. "
    for q in ("a", "b"):
        r = router.complete(victim, prefix + q)
        assert r.status == 200, r.body
    return prefix


def test_client_cache_salt_and_kv_fields_are_ignored(router: Router, tenants: dict[str, Tenant]) -> None:
    acme, globex = tenants["acme"], tenants["globex"]
    for salt in ("", "acme", "tenant/gold/acme", "x" * 43):
        prefix = _warm(router, acme)  # a fresh victim prefix each time: globex never sent it
        r = router.complete(
            globex,
            prefix + "c",
            cache_salt=salt,
            extra_key="acme",
            kv_transfer_params={"do_remote_prefill": True},
        )
        assert r.status == 200, r.body
        assert cached_tokens(r) == 0, f"cache_salt={salt!r} let globex reach acme's prefix"


def test_forged_identity_headers_are_stripped(router: Router, tenants: dict[str, Tenant]) -> None:
    acme, globex = tenants["acme"], tenants["globex"]
    prefix = _warm(router, acme)
    body = {"model": globex.model, "prompt": prefix + "d", "max_tokens": 4, "temperature": 0}
    forged = sign(FORGED_KEY, Identity("acme", "gold", cache_namespace("gold", "acme", "Tenant")), "POST",
                  "/v1/completions", b"{}")  # fmt: skip
    headers = {
        **forged,
        "X-Tenant-ID": "acme",
        "X-Cache-Salt": "acme",
        "X-Forwarded-User": "acme",
        "X-Kvfence-Tenant": "acme",
    }
    r = router.request("POST", "/v1/completions", key=globex.api_key, body=body, headers=headers)
    assert r.status == 200, r.body
    assert cached_tokens(r) == 0, "forged headers let globex reach acme's prefix"


def test_unknown_or_missing_key_is_401(router: Router, tenants: dict[str, Tenant]) -> None:
    body = {"model": tenants["acme"].model, "prompt": "x", "max_tokens": 1}
    for key in (None, "sk-not-a-key", tenants["acme"].api_key + "x"):
        r = router.request("POST", "/v1/completions", key=key, body=body)
        assert r.status == 401, (key, r.body)
        assert r.json()["error"]["type"]


def test_another_tenants_key_cannot_be_combined_with_identity_headers(
    router: Router, tenants: dict[str, Tenant]
) -> None:
    # A tenant naming another tenant's model *and* identity is still itself: refused by the allowlist.
    initech, acme = tenants["initech"], tenants["acme"]
    r = router.request(
        "POST",
        "/v1/completions",
        key=initech.api_key,
        body={"model": acme.model, "prompt": "x", "max_tokens": 1},
        headers={"X-Tenant-ID": "acme", "X-Kvfence-Tenant": "acme", "X-Kvfence-Trust-Class": "gold"},
    )
    assert r.status == 403, r.body
