"""Types shared by the kvfence.dev/v1alpha1 kinds.

Every model here is both the operator's parsed view of a custom resource and the source the CRD schema
is generated from (:mod:`kvfence.api.crdgen`): a field's ``description`` is what ``kubectl explain``
prints, its constraints become OpenAPI validation, and ``x-kubernetes-validations`` (CEL) entries carry
the rules that span fields.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

GROUP = "kvfence.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

#: Kubernetes resource.Quantity, as kubebuilder renders it.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
Quantity = Annotated[
    int | str,
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]

#: A whole number of bytes as a Kubernetes quantity without sign, fraction or exponent (``1Gi``,
#: ``512Mi``, ``2G``, ``1073741824``): a memory size the operator hands a runtime as exact bytes.
BYTE_QUANTITY_PATTERN = r"^[1-9][0-9]*(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
_BYTE_SUFFIXES = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
}  # fmt: skip


#: Written as a string (``"1Gi"``), which the CRD's pattern checks like the operator does.
ByteQuantity = Annotated[str, Field(pattern=BYTE_QUANTITY_PATTERN, max_length=32)]


def quantity_bytes(q: str) -> int:
    """The bytes of a :data:`ByteQuantity` (``"1Gi"`` -> 1073741824)."""
    m = re.match(BYTE_QUANTITY_PATTERN, q)
    if not m:
        raise ValueError(f"{q!r} is not a quantity of bytes")
    suffix = m.group(1) or ""
    return int(q[: len(q) - len(suffix)]) * _BYTE_SUFFIXES[suffix]


#: A free-form Kubernetes object (core/v1 types we pass through verbatim: Affinity, Toleration).
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: Qualified resource name such as ``nvidia.com/gpu`` or ``nvidia.com/mig-1g.10gb``.
RESOURCE_NAME = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
#: CamelCase condition reason (metav1.Condition).
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class KubeModel(BaseModel):
    """Base of every API model: camelCase on the wire, snake_case in Python; unknown fields ignored
    (the apiserver prunes them anyway, and an older operator must read a newer object)."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore", validate_default=True)

    def wire(self) -> dict[str, Any]:
        """The object as it is stored in Kubernetes (aliases, no unset optionals)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class LabelSelectorRequirement(KubeModel):
    """One set-based requirement of a label selector."""

    key: str = Field(description="The label key the selector applies to.", min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How the key relates to the values: In, NotIn, Exists or DoesNotExist."
    )
    values: list[str] = Field(
        default_factory=list,
        description="Values for In and NotIn (non-empty there); must be empty for Exists and DoesNotExist.",
    )


class LabelSelector(KubeModel):
    """A Kubernetes label selector. An empty selector matches everything."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-map-type": "atomic"},
    )

    match_labels: dict[str, str] = Field(
        default_factory=dict,
        alias="matchLabels",
        description="Labels that must all be present with exactly these values.",
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list,
        alias="matchExpressions",
        description="Set-based requirements; all must hold.",
    )

    def matches(self, labels: dict[str, str]) -> bool:
        for k, v in self.match_labels.items():
            if labels.get(k) != v:
                return False
        for req in self.match_expressions:
            present = req.key in labels
            if req.operator == "In" and (not present or labels[req.key] not in req.values):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True


class Condition(KubeModel):
    """An observation of one aspect of the object's state (metav1.Condition)."""

    type: str = Field(
        description="The condition's type in CamelCase, e.g. Ready.",
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    observed_generation: int | None = Field(
        None,
        alias="observedGeneration",
        ge=0,
        description="The .metadata.generation the condition was computed from.",
    )
    last_transition_time: str = Field(
        alias="lastTransitionTime",
        description="When the status last changed (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    reason: str = Field(
        description="A CamelCase, machine-readable word for why the condition has its status.",
        min_length=1,
        max_length=1024,
        pattern=REASON_PATTERN,
    )
    message: str = Field("", max_length=32768, description="A human-readable explanation; may be empty.")


def conditions_field(description: str) -> Any:
    """A ``conditions`` list keyed by ``type`` (a list-map, as kubebuilder renders it)."""
    return Field(
        default_factory=list,
        description=description,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


QUOTA_FIELDS = (
    "maxConcurrentRequests",
    "requestsPerMinute",
    "tokensPerMinute",
    "maxKVBlocks",
    "guaranteedKVBlocks",
    "weight",
)


class TenantQuotas(KubeModel):
    """Per-tenant limits. An unset field means: inherited (binding), or unlimited (trust class)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.guaranteedKVBlocks) || !has(self.maxKVBlocks)"
                    " || self.guaranteedKVBlocks <= self.maxKVBlocks",
                    "message": "guaranteedKVBlocks must not exceed maxKVBlocks",
                    "fieldPath": ".guaranteedKVBlocks",
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )

    max_concurrent_requests: int | None = Field(
        None,
        alias="maxConcurrentRequests",
        ge=1,
        description="Requests of one tenant in flight at once; more are answered 429 by the router.",
    )
    requests_per_minute: int | None = Field(
        None, alias="requestsPerMinute", ge=1, description="Requests per minute the router admits."
    )
    tokens_per_minute: int | None = Field(
        None,
        alias="tokensPerMinute",
        ge=1,
        description="Prompt plus completion tokens per minute the router admits.",
    )
    max_kv_blocks: int | None = Field(
        None,
        alias="maxKVBlocks",
        ge=1,
        description="Hard maximum of KV-cache blocks the tenant may hold in the engine at once.",
    )
    guaranteed_kv_blocks: int | None = Field(
        None,
        alias="guaranteedKVBlocks",
        ge=0,
        description="KV-cache blocks reserved for the tenant: never reclaimed for other tenants.",
    )
    weight: int | None = Field(
        None,
        ge=1,
        le=1000,
        description="The tenant's fair share of the engine relative to the other tenants with work: each "
        "scheduler step's tokens and running slots are divided in proportion to the weights (unset: the "
        "class default, else 1); a limit caps what a binding may ask.",
    )

    def merged_over(self, base: TenantQuotas) -> TenantQuotas:
        """``self``'s set fields over ``base``."""
        data = base.model_dump(exclude_none=True)
        data.update(self.model_dump(exclude_none=True))
        return TenantQuotas.model_validate(data)

    def exceeds(self, limits: TenantQuotas) -> list[str]:
        """The wire names of fields set in ``self`` that are above the same field of ``limits``."""
        out: list[str] = []
        for name, info in TenantQuotas.model_fields.items():
            mine, lim = getattr(self, name), getattr(limits, name)
            if mine is not None and lim is not None and mine > lim:
                out.append(info.alias or name)
        return out
