"""The routing decision's API-key cache: each binding's keys (hashed) as read from its Secret, kept
until the binding's spec or the Secret's watched resourceVersion says otherwise; a namespace with many
Secrets to read is read with one paged LIST.
"""

from __future__ import annotations

from kvfence.api import conditions
from kvfence.api.tenantbinding import TenantBinding, TenantBindingSpec
from kvfence.contract.routing import hash_api_key
from kvfence.operator.apply import KubeError
from kvfence.operator.bindings import KeyLookup, accepted_key, api_keys_from_secret
from kvfence.operator.reconcile_base import Obj, ReconcilerBase

#: A namespace with at least this many API-key Secrets to read (the first routing decision after a
#: start, a namespace full of new bindings) has them read by one paged LIST instead of a GET each.
API_KEYS_LIST_MIN = 16


class ApiKeyCache(ReconcilerBase):
    def forget_api_keys(self, binding: str | None = None) -> None:
        """Read ``binding``'s API keys again at its next routing decision (every binding's: None)."""
        if binding is None:
            self.state.keys.clear()
        else:
            self.state.keys.pop(binding, None)

    def secret_changed(self, namespace: str, name: str, resource_version: str) -> None:
        """The watch saw this version of an API-key Secret: a cached read of an older one is stale."""
        self.state.secret_versions[(namespace, name)] = resource_version

    def secret_untracked(self, secret: tuple[str, str]) -> None:
        """No binding reads this Secret any more."""
        self.state.secret_versions.pop(secret, None)

    def cached_secret_version(self, binding: str) -> str | None:
        """resourceVersion of the API-key Secret whose keys are cached for ``binding`` (or None)."""
        cached = self.state.keys.get(binding)
        return None if cached is None else cached[2]

    def _cached_api_keys(self, b: TenantBinding, spec: TenantBindingSpec, cache_key: str) -> KeyLookup | None:
        ref = spec.api_key_secret_ref
        cached = self.state.keys.get(cache_key)
        watched = self.state.secret_versions.get((b.namespace, ref.name))
        if cached is not None and cached[0][:2] == (ref.name, ref.key) and watched in (None, cached[2]):
            return cached[1]
        return None

    def _list_api_keys(self, bindings: list[TenantBinding]) -> None:
        """Read the API keys of a namespace that has many to read with one paged LIST of its Secrets
        instead of a GET each (the routing decision's reads then find them cached). Only the Secrets
        its bindings name are kept (their keys hashed, as a GET would give them); every other Secret
        of the page is dropped as the page is read. A namespace that lets the operator read its
        Secrets one by one only (``get``, an older role) answers 403: its keys are read by GET."""
        wanted: dict[str, dict[str, list[TenantBinding]]] = {}
        for b in bindings:
            if self._cached_api_keys(b, b.spec, b.key) is None:
                wanted.setdefault(b.namespace, {}).setdefault(b.spec.api_key_secret_ref.name, []).append(b)
        for ns, names in wanted.items():
            if len(names) < API_KEYS_LIST_MIN:
                continue

            def keep(secret: Obj, names: dict[str, list[TenantBinding]] = names) -> Obj:
                meta = secret.get("metadata") or {}
                if meta.get("name") not in names:
                    return {}
                return {"metadata": meta, "data": secret.get("data") or {}}

            try:
                listed = self.kube.list("v1", "Secret", ns, each=keep)
            except KubeError as e:
                if e.forbidden:
                    continue
                raise
            for secret in listed:
                for b in names.get(str((secret.get("metadata") or {}).get("name")), ()):
                    self._store_api_keys(b, b.spec, b.key, secret)

    def _api_keys(self, b: TenantBinding, spec: TenantBindingSpec, cache_key: str) -> KeyLookup:
        """The API keys of ``spec``'s Secret (cached under ``cache_key``: the binding's key, or
        :func:`bindings.accepted_key` of it for the Secret of its last accepted spec)."""
        cached = self._cached_api_keys(b, spec, cache_key)
        if cached is not None:
            return cached
        ref = spec.api_key_secret_ref
        try:
            secret = self.kube.get("v1", "Secret", ref.name, b.namespace)
        except KubeError as e:
            if e.forbidden:
                lookup = KeyLookup(
                    error=conditions.REASON_SECRET_FORBIDDEN,
                    message=f"the operator may not read Secret {b.namespace}/{ref.name} "
                    f"(bind the {self.opts.tenant_secrets_role} ClusterRole in this namespace)",
                )
                return lookup  # not cached: a RoleBinding granted later is seen at the next reconcile
            raise
        return self._store_api_keys(b, spec, cache_key, secret)

    def _store_api_keys(
        self, b: TenantBinding, spec: TenantBindingSpec, cache_key: str, secret: Obj | None
    ) -> KeyLookup:
        """The lookup of the API-key Secret ``secret`` (as read; None: not found), cached unless it
        is an error."""
        ref = spec.api_key_secret_ref
        ident = (ref.name, ref.key, str(b.metadata.get("resourceVersion", "")))
        if secret is None:
            lookup = KeyLookup(
                error=conditions.REASON_SECRET_NOT_FOUND, message=f"Secret {b.namespace}/{ref.name} not found"
            )
        else:
            try:
                keys = api_keys_from_secret(secret, ref.key)
                lookup = KeyLookup(hashes=tuple(sorted({hash_api_key(k) for k in keys})))
            except (ValueError, UnicodeDecodeError):
                lookup = KeyLookup(
                    error=conditions.REASON_NO_API_KEYS, message="the API-key Secret is not UTF-8 text"
                )
        if lookup.error is None:
            version = str(((secret or {}).get("metadata") or {}).get("resourceVersion", ""))
            self.state.keys[cache_key] = (ident, lookup, version)
        return lookup

    def api_key_lookups(self, bindings: list[TenantBinding]) -> dict[str, KeyLookup]:
        """The API keys of every binding (by its key) and, where its last accepted spec names another
        Secret, of that one too (by :func:`bindings.accepted_key`); what is cached for a binding gone
        or a Secret no longer named is dropped."""
        self._list_api_keys(bindings)
        lookups = dict(
            zip(
                [b.key for b in bindings],
                self._fanout.map(lambda b: self._api_keys(b, b.spec, b.key), bindings),
                strict=True,
            )
        )
        for b in bindings:
            accepted = b.accepted_spec()
            if accepted is not None and accepted.api_key_secret_ref != b.spec.api_key_secret_ref:
                lookups[accepted_key(b.key)] = self._api_keys(b, accepted, accepted_key(b.key))
        live_keys = set(lookups)
        for k in list(self.state.keys):
            if k not in live_keys:
                del self.state.keys[k]
        return lookups
