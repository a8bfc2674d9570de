"""``TrustClass`` (cluster-scoped): one dedicated engine, and the tenants that may share it."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from kvfence.api.common import (
    DNS_LABEL,
    QUOTA_FIELDS,
    RESOURCE_NAME,
    ByteQuantity,
    Condition,
    FreeForm,
    KubeModel,
    LabelSelector,
    Quantity,
    TenantQuotas,
    conditions_field,
)
from kvfence.api.policy.engine_args import (
    MAX_EXTRA_ARG_LENGTH,
    extra_arg_item_rule,
    extra_args_runtime_rules,
)
from kvfence.api.policy.engine_env import env_refusal, env_rule
from kvfence.api.policy.mounts import EXTRA_MOUNT_PATTERN, EXTRA_MOUNT_ROOTS, RESERVED_VOLUMES, under
from kvfence.api.request_limits import RequestLimitsSpec
from kvfence.contract import CacheScope

KIND = "TrustClass"
PLURAL = "trustclasses"
SINGULAR = "trustclass"
SHORT_NAMES = ["tc"]
NAMESPACE_PREFIX = "kvf-"
#: A TrustClass name must leave room for the default namespace name ``kvf-<name>`` (63 characters).
MAX_NAME_LENGTH = 63 - len(NAMESPACE_PREFIX)

Runtime = Literal["vllm", "reference"]
Device = Literal["GPU", "CPU"]
HashAlgorithm = Literal["sha256", "blake2b"]

#: The reference engine's KV pool when ``engine.numBlocks`` is unset.
DEFAULT_NUM_BLOCKS = 1024
#: What the CRD of kvfence 0.1.0 defaulted onto *every* stored TrustClass, whatever its runtime. Objects
#: stored then still carry them; read on the runtime that has no use for them, they mean "unset" (see
#: ``EngineSpec._runtime_fields``). The API server refuses both fields on that runtime for every new write.
LEGACY_DEFAULT_NUM_BLOCKS = 1024
LEGACY_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

NUM_BLOCKS_ON_VLLM = (
    "engine.numBlocks applies to the reference runtime only: vLLM sizes its KV pool from GPU memory "
    "(engine.gpuMemoryUtilization)"
)
GPU_MEMORY_UTILIZATION_ON_REFERENCE = (
    "engine.gpuMemoryUtilization applies to the vllm runtime only: the reference engine runs on CPU "
    "and sizes its KV pool from engine.numBlocks"
)
GPU_DEVICE_ON_REFERENCE = (
    "engine.device GPU applies to the vllm runtime only: the reference engine runs on CPU"
)
KV_CACHE_MEMORY_ON_REFERENCE = (
    "engine.kvCacheMemory applies to the vllm runtime only: the reference engine sizes its KV pool from "
    "engine.numBlocks"
)
KV_CACHE_MEMORY_REQUIRED_ON_CPU = (
    "engine.kvCacheMemory is required with engine.device CPU: without it vLLM's CPU backend reserves "
    "a fraction of the whole node's memory (gpuMemoryUtilization, 0.9 by default), not of the pod's"
)
KV_CACHE_MEMORY_AND_GPU_MEMORY_UTILIZATION = (
    "set engine.kvCacheMemory or engine.gpuMemoryUtilization, not both: vLLM sizes its KV cache from "
    "kvCacheMemory and then ignores gpuMemoryUtilization"
)
GPU_COUNT_ON_CPU = "engine.device CPU requests no GPU: resources.gpu.count must be 0"

#: A Kubernetes object name (DNS-1123 subdomain).
OBJECT_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
#: A key of a Secret or ConfigMap.
DATA_KEY = r"^[-._a-zA-Z0-9]+$"


class SecretKeySelector(KubeModel):
    """A key of a Secret in the trust class's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=OBJECT_NAME, description="The Secret.")
    key: str = Field(
        "token", min_length=1, max_length=253, pattern=DATA_KEY, description="The key (default token)."
    )


class ModelSpec(KubeModel):
    """The model the engine serves."""

    name: str = Field(
        min_length=1,
        max_length=512,
        description="Model id as the runtime loads it (a Hugging Face repo id or a local path).",
    )
    revision: str = Field(
        "main",
        min_length=1,
        max_length=256,
        description="Model revision (branch, tag or commit). It is part of every prefix-cache key.",
    )
    served_name: str | None = Field(
        None,
        alias="servedName",
        min_length=1,
        max_length=256,
        description="The model name clients send in requests; defaults to name.",
    )

    token_secret_ref: SecretKeySelector | None = Field(
        None,
        alias="tokenSecretRef",
        description="A key of a Secret in the class's namespace holding a Hugging Face token, for gated "
        "models (vllm only). It reaches the engine as HF_TOKEN from the Secret (secretKeyRef): the "
        "operator never copies the value. A Secret or key that does not exist keeps the class Stalled "
        "(ModelTokenSecretMissing) with nothing applied; the operator reads it only where the class "
        "namespace grants it the kvfence-operator-tenant-secrets ClusterRole.",
    )

    @property
    def public_name(self) -> str:
        return self.served_name or self.name


class AdapterSpec(KubeModel):
    """A LoRA adapter the engine loads next to the base model."""

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description="Adapter name clients use as the model name.",
    )
    source: str | None = Field(
        None,
        min_length=1,
        max_length=512,
        description="Where vLLM loads the adapter from (a hub id, or a path under a mount): required on "
        "the vllm runtime, refused on the reference runtime, which loads no adapter weights.",
    )


#: ``maxSurge``/``maxUnavailable`` of a Deployment: a count, or a percentage of the replicas.
PERCENT_PATTERN = r"^(100|[1-9]?[0-9])%$"
IntOrPercent = Annotated[
    int | str,
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": PERCENT_PATTERN,
            "minimum": 0,
        }
    ),
]
ROLLOUT_BOTH_ZERO = "engine.rollout: maxSurge and maxUnavailable cannot both be 0 (no rollout could progress)"


