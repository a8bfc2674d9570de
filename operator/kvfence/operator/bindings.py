"""Pure decisions about TenantBindings, and the routing table rendered from them.

:func:`decide` looks at every binding at once (a tenant id must be unique in the cluster, an API key
must identify one tenant) and says, per binding, whether it is ``Bound`` or ``Denied`` and why. Only
``Bound`` bindings ever reach :func:`routing_table`; a denied one cannot route, by construction.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfence.api import conditions
from kvfence.api.common import TenantQuotas
from kvfence.api.tenantbinding import TenantBinding, TenantBindingSpec
from kvfence.api.trustclass import TrustClass
from kvfence.contract.routing import (
    ROUTING_SECRET_KEY,
    ROUTING_SECRET_NAME,
    Quotas,
    RoutingTable,
    TenantRoute,
    TrustClassRoute,
    encode_table,
)
from kvfence.operator.builders import FIELD_MANAGER, LABEL_MANAGED_BY, OperatorOptions, endpoint

REASON_DUPLICATE_API_KEY = conditions.REASON_DUPLICATE_API_KEY
REASON_KV_OVERCOMMITTED = conditions.REASON_KV_OVERCOMMITTED
REASON_CLAMPED = conditions.REASON_CLAMPED
#: suffix of the pseudo binding key under which the Secret of a last accepted spec is read and watched
ACCEPTED_SUFFIX = "#accepted"


def api_keys_from_secret(secret: Mapping[str, Any], key: str | None) -> list[str]:
    """API keys in a Secret: one per line of ``data[key]``, or every data value when ``key`` is None."""
    data: Mapping[str, str] = secret.get("data") or {}
    values = (
        [data[key]] if key is not None and key in data else ([] if key is not None else list(data.values()))
    )
    keys: list[str] = []
    for v in values:
        text = base64.b64decode(v).decode("utf-8", errors="strict")
        keys += [line.strip() for line in text.splitlines() if line.strip()]
    return keys


@dataclass(frozen=True, slots=True)
class KeyLookup:
    """What reading a binding's API-key Secret gave: hashes, or the reason it gave none."""

    hashes: tuple[str, ...] = ()
    error: str | None = None  # a conditions.REASON_* when the Secret could not be used
    message: str = ""


@dataclass(frozen=True, slots=True)
class ClassState:
    """A trust class as the routing decision needs it."""

    tc: TrustClass
    signing_keys: tuple[bytes, ...] = ()  # current first; empty while the class is being set up
    deleting: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    bound: bool
    denied: bool
    reason: str
    message: str
    trust_class: str | None = None
    api_keys: int | None = None
    quotas: TenantQuotas | None = None
    #: the spec the tenant is served with (the binding's own, or its last accepted one)
    served_spec: TenantBindingSpec | None = None
    #: why the binding's current spec was not accepted, when the tenant is served with its last
    #: accepted spec instead (None: the current spec is the one served)
    refused: Decision | None = None
    #: what serving ``served_spec`` within its class's current bounds took from it, one phrase each
    #: (empty: served as specified). Only a spec accepted before is clamped: the class was edited since.
    clamped: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Admit:
    """A spec that passed every check (nothing claimed yet)."""

    spec: TenantBindingSpec
    cls: ClassState
    effective: TenantQuotas
    hashes: tuple[str, ...]
    #: the adapters it is served with (``spec.allowedAdapters`` less those the class no longer serves)
    adapters: tuple[str, ...]
    clamped: tuple[str, ...]


def accepted_key(binding: str) -> str:
    """Key of the API-key lookup of a binding's last accepted spec, when it names another Secret."""
    return binding + ACCEPTED_SUFFIX


@dataclass
class Outcome:
    decisions: dict[str, Decision] = field(default_factory=dict)  # binding "ns/name" -> decision
    table: RoutingTable = field(default_factory=RoutingTable)
    #: trust class -> tenant -> effective quotas (for the engine config's per-tenant KV limits and weight)
    tenant_quotas: dict[str, dict[str, TenantQuotas]] = field(default_factory=dict)


def _sort_key(b: TenantBinding) -> tuple[bool, str, str]:
    """Bindings served before (a spec accepted) come first, then the oldest: an established tenant
    keeps its tenant id, API keys and guaranteed blocks ahead of any binding never admitted, even an
    older one (say, one whose Secret appeared only now)."""
    return (b.status.accepted_spec is None, str(b.metadata.get("creationTimestamp", "")), b.key)


