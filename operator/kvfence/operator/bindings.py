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
    decider = _Decider(classes, namespace_labels, keys, _class_routes(classes, opts))
    for b in sorted(bindings, key=_sort_key):
        decider.add(b)
    return decider.outcome()


def _class_routes(classes: Mapping[str, ClassState], opts: OperatorOptions) -> dict[str, TrustClassRoute]:
    """The routing table's trust classes: every class with a signing key that is not being deleted."""
    routes: dict[str, TrustClassRoute] = {}
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
    return routes


@dataclass
class _Decider:
    """Decides bindings one at a time, each against what the bindings decided before it claimed
    (tenant ids, API keys, guaranteed blocks), and collects the outcome."""

    classes: Mapping[str, ClassState]
    namespace_labels: Mapping[str, Mapping[str, str]]
    keys: Mapping[str, KeyLookup]
    routes: dict[str, TrustClassRoute]
    out: Outcome = field(default_factory=Outcome)
    claimed_ids: dict[str, str] = field(default_factory=dict)  # tenant id -> binding
    claimed_keys: dict[str, str] = field(default_factory=dict)  # API-key hash -> binding
    guaranteed_used: dict[str, int] = field(default_factory=dict)  # trust class -> blocks
    tenants: dict[str, TenantRoute] = field(default_factory=dict)
    #: (class, quota values) -> effective quotas and what the limits lowered: one object per class and
    #: distinct quotas, shared by the bindings that ask the same (most ask nothing), so that 10,000
    #: bindings do not hold 10,000 equal copies. Never changed in place.
    effective_of: dict[tuple[str, tuple[int | None, ...]], tuple[TenantQuotas, tuple[str, ...]]] = field(
        default_factory=dict
    )
    route_quotas: dict[tuple[int | None, ...], Quotas] = field(default_factory=dict)  # frozen: shared

    def add(self, b: TenantBinding) -> None:
        """Decide binding ``b``; bound, it claims its tenant id, API keys and guaranteed blocks."""
        owner = self.claimed_ids.get(b.spec.tenant_id)
        if owner is not None:
            self.out.decisions[b.key] = _deny(
                conditions.REASON_DUPLICATE_TENANT_ID,
                f"tenant id {b.spec.tenant_id!r} is already bound by {_other(owner, b.namespace)}",
            )
            return
        self.claimed_ids[b.spec.tenant_id] = b.key
        got, refused = self._served(b)
        if isinstance(got, Decision):
            self.out.decisions[b.key] = got
        else:
            self._bind(b, got, refused)

    def outcome(self) -> Outcome:
        """The decisions so far, and the routing table of the tenants bound."""
        self.out.table = RoutingTable(trust_classes=self.routes, tenants=dict(sorted(self.tenants.items())))
        return self.out

    def _served(self, b: TenantBinding) -> tuple[Decision | _Admit, Decision | None]:
        """What ``b`` is served with, and why its own spec was refused when that is its last accepted one.

        An edit that cannot be accepted leaves the tenant on its last accepted spec (as a Deployment
        keeps its old ReplicaSet), unless that one is refused too (a revocation). The accepted spec is
        clamped to what its class allows now: an edit of the class takes no tenant offline either (the
        spec may be the current one: the class changed under it)."""
        lookup = self.keys.get(
            b.key, KeyLookup(error=conditions.REASON_SECRET_NOT_FOUND, message="API keys not read yet")
        )
        got = self._evaluate(b, b.spec, lookup)
        accepted = b.accepted_spec()
        if isinstance(got, _Admit) or accepted is None:
            return got, None
        same_ref = accepted.api_key_secret_ref == b.spec.api_key_secret_ref
        old_lookup = lookup if same_ref else self.keys.get(accepted_key(b.key), lookup)
        previous = self._evaluate(b, accepted, old_lookup, admitted=True)
        if isinstance(previous, _Admit):
            return previous, (got if accepted != b.spec else None)
        if accepted == b.spec:
            return previous, None  # the revocation, not what the class would have clamped
        return got, None

    def _evaluate(
        self, b: TenantBinding, spec: TenantBindingSpec, lookup: KeyLookup, *, admitted: bool = False
    ) -> Decision | _Admit:
        """What ``spec`` of binding ``b`` would get, claiming nothing (the tenant id is claimed).

        ``admitted``: ``spec`` is the binding's last accepted one, so whatever it asks beyond its
        class's *current* bounds (adapters, quota limits, guaranteed blocks) is the class's edit, not
        the tenant's: it is served clamped to those bounds (and says so) instead of refused. Only a
        revocation (class gone, namespace not admitted, keys gone or taken) refuses it."""
        cname = spec.trust_class_name
        cs = self._admitting_class(cname, b.namespace)
        if isinstance(cs, Decision):
            return cs
        clamped: list[str] = []
        adapters = _served_adapters(spec, cs, admitted, clamped)
        if isinstance(adapters, Decision):
            return adapters
        effective = self._effective_quotas(spec, cs, admitted, clamped)
        if isinstance(effective, Decision):
            return effective
        key_denial = self._key_denial(lookup, b.namespace)
        if key_denial is not None:
            return key_denial
        used = self.guaranteed_used.get(cname, 0)
        effective = _within_budget(effective, cname, cs, used, admitted, clamped)
        if isinstance(effective, Decision):
            return effective
        if cname not in self.routes:
            return Decision(
                bound=False,
                denied=False,
                reason=conditions.REASON_TRUST_CLASS_NOT_READY,
                message=f"TrustClass {cname!r} has no signing key yet",
                trust_class=cname,
            )
        return _Admit(spec, cs, effective, lookup.hashes, adapters, tuple(clamped))

    def _admitting_class(self, cname: str, namespace: str) -> ClassState | Decision:
        """Trust class ``cname`` when it exists and admits ``namespace``, else the denial saying which not."""
        found = self.classes.get(cname)
        if found is None or found.deleting:
            return _deny(conditions.REASON_TRUST_CLASS_NOT_FOUND, f"TrustClass {cname!r} does not exist")
        selector = found.tc.spec.namespace_selector
        if selector is None or not selector.matches(dict(self.namespace_labels.get(namespace, {}))):
            return _deny(
                conditions.REASON_NAMESPACE_NOT_ADMITTED,
                f"namespace {namespace!r} is not admitted by TrustClass {cname!r} (namespaceSelector)",
            )
        return found

    def _effective_quotas(
        self, spec: TenantBindingSpec, cs: ClassState, admitted: bool, clamped: list[str]
    ) -> TenantQuotas | Decision:
        """``spec``'s quotas over its class's defaults within its limits, or the denial of a spec asking
        above them (an ``admitted`` one is lowered to them instead, said in ``clamped``)."""
        cname = spec.trust_class_name
        limits = cs.tc.spec.quotas.limits
        over = spec.quotas.exceeds(limits)
        if over and not admitted:
            return _deny(
                conditions.REASON_QUOTA_EXCEEDS_LIMIT,
                f"quotas above the limits of TrustClass {cname!r}: {over}",
            )
        quota_key = (cname, _quota_values(spec.quotas))
        merged = self.effective_of.get(quota_key)
        if merged is None:
            quotas, lowering = _capped(spec.quotas, limits)
            merged = self.effective_of[quota_key] = (
                quotas.merged_over(cs.tc.spec.quotas.defaults),
                tuple(lowering),
            )
        effective, lowered = merged
        if lowered:
            clamped.append(f"quotas lowered to the limits: {', '.join(lowered)}")
        return _guarantee_within_max(effective, admitted, clamped)

    def _key_denial(self, lookup: KeyLookup, namespace: str) -> Decision | None:
        """Why the API keys of ``lookup`` cannot be used (unread, none, or one already claimed), or None."""
        if lookup.error is not None:
            return _deny(lookup.error, lookup.message)
        if not lookup.hashes:
            return _deny(conditions.REASON_NO_API_KEYS, "the API-key Secret holds no keys")
        clash = next((self.claimed_keys[h] for h in lookup.hashes if h in self.claimed_keys), None)
        if clash is not None:
            return _deny(
                REASON_DUPLICATE_API_KEY,
                f"an API key of this binding is already used by {_other(clash, namespace)}",
            )
        return None

    def _bind(self, b: TenantBinding, admit: _Admit, refused: Decision | None) -> None:
        """Route ``b``'s tenant as ``admit`` says, claiming its API keys and guaranteed blocks."""
        cname, effective = admit.spec.trust_class_name, admit.effective
        used = self.guaranteed_used.get(cname, 0)
        self.guaranteed_used[cname] = used + (effective.guaranteed_kv_blocks or 0)
        for h in admit.hashes:
            self.claimed_keys[h] = b.key
        self.tenants[b.spec.tenant_id] = TenantRoute(
            trust_class=cname,
            api_key_hashes=sorted(set(admit.hashes)),
            allowed_adapters=list(admit.adapters),
            quotas=_route_quotas(effective, self.route_quotas),
            binding=b.key,
        )
        defaults = admit.cls.tc.spec.quotas.defaults
        if (effective.max_kv_blocks, effective.guaranteed_kv_blocks, effective.weight) != (
            defaults.max_kv_blocks,
            defaults.guaranteed_kv_blocks,
            defaults.weight,
        ):
            self.out.tenant_quotas.setdefault(cname, {})[b.spec.tenant_id] = effective
        self.out.decisions[b.key] = Decision(
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


def _served_adapters(
    spec: TenantBindingSpec, cs: ClassState, admitted: bool, clamped: list[str]
) -> tuple[str, ...] | Decision:
    """The adapters ``spec`` is served with, or its denial for asking one the class does not serve
    (an ``admitted`` spec has those dropped instead, said in ``clamped``)."""
    class_adapters = {a.name for a in cs.tc.spec.engine.adapters}
    missing = sorted(set(spec.allowed_adapters) - class_adapters)
    if missing and not admitted:
        return _deny(
            conditions.REASON_ADAPTER_NOT_IN_CLASS,
            f"adapters {missing} are not served by TrustClass {spec.trust_class_name!r}",
        )
    if missing:
        clamped.append(f"adapters {missing} dropped (no longer served)")
    return tuple(sorted(set(spec.allowed_adapters) & class_adapters))


def _guarantee_within_max(
    effective: TenantQuotas, admitted: bool, clamped: list[str]
) -> TenantQuotas | Decision:
    """``effective`` with its guaranteed blocks no more than its maximum, or the denial of a spec
    asking more (an ``admitted`` one is lowered to the maximum instead, said in ``clamped``)."""
    guaranteed, maximum = effective.guaranteed_kv_blocks, effective.max_kv_blocks
    if guaranteed is None or maximum is None or guaranteed <= maximum:
        return effective
    if not admitted:
        return _deny(
            conditions.REASON_QUOTA_EXCEEDS_LIMIT,
            "effective guaranteedKVBlocks exceeds effective maxKVBlocks",
        )
    clamped.append(f"guaranteedKVBlocks {guaranteed} -> {maximum} (the effective maxKVBlocks)")
    return effective.model_copy(update={"guaranteed_kv_blocks": maximum})


def _within_budget(
    effective: TenantQuotas, cname: str, cs: ClassState, used: int, admitted: bool, clamped: list[str]
) -> TenantQuotas | Decision:
    """``effective`` with its guaranteed blocks within what is left of class ``cname``'s KV block budget
    once ``used`` are guaranteed to the bindings decided before, or the denial of a spec asking more
    (an ``admitted`` one gets what is left instead, said in ``clamped``)."""
    guaranteed = effective.guaranteed_kv_blocks or 0
    eng = cs.tc.spec.engine
    budget = eng.kv_block_budget
    if not guaranteed or used + guaranteed <= budget:
        return effective
    vllm = eng.runtime == "vllm"
    pool = f"the {budget} guaranteed blocks the operator admits on vllm" if vllm else f"the {budget} blocks"
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
    fits = max(0, budget - used)
    clamped.append(
        f"guaranteedKVBlocks {guaranteed} -> {fits} (what is left of {pool}, {used} guaranteed to "
        "older bindings)"
    )
    return effective.model_copy(update={"guaranteed_kv_blocks": fits})


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