def _is_zero(v: int | str | None) -> bool:
    return v is not None and str(v) in ("0", "0%")


class RolloutSpec(KubeModel):
    """How engine pods are replaced when a change needs new ones (the Deployment's RollingUpdate).

    Unset fields take the class's default: on a GPU class maxSurge 0 and maxUnavailable 1 (no extra
    accelerator is asked for, one replica is down at a time: a one-replica class is down while the new
    pod loads its model); on a CPU class maxSurge 1 and maxUnavailable 0. A maxSurge set above 0 with
    maxUnavailable unset means maxUnavailable 0: set maxSurge 1 on a GPU class to keep serving from the
    old pod while the new one starts, when the cluster has an accelerator to spare."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.maxSurge) || !has(self.maxUnavailable) || "
                    "!(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])",
                    "message": ROLLOUT_BOTH_ZERO,
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )

    max_surge: IntOrPercent | None = Field(
        None,
        alias="maxSurge",
        description="Pods above the replica count during a rollout (a count or a percentage).",
    )
    max_unavailable: IntOrPercent | None = Field(
        None,
        alias="maxUnavailable",
        description="Replicas that may be unavailable during a rollout (a count or a percentage).",
    )

    @field_validator("max_surge", "max_unavailable")
    @classmethod
    def _int_or_percent(cls, v: int | str | None) -> int | str | None:
        if v is None or (isinstance(v, int) and v >= 0):
            return v
        if isinstance(v, str) and re.fullmatch(PERCENT_PATTERN, v):
            return v
        raise ValueError(f"{v!r} is not a count (>= 0) or a percentage such as 25%")

    @model_validator(mode="after")
    def _not_both_zero(self) -> RolloutSpec:
        if _is_zero(self.max_surge) and _is_zero(self.max_unavailable):
            raise ValueError(ROLLOUT_BOTH_ZERO)
        return self

    def resolved(self, gpu: bool) -> tuple[int | str, int | str]:
        """(maxSurge, maxUnavailable): the class's defaults for what is unset (maxUnavailable 0 when
        a surge is asked for: the old pods serve until the new ones are ready); a default that would
        leave both 0 is 1 instead."""
        surge: int | str = self.max_surge if self.max_surge is not None else (0 if gpu else 1)
        unavailable: int | str
        if self.max_unavailable is not None:
            unavailable = self.max_unavailable
        elif self.max_surge is not None and not _is_zero(self.max_surge):
            unavailable = 0
        else:
            unavailable = 1 if gpu else 0
        if _is_zero(surge) and _is_zero(unavailable):
            if self.max_surge is None:
                surge = 1
            else:
                unavailable = 1
        return surge, unavailable


# --- where the weights come from and what else the engine pod may carry ------------------------
#: Where a model cache (``engine.modelCache``) is mounted; vLLM's HF_HOME lies under it.
MODEL_CACHE_PATH = "/cache"
HF_HOME_PATH = f"{MODEL_CACHE_PATH}/huggingface"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
MAX_EXTRA_ENV = 32
MAX_EXTRA_VOLUMES = 16
MODEL_CACHE_ON_REFERENCE = (
    "engine.modelCache applies to the vllm runtime only: the reference engine downloads no weights"
)
ADAPTER_SOURCE_ON_REFERENCE = (
    "engine.adapters[].source applies to the vllm runtime only: the reference engine loads no adapter "
    "weights (it derives each adapter from its name)"
)
ADAPTER_SOURCE_REQUIRED_ON_VLLM = (
    "engine.adapters[].source is required on the vllm runtime: it is where vLLM loads the adapter from"
)
TOKEN_ON_REFERENCE = (
    "engine.model.tokenSecretRef applies to the vllm runtime only: the reference engine downloads no weights"
)
MOUNT_WITHOUT_VOLUME = "engine.extraVolumeMounts: every mount must name a volume of engine.extraVolumes"
ADAPTER_NOT_MOUNTED = (
    "engine.adapters[].source: an absolute path must lie under a mountPath of engine.extraVolumeMounts "
    f"(or under {MODEL_CACHE_PATH}/ with engine.modelCache): nothing else is mounted where vLLM reads "
    "adapters; a Hugging Face repo id (org/name) is downloaded into the model cache"
)


class ClaimRef(KubeModel):
    """A PersistentVolumeClaim of the trust class's namespace that someone else manages."""

    name: str = Field(min_length=1, max_length=253, pattern=OBJECT_NAME, description="The claim.")


class ClaimRetention(KubeModel):
    """What happens to an operator-created claim when its TrustClass is deleted (as a StatefulSet's
    persistentVolumeClaimRetentionPolicy)."""

    when_deleted: Literal["Retain", "Delete"] = Field(
        "Retain",
        alias="whenDeleted",
        description="Retain (default): the claim survives the class, and so does the class namespace "
        "that holds it (the operator drops the namespace's owner reference instead of deleting it); a "
        "class created again with that namespace mounts the same claim. Delete: the claim is deleted "
        "with the class and its namespace.",
    )


AccessMode = Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"]


def _rwo() -> list[AccessMode]:
    return ["ReadWriteOnce"]


class VolumeClaimSpec(KubeModel):
    """A claim the operator creates per trust class (``kvfence-model-cache``)."""

    storage_class_name: str | None = Field(
        None,
        alias="storageClassName",
        min_length=1,
        max_length=253,
        pattern=OBJECT_NAME,
        description="StorageClass of the claim; unset: the cluster's default. Cannot change once the "
        "claim exists.",
    )
    size: ByteQuantity = Field(
        description="Requested size, e.g. 200Gi. May grow later (if the StorageClass allows expansion); "
        "a smaller size is refused."
    )
    access_modes: list[AccessMode] = Field(
        default_factory=_rwo,
        alias="accessModes",
        min_length=1,
        max_length=3,
        description="Access modes (default ReadWriteOnce: every replica must then run on the node that "
        "mounts it; ReadWriteMany for replicas on several nodes). Cannot change once the claim exists.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    retention_policy: ClaimRetention = Field(
        default_factory=ClaimRetention,
        alias="retentionPolicy",
        description="Whether the claim is deleted with the class.",
        json_schema_extra={"default": {}},
    )


