"""``TenantBinding`` (namespaced): admits one tenant to one trust class."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kvfence.api.common import Condition, KubeModel, TenantQuotas, conditions_field

KIND = "TenantBinding"
PLURAL = "tenantbindings"
SINGULAR = "tenantbinding"
SHORT_NAMES = ["tb"]
TENANT_ID_PATTERN = r"^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"


class SecretKeyRef(KubeModel):
    """A Secret in the binding's namespace holding the tenant's API keys."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Name of the Secret (in the TenantBinding's namespace).",
    )
    key: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="The data key holding the API key(s), one per line; unset: every data key holds one "
        "API key.",
    )


class TenantBindingSpec(KubeModel):
    """Desired binding of a tenant to a trust class."""

    tenant_id: str = Field(
        alias="tenantId",
        min_length=1,
        max_length=63,
        pattern=TENANT_ID_PATTERN,
        description="The tenant's id, unique in the cluster (a later binding with the same id is Denied). "
        "Immutable.",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self == oldSelf",
                    "message": "tenantId is immutable",
                    "reason": "FieldValueForbidden",
                }
            ]
        },
    )
    trust_class_name: str = Field(
        alias="trustClassName",
        min_length=1,
        max_length=253,
        description="Name of the TrustClass the tenant is served by.",
    )
    api_key_secret_ref: SecretKeyRef = Field(
        alias="apiKeySecretRef",
        description="The Secret holding the tenant's API keys. The operator stores only their SHA-256 hashes "
        "in the routing table. The operator must be allowed to read it (see docs/operator.md).",
    )
    allowed_adapters: list[str] = Field(
        default_factory=list,
        alias="allowedAdapters",
        max_length=64,
        description="LoRA adapters of the trust class this tenant may use (empty: only the base model).",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    quotas: TenantQuotas = Field(
        default_factory=TenantQuotas,
        description="Overrides of the trust class's default quotas; each must be within the class's limits.",
        json_schema_extra={"default": {}},
    )


class TenantBindingStatus(KubeModel):
    """Observed state of a binding."""

    observed_generation: int | None = Field(
        None, alias="observedGeneration", description="The .metadata.generation last reconciled."
    )
    conditions: list[Condition] = conditions_field(
        "Bound and Denied; Ready (the same as Bound); SpecAccepted (False: the tenant is served with its "
        "last accepted spec); Clamped (True: the TrustClass was edited after that spec was accepted and "
        "the tenant is served within the class's current bounds: lower quotas, fewer adapters, fewer "
        "guaranteed blocks); Reconciling and Stalled as kstatus reads them."
    )
    trust_class: str | None = Field(
        None, alias="trustClass", description="The trust class the tenant routes to."
    )
    api_keys: int | None = Field(None, alias="apiKeys", description="API keys found in the Secret.")
    accepted_spec: dict[str, Any] | None = Field(
        None,
        alias="acceptedSpec",
        description="The last spec the operator accepted: the tenant is served with it. An edit that "
        "cannot be accepted (a quota above the class's limits, an adapter the class does not serve, an "
        "API-key Secret that does not exist or holds no keys) leaves it in force, with SpecAccepted=False "
        "saying why. An edit of the TrustClass that this spec no longer fits leaves it in force too, "
        "served within the class's current bounds (Clamped=True says what was clamped).",
    )
    accepted_generation: int | None = Field(
        None, alias="acceptedGeneration", description="The .metadata.generation of acceptedSpec."
    )


class TenantBinding(KubeModel):
    """Admits one tenant (by id) to one trust class, with its API keys and quotas."""

    api_version: str = Field("kvfence.dev/v1alpha1", alias="apiVersion", description="API version.")
    kind: str = Field(KIND, description="Kind.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: TenantBindingSpec = Field(description="Desired state.")
    status: TenantBindingStatus = Field(default_factory=TenantBindingStatus, description="Observed state.")

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace", ""))

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def accepted_spec(self) -> TenantBindingSpec | None:
        """The last accepted spec recorded in the status (None: none, or one that no longer parses)."""
        raw = self.status.accepted_spec
        if raw is None:
            return None
        try:
            return TenantBindingSpec.model_validate(raw)
        except ValueError:
            return None
