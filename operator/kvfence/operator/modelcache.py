"""The model cache's claim and token across a class's life: what may change on a claim that exists,
whether the class namespace outlives the class, and whether the token Secret can be used. Pure
functions; :class:`kvfence.operator.reconciler.Reconciler` reads the objects and acts on the answers.

A claim's storage class and access modes cannot change once it exists (Kubernetes refuses it) and its
size can only grow (if its StorageClass allows expansion): a change that cannot happen is refused with
a condition, never dropped. A claim the class retains (``retentionPolicy.whenDeleted: Retain``, or an
``existingClaim``) lives in the class namespace, which the operator owns and deletes with the class; so
for such a class the operator keeps the namespace instead (drops its owner reference, does not delete
it), with the claim and whatever else was put there, and a class created again with that namespace
adopts it and mounts the same claim.
"""

from __future__ import annotations

import copy
from typing import Any

from kvfence.api.common import quantity_bytes
from kvfence.api.trustclass import SecretKeySelector, TrustClass

Obj = dict[str, Any]


def keeps_namespace(tc: TrustClass) -> bool:
    """Whether deleting ``tc`` must leave its namespace (and the claim in it) in place."""
    mc = tc.spec.engine.model_cache
    return mc is not None and mc.retained


def _bytes(q: Any) -> int | None:
    try:
        return quantity_bytes(str(q))
    except ValueError:
        return None


def plan_claim(desired: Obj, live: Obj | None) -> tuple[Obj, str | None]:
    """The claim to apply over ``live``, and why it cannot be (None: it can). An unset storage class
    keeps the one the claim was created with (the cluster's default then)."""
    if live is None:
        return desired, None
    name = f"{desired['metadata']['namespace']}/{desired['metadata']['name']}"
    out = copy.deepcopy(desired)
    spec, was = out["spec"], live.get("spec") or {}
    if "storageClassName" not in spec and was.get("storageClassName") is not None:
        spec["storageClassName"] = was["storageClassName"]
    if spec.get("storageClassName") != was.get("storageClassName"):
        return out, (
            f"engine.modelCache.volumeClaim.storageClassName: claim {name} has storage class "
            f"{was.get('storageClassName')!r}, which cannot change (delete the claim, or the class with "
            f"retentionPolicy Delete, to create it anew)"
        )
    if sorted(spec["accessModes"]) != sorted(was.get("accessModes") or []):
        return out, (
            f"engine.modelCache.volumeClaim.accessModes: claim {name} has {was.get('accessModes')}, "
            "which cannot change"
        )
    want = spec["resources"]["requests"]["storage"]
    has = ((was.get("resources") or {}).get("requests") or {}).get("storage")
    want_b, has_b = _bytes(want), _bytes(has)
    if want_b is not None and has_b is not None and want_b < has_b:
        return out, (
            f"engine.modelCache.volumeClaim.size: claim {name} requests {has}; a claim cannot shrink "
            f"to {want}"
        )
    return out, None


def token_refusal(ref: SecretKeySelector, namespace: str, secret: Obj | None) -> str | None:
    """Why the token Secret (as read; None: it does not exist) cannot give the engine HF_TOKEN, or None.
    Names the Secret and key, never a value."""
    where = f"engine.model.tokenSecretRef: Secret {namespace}/{ref.name}"
    if secret is None:
        return f"{where} does not exist"
    if not (secret.get("data") or {}).get(ref.key):
        return f"{where} has no key {ref.key!r} (or it is empty)"
    return None