class ModelCacheSpec(KubeModel):
    """Where the engine keeps downloaded weights (HF_HOME), so that a restart does not download them
    again. Unset: an emptyDir (downloads on every start)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.existingClaim) != has(self.volumeClaim)",
                    "message": "engine.modelCache: set exactly one of existingClaim and volumeClaim",
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )

    existing_claim: ClaimRef | None = Field(
        None,
        alias="existingClaim",
        description="A claim of the class's namespace; the operator never creates, changes or deletes "
        "it, and keeps the namespace when the class is deleted.",
    )
    volume_claim: VolumeClaimSpec | None = Field(
        None, alias="volumeClaim", description="A claim the operator creates for the class."
    )

    @model_validator(mode="after")
    def _one(self) -> ModelCacheSpec:
        if (self.existing_claim is None) == (self.volume_claim is None):
            raise ValueError("engine.modelCache: set exactly one of existingClaim and volumeClaim")
        return self

    @property
    def retained(self) -> bool:
        """Whether the claim outlives the class (an existing one always does)."""
        return self.volume_claim is None or self.volume_claim.retention_policy.when_deleted == "Retain"


class LocalObjectReference(KubeModel):
    """An object of the trust class's namespace, by name."""

    name: str = Field(min_length=1, max_length=253, pattern=OBJECT_NAME, description="Its name.")


class EnvKeyRef(KubeModel):
    """A key of a Secret or ConfigMap in the trust class's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=OBJECT_NAME, description="The object.")
    key: str = Field(min_length=1, max_length=253, pattern=DATA_KEY, description="The key.")


class EnvVarSource(KubeModel):
    """Where an extra env var's value comes from."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.secretKeyRef) != has(self.configMapKeyRef)",
                    "message": "valueFrom: set exactly one of secretKeyRef and configMapKeyRef",
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )

    secret_key_ref: EnvKeyRef | None = Field(None, alias="secretKeyRef", description="A Secret's key.")
    config_map_key_ref: EnvKeyRef | None = Field(
        None, alias="configMapKeyRef", description="A ConfigMap's key."
    )

    @model_validator(mode="after")
    def _one(self) -> EnvVarSource:
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise ValueError("valueFrom: set exactly one of secretKeyRef and configMapKeyRef")
        return self


class EnvVar(KubeModel):
    """An extra environment variable of the engine container."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                env_rule(),
                {
                    "rule": "has(self.value) != has(self.valueFrom)",
                    "messageExpression": "'engine.extraEnv: ' + self.name + ': set exactly one of value "
                    "and valueFrom'",
                    "reason": "FieldValueInvalid",
                },
            ]
        }
    )

    name: str = Field(
        min_length=1, max_length=128, pattern=ENV_NAME_PATTERN, description="Variable name (a C identifier)."
    )
    value: str | None = Field(None, max_length=4096, description="The value.")
    value_from: EnvVarSource | None = Field(
        None, alias="valueFrom", description="The value, from a Secret or ConfigMap key."
    )

    @model_validator(mode="after")
    def _checked(self) -> EnvVar:
        why = env_refusal(self.name)
        if why is not None:
            raise ValueError(why)
        if (self.value is None) == (self.value_from is None):
            raise ValueError(f"engine.extraEnv: {self.name}: set exactly one of value and valueFrom")
        return self


class ConfigMapVolume(KubeModel):
    """A ConfigMap of the class's namespace as files."""

    name: str = Field(min_length=1, max_length=253, pattern=OBJECT_NAME, description="The ConfigMap.")


class SecretVolume(KubeModel):
    """A Secret of the class's namespace as files."""

    secret_name: str = Field(
        alias="secretName", min_length=1, max_length=253, pattern=OBJECT_NAME, description="The Secret."
    )


class ClaimVolume(KubeModel):
    """A PersistentVolumeClaim of the class's namespace (adapters, weights prepared elsewhere)."""

    claim_name: str = Field(
        alias="claimName", min_length=1, max_length=253, pattern=OBJECT_NAME, description="The claim."
    )
    read_only: bool = Field(True, alias="readOnly", description="Mount read-only (default true).")


class EmptyDirVolume(KubeModel):
    """Scratch space that lives as long as the pod."""

    size_limit: ByteQuantity | None = Field(None, alias="sizeLimit", description="Most it may hold.")


