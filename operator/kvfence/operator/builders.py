"""Pure manifest builders: a TrustClass in, Kubernetes objects (plain dicts) out.

Nothing here talks to the API server, reads the clock or draws random numbers; every function is a
deterministic map from its arguments, so the unit tests exercise them without a cluster and the
reconciler can compare what it would apply with what is there.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfence.api.common import API_VERSION, TenantQuotas, quantity_bytes
from kvfence.api.policy.engine_args import extra_args_refusal
from kvfence.api.trustclass import HF_HOME_PATH, MODEL_CACHE_PATH, TrustClass
from kvfence.contract import key_id
from kvfence.contract.engine_config import (
    ENV_ENGINE_CONFIG,
    ENV_VLLM_STATS_FILE,
    READY_PATH,
    SIGNING_KEY_CURRENT,
    SIGNING_KEY_PREVIOUS,
    EngineConfig,
)

Obj = dict[str, Any]

FIELD_MANAGER = "kvfence-operator"
#: Takes the engine Deployment's replicas over from the operator when a class switches to
#: replicasManagedExternally, so that the count stays as it is until the autoscaler writes its own.
REPLICAS_HANDOVER_MANAGER = "kvfence-replicas-handover"
APP = "kvfence"
ENGINE_APP = "kvfence-engine"

# --- names of the children in a trust class's namespace ---------------------------------------
ENGINE_NAME = "kvfence-engine"
CONFIG_NAME = "kvfence-engine-config"
SIGNING_SECRET_NAME = "kvfence-signing-key"
#: The ClusterRole a namespace binds to let the operator read its Secrets (rbac.py builds it).
TENANT_SECRETS_ROLE = "kvfence-operator-tenant-secrets"
NETWORK_POLICY_NAME = "kvfence-engine-ingress"
#: The model-cache claim the operator creates (``engine.modelCache.volumeClaim``).
MODEL_CACHE_CLAIM = "kvfence-model-cache"
CONFIG_KEY = "engine.json"
CONFIG_DIR = "/etc/kvfence/config"
KEY_DIR = "/etc/kvfence/keys"

# --- labels and annotations -------------------------------------------------------------------
LABEL_TRUST_CLASS = "kvfence.dev/trust-class"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
ANNOTATION_CONFIG_HASH = "kvfence.dev/config-hash"
ANNOTATION_KEY_ID = "kvfence.dev/signing-key-id"
ANNOTATION_ROTATE = "kvfence.dev/rotate-signing-key"
ANNOTATION_ROTATED_FOR = "kvfence.dev/rotated-for"
#: On the signing Secret: when its current key replaced the previous one (RFC 3339). The router keeps
#: signing with the previous key until this plus the key propagation delay has passed.
ANNOTATION_ROTATED_AT = "kvfence.dev/signing-key-rotated-at"
ANNOTATION_SPEC_HASH = "kvfence.dev/spec-hash"
TAINT_KEY = LABEL_TRUST_CLASS
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"

RUN_AS_USER = 65532
TMP_DIR = "/tmp"  # noqa: S108 - an emptyDir of the pod
SHM_DIR = "/dev/shm"  # noqa: S108 - a memory emptyDir for NCCL
DEFAULT_MAX_MODEL_LEN = 2048
#: The reference engine's block size when the TrustClass sets none (vLLM keeps its backend's choice).
DEFAULT_BLOCK_SIZE = 16

# --- the vLLM runtime -------------------------------------------------------------------------
VLLM_MIDDLEWARE = "kvfence.vllm.middleware.KvfenceMiddleware"
VLLM_SCHEDULER = "kvfence.vllm.scheduler.FencedScheduler"
#: Where the kvfence scheduler (in vLLM's engine-core process) writes its counters and the middleware
#: (in the API-server process) reads them for /metrics: a file in the pod's /tmp emptyDir.
VLLM_STATS_FILE_ENV = ENV_VLLM_STATS_FILE
VLLM_STATS_FILE = f"{TMP_DIR}/kvfence-vllm-stats.json"
#: The environment of vLLM on its CPU backend (``engine.device: CPU``): the device, and OpenMP threads
#: left where the kubelet puts the container (vLLM's own core binding assumes it owns the node's cores).
VLLM_CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


DEFAULT_KEY_PROPAGATION_SECONDS = 180.0


@dataclass(frozen=True)
class OperatorOptions:
    """Cluster-level settings of one operator deployment (command-line flags)."""

    router_namespace: str = "kvfence-system"
    router_pod_labels: dict[str, str] = field(
        default_factory=lambda: {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "router"}
    )
    cluster_domain: str = "cluster.local"
    version: str = "0.1.0"
    #: Opt-in: the engines' NetworkPolicy also admits pods with ``metrics_scraper_pod_labels`` (all
    #: pods when empty) in namespaces with ``metrics_scraper_namespace_labels`` to the metrics port.
    #: Empty namespace labels (the default) admit no scraper.
    metrics_scraper_namespace_labels: dict[str, str] = field(default_factory=dict)
    metrics_scraper_pod_labels: dict[str, str] = field(default_factory=dict)
    #: How long after a rotation every engine is taken to hold the new signing key: the kubelet's
    #: refresh of a mounted Secret (its sync period, 60 s by default, plus the Secret cache's TTL, 60 s
    #: by default) and the engines' reload (once a second), with margin. Until then the router signs
    #: with the previous key, which every engine holds.
    signing_key_propagation_seconds: float = DEFAULT_KEY_PROPAGATION_SECONDS
    #: The ClusterRole a namespace binds to let the operator read its Secrets (named in the conditions
    #: that ask for it; the chart's is ``<release>-operator-tenant-secrets``).
    tenant_secrets_role: str = TENANT_SECRETS_ROLE

    def __post_init__(self) -> None:
        if self.metrics_scraper_pod_labels and not self.metrics_scraper_namespace_labels:
            # A NetworkPolicy peer with only a podSelector means pods of the engine's own namespace;
            # and admitting a label from every namespace would let any tenant label a pod and get in.
            raise ValueError("a metrics scraper's pod labels need namespace labels too")


_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_LABEL_KEY = re.compile(rf"^({_DNS_LABEL}(\.{_DNS_LABEL})*/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")


def parse_labels(pairs: Iterable[str]) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` as a dict of Kubernetes labels; ``ValueError`` names a bad one."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        prefix = key.rpartition("/")[0]
        if not sep or not _LABEL_KEY.match(key) or len(prefix) > 253 or not _LABEL_VALUE.match(value):
            raise ValueError(f"{pair!r} is not a label KEY=VALUE")
        out[key] = value
    return out


def labels(tc_name: str, component: str, version: str = "0.1.0") -> dict[str, str]:
    """Recommended labels (app.kubernetes.io/*) plus the trust class."""
    return {
        "app.kubernetes.io/name": ENGINE_APP if component == "engine" else APP,
        "app.kubernetes.io/instance": tc_name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": APP,
        LABEL_MANAGED_BY: FIELD_MANAGER,
        "app.kubernetes.io/version": version,
        LABEL_TRUST_CLASS: tc_name,
    }


def selector_labels(tc_name: str) -> dict[str, str]:
    """The stable subset of the engine pods' labels (Deployment/Service/NetworkPolicy/PDB selector)."""
    return {"app.kubernetes.io/name": ENGINE_APP, "app.kubernetes.io/instance": tc_name}


def owner_reference(tc_body: Obj) -> Obj:
    """Owner reference from a child to its (cluster-scoped) TrustClass: GC deletes the child with it."""
    meta = tc_body["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": "TrustClass",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(tc: TrustClass, name: str, component: str, opts: OperatorOptions, owner: Obj | None) -> Obj:
    m: Obj = {"name": name, "labels": labels(tc.name, component, opts.version)}
    if name != tc.target_namespace or component != "namespace":
        m["namespace"] = tc.target_namespace
    if owner is not None:
        m["ownerReferences"] = [owner]
    return m


def namespace(tc: TrustClass, opts: OperatorOptions, owner: Obj | None = None) -> Obj:
    meta: Obj = {
        "name": tc.target_namespace,
        "labels": {
            **labels(tc.name, "namespace", opts.version),
            # Engines of the class are as privileged as a restricted pod: say so to Pod Security admission.
            "pod-security.kubernetes.io/enforce": "restricted",
        },
    }
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def endpoint(tc: TrustClass, opts: OperatorOptions) -> str:
    return f"http://{ENGINE_NAME}.{tc.target_namespace}.svc.{opts.cluster_domain}:{tc.spec.engine.port}"


# --- engine configuration ---------------------------------------------------------------------
def engine_quota(q: TenantQuotas) -> Obj:
    out: Obj = {"guaranteedBlocks": q.guaranteed_kv_blocks or 0}
    if q.max_kv_blocks is not None:
        out["maxBlocks"] = q.max_kv_blocks
    if q.weight is not None:  # absent: the engine's default weight, 1
        out["weight"] = q.weight
    return out


def shared_prefixes(tc: TrustClass, texts: Mapping[str, str] | None = None) -> list[Obj]:
    """The class's declared shared prefixes as the engine config lists them. ``texts``: the text of
    each prefix given by ``configMapKeyRef``, by prefix name (read by the reconciler); ValueError names
    a prefix whose text is missing."""
    out: list[Obj] = []
    for p in tc.spec.prefix_cache.shared_prefixes:
        text = p.text if p.text is not None else (texts or {}).get(p.name)
        if text is None:
            raise ValueError(
                f"prefixCache.sharedPrefixes[{p.name}]: the text of its configMapKeyRef is not known"
            )
        out.append({"name": p.name, "form": p.form, "text": text})
    return out


def engine_config(
    tc: TrustClass,
    tenant_quotas: dict[str, TenantQuotas] | None = None,
    shared_texts: Mapping[str, str] | None = None,
    *,
    tenants_pending: bool = False,
) -> Obj:
    """The engine's config file (``kvfence.contract.engine_config.EngineConfig``), validated by that model.

    ``tenant_quotas`` are the *effective* quotas of the tenants bound to the class whose KV limits or
    weight differ from the class defaults; ``shared_texts`` the texts of shared prefixes kept in ConfigMaps.
    ``tenants_pending``: a new class's config, rendered before the routing decision that computes its
    tenants' quotas; its engines are not ready until a config without the flag reaches them.
    """
    spec, eng = tc.spec, tc.spec.engine
    model: Obj = {"name": eng.model.name, "revision": eng.model.revision}
    if eng.model.served_name:
        model["servedName"] = eng.model.served_name
    data: Obj = {
        "trustClass": tc.name,
        "model": model,
        "adapters": [a.name for a in eng.adapters],
        "quantization": eng.quantization or "none",
        # The reference engine's pool. On vllm the engine's scheduler plugin sizes nothing from it (it
        # fences vLLM's own pool); it is the operator's budget for guaranteed blocks, which the config
        # model checks the quotas against here as on the reference engine (EngineSpec.kv_block_budget).
        "numBlocks": eng.kv_block_budget,
        "tensorParallelSize": eng.tensor_parallel_size,
        "maxModelLen": eng.max_model_len or DEFAULT_MAX_MODEL_LEN,
        "prefixCache": {
            "enabled": spec.prefix_cache.enabled,
            "scope": str(spec.prefix_cache.scope),
            "hashAlgorithm": spec.prefix_cache.hash_algorithm,
        },
        "quotas": {
            "default": engine_quota(spec.quotas.defaults),
            "tenants": {t: engine_quota(q) for t, q in sorted((tenant_quotas or {}).items())},
        },
        "signingKeyDir": KEY_DIR,
        "requireSignature": True,
        "listen": {"host": "0.0.0.0", "port": eng.port},  # noqa: S104 - fenced by the NetworkPolicy
    }
    shared = shared_prefixes(tc, shared_texts)
    if shared:  # absent when none: an operator upgrade leaves the config of a class without them as it is
        data["prefixCache"]["sharedPrefixes"] = shared
    if eng.dtype != "auto":
        data["dtype"] = eng.dtype
    if eng.block_size is not None or eng.runtime == "reference":
        # Unset on vllm: vLLM's attention backend chooses, so the file names no size it may not use.
        data["blockSize"] = eng.block_size or DEFAULT_BLOCK_SIZE
    if tenants_pending:  # absent otherwise: an operator upgrade leaves every other class's config as it is
        data["tenantsPending"] = True
    # The engine's own model is the judge of what it accepts: fail here, not in a crash-looping pod.
    EngineConfig.model_validate(data)
    return data


def config_json(cfg: Obj) -> str:
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def config_hash(cfg: Obj) -> str:
    """Hash of the parts of the config that need an engine restart.

    The KV quotas (the class's defaults and every tenant's), the declared shared prefixes and
    ``tenantsPending`` are left out: binding a tenant, changing a quota or a shared system prompt must
    not restart the engine its neighbours use, nor must a new class's tenants arriving; both runtimes
    re-read them from the mounted file.
    """
    stable = copy.deepcopy(cfg)
    stable.pop("quotas", None)
    stable.pop("tenantsPending", None)
    stable.get("prefixCache", {}).pop("sharedPrefixes", None)
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]


def config_map(tc: TrustClass, cfg: Obj, opts: OperatorOptions, owner: Obj | None = None) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(tc, CONFIG_NAME, "engine-config", opts, owner),
        "data": {CONFIG_KEY: config_json(cfg)},
    }


def vllm_args(tc: TrustClass) -> list[str]:
    """Arguments of ``vllm serve`` (the image's entrypoint) for this class.

    The model comes first, as vLLM's positional argument (vLLM 0.32 warns that ``--model`` will be
    removed). ``--kv-cache-memory-bytes`` when the class sizes the KV cache (``kvCacheMemory``, which
    vLLM's CPU backend needs). ``--block-size`` only when the class sets one: otherwise vLLM keeps its
    attention backend's choice (its CPU backend refuses 16, for one); ``--gpu-memory-utilization`` likewise
    (unset: vLLM's own default). The kvfence scheduler (per-tenant KV quotas, verified prefix hits,
    tenant-partitioned eviction) is always on: quotas apply with or without prefix caching.
    """
    eng, pc = tc.spec.engine, tc.spec.prefix_cache
    args = [
        eng.model.name,
        "--revision", eng.model.revision,
        "--served-model-name", eng.model.public_name,
        "--host", "0.0.0.0",  # noqa: S104
        "--port", str(eng.port),
        "--tensor-parallel-size", str(eng.tensor_parallel_size),
    ]  # fmt: skip
    if eng.gpu_memory_utilization is not None:
        # Its place among the arguments is fixed: moving it would roll the pods of every class that sets it.
        args += ["--gpu-memory-utilization", str(eng.gpu_memory_utilization)]
    if eng.kv_cache_memory is not None:
        args += ["--kv-cache-memory-bytes", str(quantity_bytes(eng.kv_cache_memory))]
    args += ["--dtype", eng.dtype]
    if eng.block_size is not None:
        args += ["--block-size", str(eng.block_size)]
    if eng.max_model_len:
        args += ["--max-model-len", str(eng.max_model_len)]
    if eng.quantization:
        args += ["--quantization", eng.quantization]
    if pc.enabled:
        # The CRD admits only sha256 for vllm (CEL rule); never a non-cryptographic hash.
        args += ["--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256"]
    else:
        args += ["--no-enable-prefix-caching"]
    if eng.adapters:
        args += ["--enable-lora", "--max-loras", str(len(eng.adapters)), "--lora-modules"]
        args += [f"{a.name}={a.source}" for a in eng.adapters]
    args += ["--middleware", VLLM_MIDDLEWARE, "--scheduler-cls", VLLM_SCHEDULER]
    return args + list(eng.extra_args)


def reference_command(tc: TrustClass) -> list[str]:
    return ["kvfence-engine", "--config", f"{CONFIG_DIR}/{CONFIG_KEY}", *tc.spec.engine.extra_args]


# --- signing key ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SigningKeys:
    """A trust class's signing keys as its Secret holds them."""

    current: bytes
    previous: bytes | None = None
    #: the TrustClass's rotation token this key answers (``kvfence.dev/rotate-signing-key``)
    rotated_for: str | None = None
    #: RFC 3339: when ``current`` replaced ``previous`` (None without a previous key)
    rotated_at: str | None = None


def signing_secret(tc: TrustClass, keys: SigningKeys, opts: OperatorOptions, owner: Obj | None = None) -> Obj:
    """The trust class's signing key(s), raw 32-byte values as the engine reads them from files."""
    meta = _meta(tc, SIGNING_SECRET_NAME, "signing-key", opts, owner)
    meta["annotations"] = {ANNOTATION_KEY_ID: key_id(keys.current)}
    if keys.rotated_for is not None:
        meta["annotations"][ANNOTATION_ROTATED_FOR] = keys.rotated_for
    if keys.rotated_at is not None:
        meta["annotations"][ANNOTATION_ROTATED_AT] = keys.rotated_at
    data = {SIGNING_KEY_CURRENT: base64.b64encode(keys.current).decode()}
    if keys.previous is not None:
        data[SIGNING_KEY_PREVIOUS] = base64.b64encode(keys.previous).decode()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": data}


def read_signing_secret(secret: Obj | None) -> SigningKeys | None:
    """The keys of a live signing Secret (None: no Secret, or no current key in it)."""
    if not secret:
        return None
    data = secret.get("data") or {}
    if not data.get(SIGNING_KEY_CURRENT):
        return None
    prev = base64.b64decode(data[SIGNING_KEY_PREVIOUS]) if data.get(SIGNING_KEY_PREVIOUS) else None
    annotations = secret.get("metadata", {}).get("annotations") or {}
    return SigningKeys(
        base64.b64decode(data[SIGNING_KEY_CURRENT]),
        prev,
        annotations.get(ANNOTATION_ROTATED_FOR),
        annotations.get(ANNOTATION_ROTATED_AT) if prev is not None else None,
    )


def plan_signing_keys(
    live: SigningKeys | None, requested_rotation: str | None, new_key: bytes, now: str
) -> SigningKeys:
    """Keep the live key; create one if there is none; rotate (current -> previous, ``rotated_at``
    now) when the TrustClass asks with a rotation token not yet honoured. ``new_key`` is used only when
    needed. A previous key with no rotation time (a Secret written before it was recorded) is taken
    as rotated ``now``: the router waits the whole propagation delay once more, with keys every
    engine already holds."""
    if live is None:
        return SigningKeys(new_key, None, requested_rotation)
    if requested_rotation and requested_rotation != live.rotated_for:
        return SigningKeys(new_key, live.current, requested_rotation, now)
    if live.previous is not None and live.rotated_at is None:
        return SigningKeys(live.current, live.previous, live.rotated_for, now)
    return live


def rfc3339_seconds(stamp: str) -> float:
    """Seconds since the epoch of an RFC 3339 UTC time as :func:`apply.now_rfc3339` writes it
    (``ValueError`` otherwise)."""
    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()


def key_propagation_left(keys: SigningKeys, now: float, propagation_seconds: float) -> float:
    """Seconds until every engine is taken to hold ``keys.current`` (0: now; a rotation time that does
    not parse counts as a rotation now)."""
    if keys.previous is None or keys.rotated_at is None:
        return 0.0
    try:
        rotated = rfc3339_seconds(keys.rotated_at)
    except ValueError:
        rotated = now
    return max(0.0, rotated + propagation_seconds - now)


def router_signing_keys(keys: SigningKeys, propagated: bool) -> tuple[bytes, ...]:
    """The keys the router holds for a class, the one it signs with first: the previous key until the
    current one has reached every engine (``propagated``), then the current one. Engines verify both."""
    if keys.previous is None:
        return (keys.current,)
    return (keys.current, keys.previous) if propagated else (keys.previous, keys.current)


# --- model cache ------------------------------------------------------------------------------
def model_cache_claim_name(tc: TrustClass) -> str | None:
    """The claim the engine's model cache is, or None (an emptyDir)."""
    mc = tc.spec.engine.model_cache
    if mc is None:
        return None
    return mc.existing_claim.name if mc.existing_claim is not None else MODEL_CACHE_CLAIM


def model_cache_volume(tc: TrustClass) -> Obj:
    """The pod's ``cache`` volume (HF_HOME lies in it): the class's claim, or an emptyDir."""
    claim = model_cache_claim_name(tc)
    if claim is None:
        return {"name": "cache", "emptyDir": {}}
    return {"name": "cache", "persistentVolumeClaim": {"claimName": claim}}


def model_cache_claim(tc: TrustClass, opts: OperatorOptions, owner: Obj | None = None) -> Obj | None:
    """The claim the operator creates for ``engine.modelCache.volumeClaim`` (None for an existing claim
    or no cache). Owned by the TrustClass (deleted with it by garbage collection) only when its
    retention policy says Delete."""
    mc = tc.spec.engine.model_cache
    if mc is None or mc.volume_claim is None:
        return None
    vc = mc.volume_claim
    spec: Obj = {"accessModes": list(vc.access_modes), "resources": {"requests": {"storage": vc.size}}}
    if vc.storage_class_name is not None:
        spec["storageClassName"] = vc.storage_class_name
    keep = vc.retention_policy.when_deleted == "Retain"
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(tc, MODEL_CACHE_CLAIM, "model-cache", opts, None if keep else owner),
        "spec": spec,
    }


# --- engine Deployment ------------------------------------------------------------------------
def _resources(tc: TrustClass) -> Obj:
    res: dict[str, Any] = {}
    r = tc.spec.resources
    if r.gpu.count > 0:
        res[r.gpu.resource_name] = r.gpu.count
    if r.cpu is not None:
        res["cpu"] = r.cpu
    if r.memory is not None:
        res["memory"] = r.memory
    if not res:
        return {}
    return {"requests": dict(res), "limits": dict(res)}


def dedicated_anti_affinity(tc_name: str) -> Obj:
    """Required pod anti-affinity: no pod of any *other* trust class on the same node.

    The scheduler applies an existing pod's required anti-affinity to incoming pods as well, so the
    other classes' engines are kept off this class's nodes too, whether or not they ask.
    """
    return {
        "labelSelector": {
            "matchExpressions": [
                {"key": LABEL_TRUST_CLASS, "operator": "Exists"},
                {"key": LABEL_TRUST_CLASS, "operator": "NotIn", "values": [tc_name]},
            ]
        },
        "namespaceSelector": {},
        "topologyKey": HOSTNAME_TOPOLOGY,
    }


def affinity(tc: TrustClass) -> Obj | None:
    aff = copy.deepcopy(tc.spec.placement.affinity) if tc.spec.placement.affinity else {}
    if tc.spec.placement.dedicated_nodes.enabled:
        anti = aff.setdefault("podAntiAffinity", {})
        anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
            dedicated_anti_affinity(tc.name)
        )
    return aff or None


def tolerations(tc: TrustClass) -> list[Obj]:
    tol = [copy.deepcopy(t) for t in tc.spec.placement.tolerations]
    if tc.spec.placement.dedicated_nodes.tolerate_taint:
        tol.append({"key": TAINT_KEY, "operator": "Equal", "value": tc.name, "effect": "NoSchedule"})
    return tol


def _probe(path: str, port: int, *, period: int, failures: int, delay: int = 0) -> Obj:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
        **({"initialDelaySeconds": delay} if delay else {}),
    }


def rollout_strategy(tc: TrustClass) -> Obj:
    """The Deployment's RollingUpdate: ``engine.rollout``, its unset fields defaulted per class
    (GPU: maxSurge 0 / maxUnavailable 1, no surge accelerator asked for; CPU: 1 / 0)."""
    surge, unavailable = tc.spec.engine.rollout.resolved(gpu=tc.spec.resources.gpu.count > 0)
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}


def deployment(tc: TrustClass, cfg_hash: str, opts: OperatorOptions, owner: Obj | None = None) -> Obj:
    """The engine Deployment. Its pod template carries the hash of what needs a restart and nothing
    that reloads (signing keys, quotas, shared prefixes): changing those never replaces a pod."""
    pod_labels = {**labels(tc.name, "engine", opts.version), **selector_labels(tc.name)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(tc, ENGINE_NAME, "engine", opts, owner),
        "spec": {
            # Not set with replicasManagedExternally: the class namespace's HPA/KEDA owns them.
            **({} if tc.spec.replicas_managed_externally else {"replicas": tc.spec.desired_replicas}),
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector_labels(tc.name)},
            "strategy": rollout_strategy(tc),
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {ANNOTATION_CONFIG_HASH: cfg_hash},
                },
                "spec": _engine_pod_spec(tc),
            },
        },
    }


def _engine_pod_spec(tc: TrustClass) -> Obj:
    """The engine pod: its one container, as restricted a pod as Pod Security knows, placed as the
    class says."""
    pod_spec: Obj = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": 30,
        "containers": [_engine_container(tc)],
        "volumes": _engine_volumes(tc),
        **_placement(tc),
    }
    if tc.spec.engine.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in tc.spec.engine.image_pull_secrets]
    return pod_spec


def _placement(tc: TrustClass) -> Obj:
    """The pod spec's fields that place it (node selector, tolerations, affinity, runtime and priority
    class), each only when the class sets it."""
    pl = tc.spec.placement
    out: Obj = {}
    if pl.node_selector:
        out["nodeSelector"] = dict(pl.node_selector)
    tol = tolerations(tc)
    if tol:
        out["tolerations"] = tol
    aff = affinity(tc)
    if aff:
        out["affinity"] = aff
    if pl.runtime_class_name:
        out["runtimeClassName"] = pl.runtime_class_name
    if pl.priority_class_name:
        out["priorityClassName"] = pl.priority_class_name
    return out


def _engine_container(tc: TrustClass) -> Obj:
    """The engine container: ``vllm serve`` with the kvfence plugins, or the reference engine."""
    eng = tc.spec.engine
    vllm = eng.runtime == "vllm"
    container: Obj = {
        "name": "engine",
        "image": eng.image,
        "imagePullPolicy": eng.image_pull_policy,
        "ports": [{"name": "http", "containerPort": eng.port, "protocol": "TCP"}],
        "env": _engine_env(tc),
        # Not ready while the engine config waits for its tenants' quotas (EngineConfig.tenants_pending).
        "readinessProbe": _probe(READY_PATH, eng.port, period=5, failures=3),
        "livenessProbe": _probe("/health", eng.port, period=10, failures=6),
        # Loading weights takes minutes for real models: liveness starts after this succeeds.
        "startupProbe": _probe("/health", eng.port, period=10, failures=180 if vllm else 30),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": _engine_volume_mounts(tc),
    }
    if vllm:
        container["args"] = vllm_args(tc)
    else:
        container["command"] = reference_command(tc)
    res = _resources(tc)
    if res:
        container["resources"] = res
    return container


def _engine_env(tc: TrustClass) -> list[Obj]:
    """The container's environment: the config file and HOME, vLLM's own on vllm, then ``extraEnv``."""
    eng = tc.spec.engine
    env: list[Obj] = [
        {"name": ENV_ENGINE_CONFIG, "value": f"{CONFIG_DIR}/{CONFIG_KEY}"},
        {"name": "HOME", "value": TMP_DIR},
    ]
    if eng.runtime == "vllm":
        env += [
            {"name": "HF_HOME", "value": HF_HOME_PATH},
            {"name": VLLM_STATS_FILE_ENV, "value": VLLM_STATS_FILE},
        ]
        token = eng.model.token_secret_ref
        if token is not None:
            # A reference to the Secret, never its value: nothing the operator writes holds the token.
            env.append(
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}}
            )
        if eng.on_vllm_cpu:
            env += [{"name": k, "value": v} for k, v in VLLM_CPU_ENV.items()]
    return env + [e.wire() for e in eng.extra_env]


def _engine_volume_mounts(tc: TrustClass) -> list[Obj]:
    """The container's mounts of :func:`_engine_volumes`: config, signing key and /tmp; on vllm the model
    cache and shared memory; then ``extraVolumeMounts``."""
    eng = tc.spec.engine
    mounts: list[Obj] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "signing-key", "mountPath": KEY_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": TMP_DIR},
    ]
    if eng.runtime == "vllm":
        mounts += [{"name": "cache", "mountPath": MODEL_CACHE_PATH}, {"name": "dshm", "mountPath": SHM_DIR}]
    return mounts + [
        {"name": m.name, "mountPath": m.mount_path, "readOnly": m.read_only} for m in eng.extra_volume_mounts
    ]


def _engine_volumes(tc: TrustClass) -> list[Obj]:
    """The pod's volumes, each mounted by :func:`_engine_volume_mounts`."""
    eng = tc.spec.engine
    volumes: list[Obj] = [
        {"name": "config", "configMap": {"name": CONFIG_NAME}},
        {"name": "signing-key", "secret": {"secretName": SIGNING_SECRET_NAME, "defaultMode": 0o440}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if eng.runtime == "vllm":
        volumes += [model_cache_volume(tc), {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    return volumes + [v.pod_volume() for v in eng.extra_volumes]


def service(tc: TrustClass, opts: OperatorOptions, owner: Obj | None = None) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(tc, ENGINE_NAME, "engine", opts, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(tc.name),
            "ports": [{"name": "http", "port": tc.spec.engine.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def metrics_port(tc: TrustClass) -> int:
    """The port of the engine's ``/metrics``: both runtimes serve it on the engine port, next to the
    inference API (which answers only requests the router signed)."""
    return tc.spec.engine.port


def network_policy(tc: TrustClass, opts: OperatorOptions, owner: Obj | None = None) -> Obj:
    """Engine ingress only from router pods in the router's namespace, only on the engine port; and,
    when the operator is told a metrics scraper, from that scraper's pods, only on the metrics port."""
    ingress: list[Obj] = [
        {
            "from": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": opts.router_namespace}
                    },
                    "podSelector": {"matchLabels": dict(opts.router_pod_labels)},
                }
            ],
            "ports": [{"protocol": "TCP", "port": tc.spec.engine.port}],
        }
    ]
    if opts.metrics_scraper_namespace_labels:
        scraper: Obj = {"namespaceSelector": {"matchLabels": dict(opts.metrics_scraper_namespace_labels)}}
        if opts.metrics_scraper_pod_labels:
            scraper["podSelector"] = {"matchLabels": dict(opts.metrics_scraper_pod_labels)}
        ingress.append({"from": [scraper], "ports": [{"protocol": "TCP", "port": metrics_port(tc)}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(tc, NETWORK_POLICY_NAME, "engine", opts, owner),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(tc.name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def pod_disruption_budget(tc: TrustClass, opts: OperatorOptions, owner: Obj | None = None) -> Obj:
    # maxUnavailable (not minAvailable) so that a single-replica class never blocks a node drain.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(tc, ENGINE_NAME, "engine", opts, owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(tc.name)}},
    }


class RefusedExtraArgs(ValueError):
    """``engine.extraArgs`` names a flag its runtime's allowlist does not hold (the message says which
    and why)."""


def check_extra_args(tc: TrustClass) -> None:
    """Refuse what the CRD's rules refuse, for a class stored before those rules existed: the operator
    never renders an engine with a flag off its runtime's allowlist."""
    why = extra_args_refusal(tc.spec.engine.extra_args, tc.spec.engine.runtime)
    if why is not None:
        raise RefusedExtraArgs(why)


def children(
    tc: TrustClass,
    *,
    signing: SigningKeys,
    tenant_quotas: dict[str, TenantQuotas] | None,
    opts: OperatorOptions,
    owner: Obj | None,
    shared_texts: Mapping[str, str] | None = None,
    tenants_pending: bool = False,
) -> list[Obj]:
    """Every namespaced object of a trust class, in apply order (the model-cache claim, then config and
    key, the engine last)."""
    check_extra_args(tc)
    cfg = engine_config(tc, tenant_quotas, shared_texts, tenants_pending=tenants_pending)
    claim = model_cache_claim(tc, opts, owner)
    return [
        # First: a change of the claim the API server refuses then stops the reconcile before anything
        # else of the class is applied.
        *([claim] if claim is not None else []),
        config_map(tc, cfg, opts, owner),
        signing_secret(tc, signing, opts, owner),
        service(tc, opts, owner),
        network_policy(tc, opts, owner),
        pod_disruption_budget(tc, opts, owner),
        deployment(tc, config_hash(cfg), opts, owner),
    ]