def _deny(reason: str, message: str, tc: str | None = None) -> Decision:
    return Decision(bound=False, denied=True, reason=reason, message=message, trust_class=tc)


def _other(binding: str, namespace: str) -> str:
    """An older binding as a denial message may name it: by name in the denied binding's own namespace,
    not at all in another one (a tenant learns nothing about other tenants' namespaces)."""
    ns, _, name = binding.partition("/")
    return f"TenantBinding {name!r} of this namespace" if ns == namespace else "an older TenantBinding"


def _capped(quotas: TenantQuotas, limits: TenantQuotas) -> tuple[TenantQuotas, list[str]]:
    """``quotas`` with every field set above the same field of ``limits`` lowered to that limit, and
    what was lowered (``"wireName asked -> served"``)."""
    update: dict[str, int] = {}
    said: list[str] = []
    for name, info in TenantQuotas.model_fields.items():
        mine, lim = getattr(quotas, name), getattr(limits, name)
        if mine is not None and lim is not None and mine > lim:
            update[name] = lim
            said.append(f"{info.alias or name} {mine} -> {lim}")
    return quotas.model_copy(update=update), said


def _quota_values(q: TenantQuotas) -> tuple[int | None, ...]:
    return tuple(getattr(q, name) for name in TenantQuotas.model_fields)


def _route_quotas(effective: TenantQuotas, made: dict[tuple[int | None, ...], Quotas]) -> Quotas:
    """The routing table's quotas of a tenant served with ``effective`` (one frozen object per value);
    a weight of 1 is left out, the router's default."""
    values = (
        effective.max_concurrent_requests,
        effective.requests_per_minute,
        effective.tokens_per_minute,
        effective.max_kv_blocks,
        None if effective.weight is None or effective.weight == 1 else effective.weight,
    )
    got = made.get(values)
    if got is None:
        got = made[values] = Quotas(
            max_concurrent_requests=values[0],
            requests_per_minute=values[1],
            tokens_per_minute=values[2],
            max_kv_blocks=values[3],
            weight=values[4],
        )
    return got