class ExtraVolume(KubeModel):
    """An extra volume of the engine pod: a ConfigMap, a Secret, a claim or an emptyDir (nothing that
    reaches the node, such as hostPath)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "[has(self.configMap), has(self.secret), has(self.persistentVolumeClaim), "
                    "has(self.emptyDir)].filter(x, x).size() == 1",
                    "messageExpression": "'engine.extraVolumes[' + self.name + ']: set exactly one of "
                    "configMap, secret, persistentVolumeClaim and emptyDir'",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": f"!(self.name in {list(RESERVED_VOLUMES)})",
                    "messageExpression": "'engine.extraVolumes: ' + self.name + ' is a volume kvfence "
                    f"mounts itself ({', '.join(RESERVED_VOLUMES)}): choose another name'",
                    "fieldPath": ".name",
                    "reason": "FieldValueForbidden",
                },
            ]
        }
    )

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL, description="Volume name.")
    config_map: ConfigMapVolume | None = Field(None, alias="configMap", description="A ConfigMap.")
    secret: SecretVolume | None = Field(None, description="A Secret.")
    persistent_volume_claim: ClaimVolume | None = Field(
        None, alias="persistentVolumeClaim", description="A claim."
    )
    empty_dir: EmptyDirVolume | None = Field(None, alias="emptyDir", description="An emptyDir.")

    @model_validator(mode="after")
    def _checked(self) -> ExtraVolume:
        if self.name in RESERVED_VOLUMES:
            raise ValueError(
                f"engine.extraVolumes: {self.name} is a volume kvfence mounts itself "
                f"({', '.join(RESERVED_VOLUMES)}): choose another name"
            )
        kinds = [self.config_map, self.secret, self.persistent_volume_claim, self.empty_dir]
        if sum(k is not None for k in kinds) != 1:
            raise ValueError(
                f"engine.extraVolumes[{self.name}]: set exactly one of configMap, secret, "
                "persistentVolumeClaim and emptyDir"
            )
        return self

    def pod_volume(self) -> dict[str, Any]:
        """The core/v1 Volume."""
        out: dict[str, Any] = {"name": self.name}
        if self.config_map is not None:
            out["configMap"] = {"name": self.config_map.name}
        elif self.secret is not None:
            out["secret"] = {"secretName": self.secret.secret_name}
        elif self.persistent_volume_claim is not None:
            c = self.persistent_volume_claim
            out["persistentVolumeClaim"] = {"claimName": c.claim_name, "readOnly": c.read_only}
        else:
            assert self.empty_dir is not None
            out["emptyDir"] = self.empty_dir.wire()
        return out


class ExtraVolumeMount(KubeModel):
    """Where an extra volume is mounted in the engine container."""

    name: str = Field(
        min_length=1, max_length=63, pattern=DNS_LABEL, description="A volume of engine.extraVolumes."
    )
    mount_path: str = Field(
        alias="mountPath",
        min_length=1,
        max_length=512,
        pattern=EXTRA_MOUNT_PATTERN,
        description="An absolute path at or under " + ", ".join(EXTRA_MOUNT_ROOTS) + " (no . or .. "
        "segments): nothing kvfence or the engine image relies on lives there.",
    )
    read_only: bool = Field(True, alias="readOnly", description="Mount read-only (default true).")


class EngineSpec(KubeModel):
    """The inference engine of the trust class."""

    # On the engine, not the spec: CRD validation ratcheting then lets an object stored by an older CRD
    # (which defaulted both fields onto every class) be updated while its engine section is unchanged.
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.runtime != 'vllm' || !has(self.numBlocks)",
                    "message": NUM_BLOCKS_ON_VLLM,
                    "fieldPath": ".numBlocks",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "self.runtime != 'reference' || !has(self.gpuMemoryUtilization)",
                    "message": GPU_MEMORY_UTILIZATION_ON_REFERENCE,
                    "fieldPath": ".gpuMemoryUtilization",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "self.runtime != 'reference' || !has(self.device) || self.device == 'CPU'",
                    "message": GPU_DEVICE_ON_REFERENCE,
                    "fieldPath": ".device",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "self.runtime != 'reference' || !has(self.kvCacheMemory)",
                    "message": KV_CACHE_MEMORY_ON_REFERENCE,
                    "fieldPath": ".kvCacheMemory",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "self.runtime != 'vllm' || !has(self.device) || self.device != 'CPU' "
                    "|| has(self.kvCacheMemory)",
                    "message": KV_CACHE_MEMORY_REQUIRED_ON_CPU,
                    "fieldPath": ".kvCacheMemory",
                    "reason": "FieldValueRequired",
                },
                {
                    "rule": "!has(self.kvCacheMemory) || !has(self.gpuMemoryUtilization)",
                    "message": KV_CACHE_MEMORY_AND_GPU_MEMORY_UTILIZATION,
                    "fieldPath": ".kvCacheMemory",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "self.runtime != 'reference' || !has(self.adapters) "
                    "|| self.adapters.all(a, !has(a.source))",
                    "message": ADAPTER_SOURCE_ON_REFERENCE,
                    "fieldPath": ".adapters",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "self.runtime != 'vllm' || !has(self.adapters) "
                    "|| self.adapters.all(a, has(a.source))",
                    "message": ADAPTER_SOURCE_REQUIRED_ON_VLLM,
                    "fieldPath": ".adapters",
                    "reason": "FieldValueRequired",
                },
                {
                    "rule": "self.runtime != 'reference' || !has(self.modelCache)",
                    "message": MODEL_CACHE_ON_REFERENCE,
                    "fieldPath": ".modelCache",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "self.runtime != 'reference' || !has(self.model.tokenSecretRef)",
                    "message": TOKEN_ON_REFERENCE,
                    "fieldPath": ".model.tokenSecretRef",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "!has(self.extraVolumeMounts) || self.extraVolumeMounts.all(m, "
                    "has(self.extraVolumes) && self.extraVolumes.exists(v, v.name == m.name))",
                    "message": MOUNT_WITHOUT_VOLUME,
                    "fieldPath": ".extraVolumeMounts",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "self.runtime != 'vllm' || !has(self.adapters) || self.adapters.all(a, "
                    "!has(a.source) || !a.source.startsWith('/') "
                    "|| (has(self.extraVolumeMounts) && self.extraVolumeMounts.exists(m, "
                    "a.source == m.mountPath || a.source.startsWith(m.mountPath + '/'))) "
                    f"|| (has(self.modelCache) && a.source.startsWith('{MODEL_CACHE_PATH}/')))",
                    "message": ADAPTER_NOT_MOUNTED,
                    "fieldPath": ".adapters",
                    "reason": "FieldValueInvalid",
                },
                *extra_args_runtime_rules(),
            ]
        }
    )

    runtime: Runtime = Field(
        "reference",
        description="vllm (stock vLLM with the kvfence middleware) or reference (the kvfence CPU engine).",
    )
    image: str = Field(min_length=1, max_length=1024, description="Container image of the engine.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", alias="imagePullPolicy", description="Image pull policy of the engine container."
    )
    device: Device | None = Field(
        None,
        description="Where vllm runs: GPU (unset means GPU) or CPU, vLLM's CPU backend in an image built "
        "for it (engine-image/Dockerfile.vllm-cpu); CPU needs resources.gpu.count 0 and kvCacheMemory. "
        "The reference runtime runs on CPU only (unset or CPU).",
    )
    model: ModelSpec = Field(description="The base model.")
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=64,
        description="LoRA adapters served by this engine (tenants may be limited to a subset).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    quantization: str | None = Field(
        None,
        max_length=64,
        pattern=r"^[a-z0-9_-]+$",
        description="Quantization method (e.g. awq, gptq, fp8); part of every prefix-cache key.",
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto", description="Activation/weight dtype."
    )
    tensor_parallel_size: int = Field(
        1, alias="tensorParallelSize", ge=1, le=64, description="GPUs one replica shards the model over."
    )
    max_model_len: int | None = Field(
        None, alias="maxModelLen", ge=1, description="Maximum context length (prompt plus output tokens)."
    )
    gpu_memory_utilization: float | None = Field(
        None,
        alias="gpuMemoryUtilization",
        gt=0,
        le=1,
        description="Fraction of GPU memory vLLM may use (weights, activations and the KV pool, which "
        "vLLM sizes from it). vllm only; unset: vLLM's own default. Refused on the reference runtime, "
        "which runs on CPU (its pool is numBlocks).",
    )
    kv_cache_memory: ByteQuantity | None = Field(
        None,
        alias="kvCacheMemory",
        description="Memory of vLLM's KV cache per replica (vLLM's --kv-cache-memory-bytes), a whole "
        "number of bytes such as 1Gi. vllm only; required with device CPU; on GPU it replaces "
        "gpuMemoryUtilization (set one of them). Refused on the reference runtime (its pool is numBlocks).",
    )
    block_size: int | None = Field(
        None,
        alias="blockSize",
        ge=1,
        le=256,
        description="Tokens per KV-cache block. Unset: the runtime's default (16 on the reference "
        "engine; vllm keeps its attention backend's choice). Set on vllm, it must be a size that backend "
        "supports (vLLM's CPU backend needs a multiple of 32).",
    )
    num_blocks: int | None = Field(
        None,
        alias="numBlocks",
        ge=1,
        description=f"KV-cache blocks in the reference engine's pool; unset: {DEFAULT_NUM_BLOCKS}. "
        "Reference only: refused on vllm, which sizes its pool from GPU memory (gpuMemoryUtilization).",
    )
    port: int = Field(8000, ge=1, le=65535, description="Port the engine serves HTTP on.")
    extra_args: list[str] = Field(
        default_factory=list,
        alias="extraArgs",
        max_length=128,
        description="Extra command-line arguments appended to the runtime's own (vllm serve or "
        "kvfence-engine). Only flags on the runtime's allowlist, spelled out in full (no abbreviations or "
        "short forms): tuning that changes neither what the engine loads nor how it treats a tenant's "
        "request. Flags kvfence sets from the class's own fields, and flags that would undo tenant "
        "isolation, are refused with the reason (kvfence.api.policy.engine_args, docs/operations.md).",
        json_schema_extra={
            "items": {
                "type": "string",
                "maxLength": MAX_EXTRA_ARG_LENGTH,
                "x-kubernetes-validations": [extra_arg_item_rule()],
            }
        },
    )
    model_cache: ModelCacheSpec | None = Field(
        None,
        alias="modelCache",
        description=f"Where downloaded weights are kept (HF_HOME={HF_HOME_PATH}, the claim mounted at "
        f"{MODEL_CACHE_PATH}): an existing claim, or one the operator creates. Unset: an emptyDir, so "
        "every engine start downloads the model again. vllm only.",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        alias="imagePullSecrets",
        max_length=16,
        description="Secrets of the class's namespace the kubelet pulls the engine image with.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    extra_env: list[EnvVar] = Field(
        default_factory=list,
        alias="extraEnv",
        max_length=MAX_EXTRA_ENV,
        description="Extra environment variables of the engine container (a value, or a Secret's or "
        "ConfigMap's key in the class's namespace). Only names on the allowlist (thread counts, CUDA and "
        "NCCL tuning, hub download settings, proxies, vLLM's logging and timeouts); every other name, "
        "CUSTOM_*, VLLM_PLUGINS, PYTHON* and LD_* among them, is refused with the reason "
        "(kvfence.api.policy.engine_env, docs/operations.md).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    extra_volumes: list[ExtraVolume] = Field(
        default_factory=list,
        alias="extraVolumes",
        max_length=MAX_EXTRA_VOLUMES,
        description="Extra volumes of the engine pod: configMap, secret, persistentVolumeClaim or "
        "emptyDir, never a volume kvfence mounts itself (" + ", ".join(RESERVED_VOLUMES) + ").",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    extra_volume_mounts: list[ExtraVolumeMount] = Field(
        default_factory=list,
        alias="extraVolumeMounts",
        max_length=MAX_EXTRA_VOLUMES,
        description="Where extra volumes are mounted in the engine container: at or under "
        + ", ".join(EXTRA_MOUNT_ROOTS)
        + ", read-only unless readOnly is false. An adapter's absolute source must lie under one.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["mountPath"]},
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="How engine pods are replaced when a change needs new ones. Signing-key rotations, "
        "quotas and shared prefixes reach running engines without new pods.",
    )

    @model_validator(mode="after")
    def _runtime_fields(self) -> EngineSpec:
        """The CRD's rules on the runtime-only fields, for what the operator reads.

        Exceptions: the values the 0.1.0 CRD defaulted onto every stored object read as unset on the
        runtime that ignores them, and so do adapter sources on the reference runtime (which earlier
        CRDs required there and the reference engine never read), so that existing classes keep
        working after an upgrade (the API server refuses them there on every new write).
        """
        if self.runtime == "reference":
            for a in self.adapters:
                a.source = None
        if self.runtime == "vllm" and self.num_blocks == LEGACY_DEFAULT_NUM_BLOCKS:
            self.num_blocks = None
        if (
            self.runtime == "reference"
            and self.gpu_memory_utilization == LEGACY_DEFAULT_GPU_MEMORY_UTILIZATION
        ):
            self.gpu_memory_utilization = None
        if self.runtime == "vllm" and self.num_blocks is not None:
            raise ValueError(NUM_BLOCKS_ON_VLLM)
        if self.runtime == "reference" and self.gpu_memory_utilization is not None:
            raise ValueError(GPU_MEMORY_UTILIZATION_ON_REFERENCE)
        if self.runtime == "reference" and self.device == "GPU":
            raise ValueError(GPU_DEVICE_ON_REFERENCE)
        if self.runtime == "reference" and self.kv_cache_memory is not None:
            raise ValueError(KV_CACHE_MEMORY_ON_REFERENCE)
        if self.on_vllm_cpu and self.kv_cache_memory is None:
            raise ValueError(KV_CACHE_MEMORY_REQUIRED_ON_CPU)
        if self.kv_cache_memory is not None and self.gpu_memory_utilization is not None:
            raise ValueError(KV_CACHE_MEMORY_AND_GPU_MEMORY_UTILIZATION)
        if self.runtime == "reference" and self.model_cache is not None:
            raise ValueError(MODEL_CACHE_ON_REFERENCE)
        if self.runtime == "reference" and self.model.token_secret_ref is not None:
            raise ValueError(TOKEN_ON_REFERENCE)
        if self.runtime == "vllm" and any(a.source is None for a in self.adapters):
            raise ValueError(ADAPTER_SOURCE_REQUIRED_ON_VLLM)
        return self

    @model_validator(mode="after")
    def _pod_extras(self) -> EngineSpec:
        """The CRD's rules on extra mounts and adapter sources, for what the operator reads."""
        volumes = {v.name for v in self.extra_volumes}
        for m in self.extra_volume_mounts:
            if m.name not in volumes:
                raise ValueError(f"{MOUNT_WITHOUT_VOLUME}: {m.name} is not one")
        if self.runtime == "vllm":
            roots = [m.mount_path for m in self.extra_volume_mounts]
            if self.model_cache is not None:
                roots.append(MODEL_CACHE_PATH + "/")
            for a in self.adapters:
                if (
                    a.source
                    and a.source.startswith("/")
                    and not any(
                        under(a.source, r) if not r.endswith("/") else a.source.startswith(r) for r in roots
                    )
                ):
                    raise ValueError(f"{ADAPTER_NOT_MOUNTED}: {a.name} reads {a.source}")
        return self

    @property
    def on_vllm_cpu(self) -> bool:
        """vLLM on its CPU backend (``device: CPU``)."""
        return self.runtime == "vllm" and self.device == "CPU"

    @property
    def kv_block_budget(self) -> int:
        """The KV blocks the operator counts the tenants' guaranteed blocks against.

        The reference engine's pool: numBlocks, or its default. vLLM sizes its pool from GPU memory when
        it starts, so the operator cannot see it; it budgets the same fixed number on vllm (what
        numBlocks defaulted to while it was accepted there), and vLLM's fence checks the guarantees
        against its real pool as well.
        """
        return self.num_blocks if self.num_blocks is not None else DEFAULT_NUM_BLOCKS


