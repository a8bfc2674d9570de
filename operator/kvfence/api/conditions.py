"""Condition types and reasons (CamelCase) the operator sets, in one place."""

from __future__ import annotations

from typing import Final

# --- TrustClass condition types ---------------------------------------------------------------
READY: Final = "Ready"
PROGRESSING: Final = "Progressing"
DEGRADED: Final = "Degraded"

#: kstatus' abnormal-true conditions (Flux, kpt, cli-utils), set on both kinds: ``Reconciling`` while
#: the operator (or the rollout it started) is still working towards the spec, ``Stalled`` when it cannot
#: get there without a change by someone. Both False otherwise; never both True.
RECONCILING: Final = "Reconciling"
STALLED: Final = "Stalled"

# --- TenantBinding condition types ------------------------------------------------------------
BOUND: Final = "Bound"
DENIED: Final = "Denied"
#: On bindings ``Ready`` mirrors ``Bound``: ``kubectl wait --for=condition=Ready`` works on both kinds.
#: Whether the object's current spec is the one in force. False: an edit could not be accepted and the
#: last accepted spec is served instead (its reason is the refusal's), as a Deployment keeps its old
#: ReplicaSet. Set on both kinds.
SPEC_ACCEPTED: Final = "SpecAccepted"
#: True while the spec in force asks for more than its TrustClass allows *now* (the class was edited
#: after the spec was accepted: lower quota limits, an adapter no longer served, fewer blocks to
#: guarantee): the tenant stays Bound and served within the class's bounds, and this says what was
#: clamped. Abnormal-true, like ``Denied``; ``Ready`` is not affected.
CLAMPED: Final = "Clamped"

# --- reasons: TrustClass ----------------------------------------------------------------------
REASON_AVAILABLE: Final = "EngineAvailable"
REASON_ROLLING_OUT: Final = "EngineRollingOut"
REASON_ROLLOUT_COMPLETE: Final = "RolloutComplete"
REASON_UNAVAILABLE: Final = "EngineUnavailable"
REASON_SCALED_TO_ZERO: Final = "ScaledToZero"
REASON_NAMESPACE_CONFLICT: Final = "NamespaceConflict"
REASON_AS_EXPECTED: Final = "AsExpected"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_INVALID_ENGINE_CONFIG: Final = "InvalidEngineConfig"
#: a shared prefix's configMapKeyRef names a ConfigMap or key that does not exist (the engines keep the
#: last config they were given)
REASON_SHARED_PREFIX_UNRESOLVED: Final = "SharedPrefixUnresolved"
REASON_FORBIDDEN_EXTRA_ARGS: Final = "ForbiddenExtraArgs"
#: engine.model.tokenSecretRef names a Secret or key that does not exist (nothing is applied: no pod is
#: left failing on a dangling reference), or one the operator may not read (its namespace has not
#: granted the kvfence-operator-tenant-secrets ClusterRole)
REASON_MODEL_TOKEN_MISSING: Final = "ModelTokenSecretMissing"
REASON_MODEL_TOKEN_FORBIDDEN: Final = "ModelTokenSecretForbidden"
#: engine.modelCache.volumeClaim asks for a change its existing claim cannot take (storage class, access
#: modes, a smaller size), or the API server refused the change (an expansion its StorageClass forbids)
REASON_MODEL_CACHE_CLAIM_REFUSED: Final = "ModelCacheClaimRefused"
REASON_RECONCILED: Final = "Reconciled"
REASON_ACCEPTED: Final = "Accepted"

# --- reasons: TenantBinding -------------------------------------------------------------------
REASON_BOUND: Final = "Bound"
REASON_NOT_DENIED: Final = "Admitted"
REASON_TRUST_CLASS_NOT_FOUND: Final = "TrustClassNotFound"
REASON_TRUST_CLASS_NOT_READY: Final = "TrustClassNotReady"
REASON_NAMESPACE_NOT_ADMITTED: Final = "NamespaceNotAdmitted"
REASON_DUPLICATE_TENANT_ID: Final = "DuplicateTenantId"
REASON_ADAPTER_NOT_IN_CLASS: Final = "AdapterNotInTrustClass"
REASON_QUOTA_EXCEEDS_LIMIT: Final = "QuotaExceedsClassLimit"
REASON_SECRET_NOT_FOUND: Final = "ApiKeySecretNotFound"
REASON_SECRET_FORBIDDEN: Final = "ApiKeySecretForbidden"
REASON_NO_API_KEYS: Final = "NoApiKeys"
REASON_DUPLICATE_API_KEY: Final = "DuplicateApiKey"
REASON_KV_OVERCOMMITTED: Final = "KVBlocksOvercommitted"
REASON_CLAMPED: Final = "ClampedToClassLimits"
REASON_WITHIN_CLASS_LIMITS: Final = "WithinClassLimits"
REASON_NOT_BOUND: Final = "NotBound"