def decide(
    classes: Mapping[str, ClassState],
    bindings: Iterable[TenantBinding],
    namespace_labels: Mapping[str, Mapping[str, str]],
    keys: Mapping[str, KeyLookup],
    opts: OperatorOptions,
) -> Outcome:
    """Every binding's fate and the routing table. Bindings served before, then the oldest, win a
    contested tenant id, API key or guarantee (:func:`_sort_key`), so an established tenant is never
    displaced by a newcomer."""
    out = Outcome()
    claimed_ids: dict[str, str] = {}
    claimed_keys: dict[str, str] = {}
    guaranteed_used: dict[str, int] = {}
    routes: dict[str, TrustClassRoute] = {}
    tenants: dict[str, TenantRoute] = {}
    effective_of: dict[tuple[str, tuple[int | None, ...]], tuple[TenantQuotas, tuple[str, ...]]] = {}
    route_quotas: dict[tuple[int | None, ...], Quotas] = {}  # frozen: shared by equal quotas

    for name, state in sorted(classes.items()):
        if state.deleting or not state.signing_keys:
            continue
        eng = state.tc.spec.engine
        routes[name] = TrustClassRoute(
            endpoint=endpoint(state.tc, opts),
            runtime=eng.runtime,
            served_models=[eng.model.public_name],
            adapters=[a.name for a in eng.adapters],
            cache_scope=state.tc.spec.prefix_cache.scope,
            signing_keys=[base64.b64encode(k).decode() for k in state.signing_keys],
            request_limits=limits.route() if (limits := state.tc.spec.request_limits) else None,
        )

    def evaluate(
        b: TenantBinding, spec: TenantBindingSpec, lookup: KeyLookup, *, admitted: bool = False
    ) -> Decision | _Admit:
        """What ``spec`` of binding ``b`` would get, claiming nothing (the tenant id is claimed).

        ``admitted``: ``spec`` is the binding's last accepted one, so whatever it asks beyond its
        class's *current* bounds (adapters, quota limits, guaranteed blocks) is the class's edit, not
        the tenant's: it is served clamped to those bounds (and says so) instead of refused. Only a
        revocation (class gone, namespace not admitted, keys gone or taken) refuses it."""
        cname = spec.trust_class_name
        found = classes.get(cname)
        if found is None or found.deleting:
            return _deny(conditions.REASON_TRUST_CLASS_NOT_FOUND, f"TrustClass {cname!r} does not exist")
        cs = found
        selector = cs.tc.spec.namespace_selector
        ns_labels = dict(namespace_labels.get(b.namespace, {}))
        if selector is None or not selector.matches(ns_labels):
            return _deny(
                conditions.REASON_NAMESPACE_NOT_ADMITTED,
                f"namespace {b.namespace!r} is not admitted by TrustClass {cname!r} (namespaceSelector)",
            )
        clamped: list[str] = []
        class_adapters = {a.name for a in cs.tc.spec.engine.adapters}
        missing = sorted(set(spec.allowed_adapters) - class_adapters)
        if missing and not admitted:
            return _deny(
                conditions.REASON_ADAPTER_NOT_IN_CLASS,
                f"adapters {missing} are not served by TrustClass {cname!r}",
            )
        if missing:
            clamped.append(f"adapters {missing} dropped (no longer served)")
        adapters = tuple(sorted(set(spec.allowed_adapters) & class_adapters))
        limits = cs.tc.spec.quotas.limits
        over = spec.quotas.exceeds(limits)
        if over and not admitted:
            return _deny(
                conditions.REASON_QUOTA_EXCEEDS_LIMIT,
                f"quotas above the limits of TrustClass {cname!r}: {over}",
            )
        # One object per class and distinct quotas, shared by the bindings that ask the same (most ask
        # nothing): 10,000 bindings would otherwise hold 10,000 equal copies. Never changed in place.
        quota_key = (cname, _quota_values(spec.quotas))
        merged = effective_of.get(quota_key)
        if merged is None:
            quotas, lowering = _capped(spec.quotas, limits)
            merged = effective_of[quota_key] = (
                quotas.merged_over(cs.tc.spec.quotas.defaults),
                tuple(lowering),
            )
        effective, lowered = merged
        if lowered:
            clamped.append(f"quotas lowered to the limits: {', '.join(lowered)}")
        if (
            effective.guaranteed_kv_blocks is not None
            and effective.max_kv_blocks is not None
            and effective.guaranteed_kv_blocks > effective.max_kv_blocks
        ):
            if not admitted:
                return _deny(
                    conditions.REASON_QUOTA_EXCEEDS_LIMIT,
                    "effective guaranteedKVBlocks exceeds effective maxKVBlocks",
                )
            clamped.append(
                f"guaranteedKVBlocks {effective.guaranteed_kv_blocks} -> {effective.max_kv_blocks} "
                "(the effective maxKVBlocks)"
            )
            effective = effective.model_copy(update={"guaranteed_kv_blocks": effective.max_kv_blocks})
        if lookup.error is not None:
            return _deny(lookup.error, lookup.message)
        if not lookup.hashes:
            return _deny(conditions.REASON_NO_API_KEYS, "the API-key Secret holds no keys")
        clash = next((claimed_keys[h] for h in lookup.hashes if h in claimed_keys), None)
        if clash is not None:
            return _deny(
                REASON_DUPLICATE_API_KEY,
                f"an API key of this binding is already used by {_other(clash, b.namespace)}",
            )
        guaranteed = effective.guaranteed_kv_blocks or 0
        used = guaranteed_used.get(cname, 0)
        budget = cs.tc.spec.engine.kv_block_budget
        if guaranteed and used + guaranteed > budget:
            vllm = cs.tc.spec.engine.runtime == "vllm"
            pool = (
                f"the {budget} guaranteed blocks the operator admits on vllm"
                if vllm
                else f"the {budget} blocks"
            )
            if not admitted:
                message = (
                    f"guaranteedKVBlocks {guaranteed} would exceed {pool} TrustClass {cname!r} ({used} "
                    "already guaranteed; vLLM sizes its pool from GPU memory when it starts, and its fence "
                    "checks them against that pool too)"
                    if vllm
                    else f"guaranteedKVBlocks {guaranteed} would overcommit {pool} of TrustClass {cname!r} "
                    f"({used} already guaranteed)"
                )
                return _deny(REASON_KV_OVERCOMMITTED, message)
            # Older bindings were decided first and keep theirs: this one gets what is left.
            fits = max(0, budget - used)
            clamped.append(
                f"guaranteedKVBlocks {guaranteed} -> {fits} (what is left of {pool}, {used} guaranteed to "
                "older bindings)"
            )
            effective = effective.model_copy(update={"guaranteed_kv_blocks": fits})
        if cname not in routes:
            return Decision(
                bound=False,
                denied=False,
                reason=conditions.REASON_TRUST_CLASS_NOT_READY,
                message=f"TrustClass {cname!r} has no signing key yet",
                trust_class=cname,
            )
        return _Admit(spec, cs, effective, lookup.hashes, adapters, tuple(clamped))

    for b in sorted(bindings, key=_sort_key):
        owner = claimed_ids.get(b.spec.tenant_id)
        if owner is not None:
            out.decisions[b.key] = _deny(
                conditions.REASON_DUPLICATE_TENANT_ID,
                f"tenant id {b.spec.tenant_id!r} is already bound by {_other(owner, b.namespace)}",
            )
            continue
        claimed_ids[b.spec.tenant_id] = b.key
        lookup = keys.get(
            b.key, KeyLookup(error=conditions.REASON_SECRET_NOT_FOUND, message="API keys not read yet")
        )
        got = evaluate(b, b.spec, lookup)
        refused: Decision | None = None
        accepted = b.accepted_spec()
        if isinstance(got, Decision) and accepted is not None:
            # An edit that cannot be accepted: the tenant keeps its last accepted spec (as a
            # Deployment keeps its old ReplicaSet), unless that one is refused too (a revocation).
            # The accepted spec is clamped to what its class allows now: an edit of the class takes
            # no tenant offline either (the spec may be the current one: the class changed under it).
            same_ref = accepted.api_key_secret_ref == b.spec.api_key_secret_ref
            old_lookup = lookup if same_ref else keys.get(accepted_key(b.key), lookup)
            previous = evaluate(b, accepted, old_lookup, admitted=True)
            if isinstance(previous, _Admit):
                refused, got = (got if accepted != b.spec else None), previous
            elif accepted == b.spec:
                got = previous  # the revocation, not what the class would have clamped
        if isinstance(got, Decision):
            out.decisions[b.key] = got
            continue
        admit, cname = got, got.spec.trust_class_name
        effective = admit.effective
        guaranteed_used[cname] = guaranteed_used.get(cname, 0) + (effective.guaranteed_kv_blocks or 0)
        for h in admit.hashes:
            claimed_keys[h] = b.key
        tenants[b.spec.tenant_id] = TenantRoute(
            trust_class=cname,
            api_key_hashes=sorted(set(admit.hashes)),
            allowed_adapters=list(admit.adapters),
            quotas=_route_quotas(effective, route_quotas),
            binding=b.key,
        )
        defaults = admit.cls.tc.spec.quotas.defaults
        if (effective.max_kv_blocks, effective.guaranteed_kv_blocks, effective.weight) != (
            defaults.max_kv_blocks,
            defaults.guaranteed_kv_blocks,
            defaults.weight,
        ):
            out.tenant_quotas.setdefault(cname, {})[b.spec.tenant_id] = effective
        out.decisions[b.key] = Decision(
            bound=True,
            denied=False,
            reason=conditions.REASON_BOUND,
            message=f"tenant {b.spec.tenant_id!r} routes to TrustClass {cname!r}",
            trust_class=cname,
            api_keys=len(set(admit.hashes)),
            quotas=effective,
            served_spec=admit.spec,
            refused=refused,
            clamped=admit.clamped,
        )
    out.table = RoutingTable(trust_classes=routes, tenants=dict(sorted(tenants.items())))
    return out


def table_json(table: RoutingTable) -> str:
    """Human-readable JSON of the table (what the stored bytes decode to, modulo formatting)."""
    return json.dumps(table.model_dump(by_alias=True, mode="json"), indent=2, sort_keys=True) + "\n"


def routing_secret(table: RoutingTable, opts: OperatorOptions) -> dict[str, Any]:
    """The Secret the router mounts. Not owned by any one TrustClass: it outlives them all."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": ROUTING_SECRET_NAME,
            "namespace": opts.router_namespace,
            "labels": {
                "app.kubernetes.io/name": "kvfence",
                "app.kubernetes.io/component": "routing-table",
                "app.kubernetes.io/part-of": "kvfence",
                LABEL_MANAGED_BY: FIELD_MANAGER,
            },
        },
        "type": "Opaque",
        "data": {ROUTING_SECRET_KEY: base64.b64encode(encode_table(table)).decode()},
    }