class GPUResources(KubeModel):
    """Accelerators per engine replica."""

    count: int = Field(1, ge=0, le=64, description="Accelerators per replica; 0 for a CPU-only engine.")
    resource_name: str = Field(
        "nvidia.com/gpu",
        alias="resourceName",
        max_length=253,
        pattern=RESOURCE_NAME,
        description="Extended resource to request, e.g. nvidia.com/gpu or MIG nvidia.com/mig-1g.10gb.",
    )


class ResourcesSpec(KubeModel):
    """Compute resources of one engine replica (requests equal limits)."""

    gpu: GPUResources = Field(
        default_factory=GPUResources,
        description="Accelerators, requested and limited with the same count.",
        json_schema_extra={"default": {}},
    )
    cpu: Quantity | None = Field(None, description="CPU request and limit, e.g. 4 or 500m.")
    memory: Quantity | None = Field(None, description="Memory request and limit, e.g. 32Gi.")


class DedicatedNodes(KubeModel):
    """Keep this trust class's engines on nodes that run no other trust class."""

    enabled: bool = Field(
        False,
        description="Require nodes without pods of any other trust class (required pod anti-affinity, "
        "which the scheduler also enforces for the other classes' pods).",
    )
    tolerate_taint: bool = Field(
        False,
        alias="tolerateTaint",
        description="Also tolerate the taint kvfence.dev/trust-class=<name>:NoSchedule so that nodes an "
        "administrator tainted for this class accept its engines.",
    )


class PlacementSpec(KubeModel):
    """Where engine pods may run."""

    node_selector: dict[str, str] = Field(
        default_factory=dict, alias="nodeSelector", description="Node labels the engine pods require."
    )
    tolerations: list[FreeForm] = Field(
        default_factory=list, description="Tolerations (core/v1 Toleration) of the engine pods."
    )
    affinity: FreeForm | None = Field(
        None, description="Affinity (core/v1 Affinity) of the engine pods, merged with dedicatedNodes."
    )
    runtime_class_name: str | None = Field(
        None, alias="runtimeClassName", max_length=253, description="RuntimeClass of the pods (e.g. nvidia)."
    )
    priority_class_name: str | None = Field(
        None, alias="priorityClassName", max_length=253, description="PriorityClass of the engine pods."
    )
    dedicated_nodes: DedicatedNodes = Field(
        default_factory=DedicatedNodes,
        alias="dedicatedNodes",
        description="Isolation from other trust classes at node level.",
        json_schema_extra={"default": {}},
    )


SHARED_PREFIX_MAX = 32
SHARED_PREFIX_MAX_CHARS = 65536


class ConfigMapKeyRef(KubeModel):
    """A key of a ConfigMap in the trust class's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=RESOURCE_NAME, description="The ConfigMap.")
    key: str = Field(
        min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="The key holding the text."
    )


class SharedPrefixSpec(KubeModel):
    """A prefix every tenant of the class may share (its blocks are computed once and pinned)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.text) != has(self.configMapKeyRef)",
                    "message": "set exactly one of text and configMapKeyRef",
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL, description="Unique within the class.")
    form: Literal["chat", "completion"] = Field(
        description="chat: the content of the system message chat requests start with; completion: the "
        "text completion prompts start with."
    )
    text: str | None = Field(
        None, min_length=1, max_length=SHARED_PREFIX_MAX_CHARS, description="The prefix, inline."
    )
    config_map_key_ref: ConfigMapKeyRef | None = Field(
        None,
        alias="configMapKeyRef",
        description="The prefix, from a ConfigMap key in the class's namespace (label the ConfigMap "
        "kvfence.dev/shared-prefixes=true so that its changes reach the engines within seconds).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> SharedPrefixSpec:
        if (self.text is None) == (self.config_map_key_ref is None):
            raise ValueError(f"sharedPrefixes[{self.name}]: set exactly one of text and configMapKeyRef")
        return self


class PrefixCacheSpec(KubeModel):
    """Prefix (KV) cache behaviour inside the engine."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.sharedPrefixes) || "
                    "self.sharedPrefixes.all(p, self.sharedPrefixes.exists_one(q, q.name == p.name))",
                    "message": "sharedPrefixes names must be unique",
                    "fieldPath": ".sharedPrefixes",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "!has(self.sharedPrefixes) || size(self.sharedPrefixes) == 0 || self.enabled",
                    "message": "sharedPrefixes needs the prefix cache (enabled: true)",
                    "fieldPath": ".sharedPrefixes",
                    "reason": "FieldValueInvalid",
                },
            ]
        }
    )

    enabled: bool = Field(True, description="Reuse KV blocks of identical prefixes.")
    scope: CacheScope = Field(
        CacheScope.TENANT,
        description="Who may share cached prefixes: Tenant (only the same tenant) or TrustClass (every "
        "tenant of this class).",
    )
    hash_algorithm: HashAlgorithm = Field(
        "sha256",
        alias="hashAlgorithm",
        description="Collision-resistant hash of the prefix-cache keys: sha256 or blake2b (reference only).",
    )
    shared_prefixes: list[SharedPrefixSpec] = Field(
        default_factory=list,
        alias="sharedPrefixes",
        max_length=SHARED_PREFIX_MAX,
        description="Declared prefixes (system prompts, tool preambles: nothing secret) that every tenant "
        "of the class shares: computed at engine start, pinned outside every quota and eviction, and a "
        "hit for any request that begins with one, token for token. Everything after the last full "
        "block of a prefix stays in the tenant's own namespace. Changes reach running engines without "
        "a restart.",
    )

    @model_validator(mode="after")
    def _shared(self) -> PrefixCacheSpec:
        names = [p.name for p in self.shared_prefixes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"sharedPrefixes names must be unique: {', '.join(dup)} repeated")
        if self.shared_prefixes and not self.enabled:
            raise ValueError("sharedPrefixes needs the prefix cache (enabled: true)")
        return self


REPLICAS_EXTERNAL = (
    "spec.replicas must be unset with replicasManagedExternally: an HPA or KEDA ScaledObject in the "
    "class namespace sizes deployment/kvfence-engine; scale that, and remove spec.replicas "
    '(kubectl patch trustclass NAME --type json -p \'[{"op":"remove","path":"/spec/replicas"}]\')'
)


class QuotaSpec(KubeModel):
    """Per-tenant quotas of this trust class."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"!has(self.defaults) || !has(self.limits) || !has(self.defaults.{f}) "
                    f"|| !has(self.limits.{f}) || self.defaults.{f} <= self.limits.{f}",
                    "message": f"defaults.{f} must not exceed limits.{f}",
                    "fieldPath": f".defaults.{f}",
                    "reason": "FieldValueInvalid",
                }
                for f in QUOTA_FIELDS
            ]
        }
    )

    defaults: TenantQuotas = Field(
        default_factory=TenantQuotas,
        description="Quotas of a tenant whose binding sets none.",
        json_schema_extra={"default": {}},
    )
    limits: TenantQuotas = Field(
        default_factory=TenantQuotas,
        description="The most a binding may ask for; a binding above a limit is Denied.",
        json_schema_extra={"default": {}},
    )


class TrustClassSpec(KubeModel):
    """Desired state of a trust class."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.__namespace__) == has(oldSelf.__namespace__) && "
                    "(!has(self.__namespace__) || self.__namespace__ == oldSelf.__namespace__)",
                    "message": "namespace is immutable",
                    "fieldPath": ".namespace",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "!has(self.replicasManagedExternally) || !self.replicasManagedExternally "
                    "|| !has(self.replicas)",
                    "message": REPLICAS_EXTERNAL,
                    "fieldPath": ".replicas",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "self.engine.runtime != 'vllm' || self.prefixCache.hashAlgorithm == 'sha256'",
                    "message": "the vllm runtime supports only the sha256 prefix-cache hash",
                    "fieldPath": ".prefixCache.hashAlgorithm",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "self.resources.gpu.count == 0 || "
                    "self.engine.tensorParallelSize <= self.resources.gpu.count",
                    "message": "engine.tensorParallelSize must not exceed resources.gpu.count",
                    "fieldPath": ".engine.tensorParallelSize",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "self.engine.runtime != 'vllm' || self.resources.gpu.count >= 1 "
                    "|| (has(self.engine.device) && self.engine.device == 'CPU')",
                    "message": "the vllm runtime needs at least one GPU (resources.gpu.count), unless "
                    "engine.device is CPU",
                    "fieldPath": ".resources.gpu.count",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "!has(self.engine.device) || self.engine.device != 'CPU' "
                    "|| self.resources.gpu.count == 0",
                    "message": GPU_COUNT_ON_CPU,
                    "fieldPath": ".resources.gpu.count",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "!has(self.quotas.limits.maxKVBlocks) || self.engine.runtime != 'reference' "
                    "|| self.quotas.limits.maxKVBlocks <= "
                    f"(has(self.engine.numBlocks) ? self.engine.numBlocks : {DEFAULT_NUM_BLOCKS})",
                    "message": "quotas.limits.maxKVBlocks must not exceed engine.numBlocks "
                    f"({DEFAULT_NUM_BLOCKS} when unset)",
                    "fieldPath": ".quotas.limits.maxKVBlocks",
                    "reason": "FieldValueInvalid",
                },
            ]
        }
    )

    namespace: str | None = Field(
        None,
        max_length=63,
        pattern=DNS_LABEL,
        description="Namespace holding this class's engine and its configuration (created and owned by "
        "the operator); defaults to kvf-<name>. Immutable.",
    )
    engine: EngineSpec = Field(description="The engine that serves this class's tenants.")
    replicas: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="Engine replicas (unset: 1); also written through the /scale subresource (kubectl "
        "scale). Must be unset with replicasManagedExternally.",
    )
    replicas_managed_externally: bool = Field(
        False,
        alias="replicasManagedExternally",
        description="The engine Deployment's replicas are sized by something else: an HPA or a KEDA "
        "ScaledObject in the class's namespace targeting deployment/kvfence-engine (an autoscaler's "
        "target must be in its own namespace; a TrustClass is cluster-scoped). The operator then never "
        "sets them (it keeps the current count when it hands them over) and status shows the "
        "Deployment's desired and ready replicas.",
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec,
        description="Compute resources per engine replica.",
        json_schema_extra={"default": {}},
    )
    placement: PlacementSpec = Field(
        default_factory=PlacementSpec,
        description="Scheduling constraints of the engine pods.",
        json_schema_extra={"default": {}},
    )
    prefix_cache: PrefixCacheSpec = Field(
        default_factory=PrefixCacheSpec,
        alias="prefixCache",
        description="Prefix-cache configuration.",
        json_schema_extra={"default": {}},
    )
    quotas: QuotaSpec = Field(
        default_factory=QuotaSpec,
        description="Per-tenant quota defaults and limits.",
        json_schema_extra={"default": {}},
    )
    request_limits: RequestLimitsSpec | None = Field(
        None,
        alias="requestLimits",
        description="What one request may ask of the engine (prompts, n, stop strings, grammar size, "
        "...); the router refuses more with a 400 naming the field. Unset fields: the defaults.",
    )
    namespace_selector: LabelSelector | None = Field(
        None,
        alias="namespaceSelector",
        description="Namespaces whose TenantBindings may bind to this class. Unset: none; {}: all.",
    )

    @model_validator(mode="after")
    def _device_resources(self) -> TrustClassSpec:
        """The CRD's rule on a CPU engine's GPUs, for what the operator reads."""
        if self.engine.device == "CPU" and self.resources.gpu.count > 0:
            raise ValueError(GPU_COUNT_ON_CPU)
        return self

    @model_validator(mode="after")
    def _replicas_owner(self) -> TrustClassSpec:
        if self.replicas_managed_externally and self.replicas is not None:
            raise ValueError(REPLICAS_EXTERNAL)
        return self

    @property
    def desired_replicas(self) -> int:
        """The replicas the spec asks for (meaningless with replicasManagedExternally)."""
        return 1 if self.replicas is None else self.replicas


class TrustClassStatus(KubeModel):
    """Observed state of a trust class."""

    observed_generation: int | None = Field(
        None, alias="observedGeneration", description="The .metadata.generation last reconciled."
    )
    conditions: list[Condition] = conditions_field(
        "Ready, Progressing and Degraded; Reconciling and Stalled as kstatus (Flux, kpt) reads them."
    )
    namespace: str | None = Field(None, description="The namespace holding the engine.")
    endpoint: str | None = Field(None, description="URL of the engine Service, as the router reaches it.")
    desired_replicas: int | None = Field(
        None,
        alias="desiredReplicas",
        description="Engine replicas asked for: spec.replicas, or with replicasManagedExternally the "
        "engine Deployment's (as its autoscaler set them).",
    )
    replicas: int | None = Field(None, description="Engine pods that exist.")
    ready_replicas: int | None = Field(None, alias="readyReplicas", description="Engine pods that are ready.")
    bound_tenants: int | None = Field(None, alias="boundTenants", description="Tenants bound to this class.")
    selector: str | None = Field(
        None,
        description="Label selector of the engine pods (in status.namespace), as the /scale subresource "
        "reports it.",
    )
    signing_key_id: str | None = Field(
        None, alias="signingKeyId", description="Public fingerprint of the key the router signs with."
    )
    accepted_spec: dict[str, Any] | None = Field(
        None,
        alias="acceptedSpec",
        description="The last spec the operator rendered and applied. A later spec it cannot accept "
        "(InvalidSpec) leaves the class routed with this one, Degraded, until the spec is fixed.",
    )
    accepted_generation: int | None = Field(
        None, alias="acceptedGeneration", description="The .metadata.generation of acceptedSpec."
    )


class TrustClass(KubeModel):
    """A trust class: tenants that may share one engine. Different classes never share an engine."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
                    "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters",
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )

    api_version: str = Field("kvfence.dev/v1alpha1", alias="apiVersion", description="API version.")
    kind: str = Field(KIND, description="Kind.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: TrustClassSpec = Field(description="Desired state.")
    status: TrustClassStatus = Field(default_factory=TrustClassStatus, description="Observed state.")

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))

    @property
    def target_namespace(self) -> str:
        return self.spec.namespace or default_namespace(self.name)


def default_namespace(name: str) -> str:
    return f"{NAMESPACE_PREFIX}{name}"
