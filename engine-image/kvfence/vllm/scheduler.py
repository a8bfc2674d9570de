"""kvfence inside vLLM's engine core: ``--scheduler-cls kvfence.vllm.scheduler.FencedScheduler``.

vLLM builds its scheduler from this name in the engine-core process. :func:`FencedScheduler` returns
vLLM's own ``Scheduler`` (or ``AsyncScheduler``, whichever vLLM chose) extended by :class:`FenceMixin`,
whose ``KVCacheManager`` and ``BlockPool`` are vLLM's own objects with a few methods overridden
(:class:`kvfence.vllm.kv_cache_manager.FencedKVCacheManager`,
:class:`kvfence.vllm.block_pool.FencedBlockPool`: the three overrides mirror vLLM's three files); every
decision is made by :class:`kvfence.vllm.fence.TenantFence`. What changes, against stock vLLM:

* **Who**: the tenant of each request comes from the request's ``vllm_xargs`` that the kvfence
  middleware set after verifying the router's signature, and is checked again here with the trust
  class's keys (:func:`kvfence.contract.tenant_tag` binds tenant and cache salt). A request without a
  valid tag is refused (finished with an error) and counted: the scheduler never accounts to a tenant
  a client chose.
* **Verified hits**: ``get_computed_blocks`` keeps vLLM's hash lookup and then verifies each hit block
  against the token ids (and chain, and cache namespace) stored when the block was cached; the hit ends
  at the first mismatch.
* **Stale references**: the (block, generation) pairs of a lookup are checked when the request takes
  the blocks; a moved generation refuses that allocation (the request looks up again next step).
* **Quotas and eviction**: ``BlockPool.get_num_free_blocks`` answers for the tenant being allocated
  for, and ``get_new_blocks`` takes blocks in the fence's order (clean, own cold, others' beyond their
  guarantee), so vLLM's own allocation logic enforces hard maxima and guarantees. Requests of a tenant
  at its maximum are held out of the waiting queue during ``schedule`` so they never block other
  tenants' requests behind them. A request that could never fit its tenant's maximum has its
  ``max_tokens`` cut to fit (finish reason ``length``), or, if its prompt alone does not fit, is
  refused.
* **Fair share**: before each ``schedule`` the running list is ordered, the running slots divided,
  and the waiting requests vLLM may admit chosen and ordered, by the tenants' weights
  (:mod:`kvfence.vllm.fair`, the policy of :mod:`kvfence.isolation.fairshare`); after it each tenant
  is charged what the step scheduled for it.
* **Reloads**: quotas and weights are re-read from the engine config file and keys from the key
  directory when those files change (checked once a second), without a restart.

The fence supports what it can verify: one KV-cache group of full attention, block hashes at the
block size, no KV connector, no decode context parallelism, and vLLM's first-come-first-served
policy (whose queues fair share orders). Anything else fails the engine at start
with a message naming what is unsupported (never a silently unfenced engine).
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections import OrderedDict
from typing import Any

import vllm.v1.core.kv_cache_coordinator as _coord_mod
import vllm.v1.core.sched.scheduler as _sched_mod
from kvfence.contract import XARG_REQUEST_REF, XARG_TENANT, XARG_TENANT_TAG, tenant_tag
from kvfence.contract.engine_config import (
    ENV_ENGINE_CONFIG,
    ConfigError,
    EngineConfig,
    QuotasConfig,
    SharedPrefixConfig,
    file_stamp,
    load_config,
)
from kvfence.contract.errors import CODE_MAX_KV_BLOCKS_EXCEEDED
from kvfence.isolation.quotas import SHARED_OWNER
from kvfence.vllm.block_pool import FencedBlockPool, FenceFreeCount, constructing_as
from kvfence.vllm.fair import StepShares, WaitingView
from kvfence.vllm.fence import UNATTRIBUTED, FenceError, SharedPin, TenantFence
from kvfence.vllm.kv_cache_manager import FencedKVCacheManager
from kvfence.vllm.logs import ensure_handler
from kvfence.vllm.middleware import KeySource
from kvfence.vllm.records import COMPILED as records_compiled
from kvfence.vllm.records import pack
from kvfence.vllm.refusals import EngineRefusal, RefusalBox
from kvfence.vllm.stats import EngineStats, StatsWriter
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    get_request_block_hasher,
    hash_block_tokens,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request, RequestStatus

log = logging.getLogger("kvfence.vllm.scheduler")

RELOAD_INTERVAL = 1.0  # seconds between checks of the config and key files
REASON_NO_IDENTITY = "MissingTenant"
REASON_BAD_TAG = "BadTenantTag"
#: a prompt token id outside int32, what the compiled records store (and vLLM's own input batch): only
#: a request vLLM's input processor did not validate (``--skip-tokenizer-init``) can carry one
REASON_TOKEN_RANGE = "TokenOutOfRange"


def shared_salt(trust_class: str) -> str:
    """The cache salt of the requests that compute declared shared prefixes: no router-derived salt
    (base64url of an HMAC) can be it."""
    return f"kvfence-shared/{trust_class}"


def render_prefix(tok: Any, form: str, text: str) -> list[int]:
    """The tokens every request carrying a declared prefix begins with, as vLLM's OpenAI server
    tokenizes it: ``completion``: the prompt text with the tokenizer's special tokens (its last token
    dropped: the text that follows may merge with it); ``chat``: what the chat template renders for a
    leading system message, i.e. the common start of a conversation of that system message alone and
    one followed by a user message (chat prompts are tokenized without added special tokens)."""
    if form == "completion":
        return list(tok.encode(text, add_special_tokens=True))[:-1]
    system = [{"role": "system", "content": text}]
    alone = tok.apply_chat_template(system, tokenize=False, add_generation_prompt=False)
    more = tok.apply_chat_template(
        [*system, {"role": "user", "content": "?"}], tokenize=False, add_generation_prompt=True
    )
    a = list(tok.encode(alone, add_special_tokens=False))
    b = list(tok.encode(more, add_special_tokens=False))
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _check_supported(sched: Scheduler) -> None:
    problems = []
    groups = sched.kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        problems.append(f"one KV-cache group of full attention (this model has: {kinds or 'none'})")
    if sched.hash_block_size != sched.block_size:
        problems.append(
            f"block hashes at the block size (hash block {sched.hash_block_size}, block {sched.block_size})"
        )
    if sched.connector is not None:
        problems.append("no KV connector (--kv-transfer-config moves KV outside the fence)")
    if getattr(sched, "dcp_world_size", 1) != 1:
        problems.append("no decode context parallelism")
    if sched.policy != SchedulingPolicy.FCFS:
        problems.append("the fcfs scheduling policy (fair share orders the queues itself)")
    if problems:
        raise FenceError("the kvfence scheduler supports only " + "; ".join(problems))


class FenceMixin:
    """What kvfence adds to vLLM's scheduler (see the module docstring)."""

    kv_cache_manager: Any
    waiting: Any
    running: list[Any]
    requests: dict[str, Any]
    max_num_running_reqs: int
    max_model_len: int
    block_size: int

    # 66 lines: the fence's state is set up around vLLM's own constructor, in the order it needs.
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM builds its KV-cache manager and block pool inside Scheduler.__init__; they are built as
        # the fenced subclasses (the names vLLM's modules construct them by, for the duration of the
        # call). Constructing them, rather than re-classing vLLM's objects afterwards, keeps CPython's
        # attribute-access specialisation intact on the pool's hot paths.
        with (
            constructing_as(_sched_mod, "KVCacheManager", FencedKVCacheManager),
            constructing_as(_coord_mod, "BlockPool", FencedBlockPool),
        ):
            super().__init__(*args, **kwargs)
        ensure_handler()
        sched: Any = self
        _check_supported(sched)
        self._keys = KeySource.from_env()
        self._key_list = self._keys.load()
        self._key_stamp = self._keys.stamp()
        self._config_path = os.environ.get(ENV_ENGINE_CONFIG, "")
        self._config_stamp: tuple[int, int, int] | None = None
        cfg = self._load_config()
        quotas = cfg.quotas if cfg is not None else QuotasConfig()
        mgr = self.kv_cache_manager
        pool = mgr.block_pool
        if not isinstance(mgr, FencedKVCacheManager) or not isinstance(pool, FencedBlockPool):
            raise FenceError("vLLM did not build the fenced KV-cache manager and block pool")
        self.fence = TenantFence(pool.num_gpu_blocks, self.block_size, quotas, pool.blocks)
        # The fence owns the free blocks from here on; vLLM's queue (all but the null block) becomes a count.
        pool.free_count = pool.free_block_queue = FenceFreeCount(pool.free_block_queue.num_free_blocks)
        tenant_of: dict[str, str] = {}
        shared_of: dict[str, int] = {}
        pool.fence, pool.rid, pool.tenant_of, pool.shared_of = self.fence, "", tenant_of, shared_of
        pool.set_quota_mode(self.fence.unlimited)
        self._packed_of: dict[str, bytes] = {}
        pool.packed_of = mgr.packed_of = self._packed_of
        mgr.fence, mgr.fenced_pool, mgr.fence_block_size = self.fence, pool, self.block_size
        mgr.tenant_of, mgr.reach_of, mgr.lookups = tenant_of, {}, {}
        mgr.shared_pin_of, mgr.pinning = {}, {}
        self._shared_of = shared_of
        self._shared_pin_of: dict[str, SharedPin] = mgr.shared_pin_of
        self._pinning: dict[str, tuple[str, list[int], int]] = mgr.pinning
        #: pin request ids whose outputs are the scheduler's own (never sent to a client)
        self._pin_ids: set[str] = set()
        self._pin_epoch = 0
        self._hash_fn: Any = None
        self._hasher: Any = None
        #: declared shared prefixes rendered to tokens, waiting for the first step to be computed
        self._pins_todo = self._plan_pins(cfg.prefix_cache.shared_prefixes if cfg is not None else [])
        self._shared_decls = cfg.prefix_cache.shared_prefixes if cfg is not None else []
        #: pins no longer declared, released once the newly declared ones are pinned
        self._retiring: list[SharedPin] = []
        self._tenant_of: dict[str, str] = mgr.tenant_of
        self._reach_of: dict[str, int] = mgr.reach_of
        self._refused: dict[str, str] = {}
        #: (tenant, salt, tag) -> the tenant, "" if the tag is wrong. The tenant is the string object
        #: first seen, so every request of a tenant carries the same one: the per-step scans compare
        #: tenants by identity, never reading another copy of the name (a cache miss each)
        self._verified: OrderedDict[tuple[str, str, str], str] = OrderedDict()
        self._next_reload = time.monotonic() + RELOAD_INTERVAL
        self.fair = StepShares(quotas, self.max_num_running_reqs, self._tenant_of)
        self.stats = StatsWriter.from_env(EngineStats(self.fence, self.fair))
        self._refusals = RefusalBox.from_env()
        log.info(
            "kvfence: fenced scheduler for trust class %r: %d KV blocks of %d tokens, %d tenants with "
            "quotas, %s prefix-cache records",
            self._keys.trust_class,
            self.fence.usable_blocks,
            self.block_size,
            len(quotas.tenants),
            "compiled" if records_compiled else "pure-Python",
        )

    # --- identity ---------------------------------------------------------------------------------
    def _identify(self, request: Request) -> tuple[str | None, str]:
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        tenant = extra.get(XARG_TENANT) if isinstance(extra, dict) else None
        tag = extra.get(XARG_TENANT_TAG) if isinstance(extra, dict) else None
        salt = request.cache_salt
        if not isinstance(tenant, str) or not tenant or not isinstance(tag, str) or not salt:
            return None, REASON_NO_IDENTITY
        key = (tenant, salt, tag)
        known = self._verified.get(key)
        if known is None:
            ok = any(
                hmac.compare_digest(tenant_tag(k, self._keys.trust_class, tenant, salt), tag)
                for k in self._key_list
            )
            known = self._verified[key] = tenant if ok else ""
            if len(self._verified) > 4096:
                self._verified.popitem(last=False)
        return (known, "") if known else (None, REASON_BAD_TAG)

    def add_request(self, request: Request) -> None:
        self._maybe_reload()
        tenant, reason = self._identify(request)
        rid = request.request_id
        if tenant is None:
            self.fence.count("identity_rejected", reason)
            log.warning("kvfence: request %s refused: no verified tenant (%s)", rid, reason)
            self._refused[rid] = reason
            super().add_request(request)  # type: ignore[misc]
            return
        if pack is not None and not request.mm_features and request.prompt_embeds is None:
            # While vLLM's block hasher has just read these int objects (see kvfence.vllm.records).
            try:
                self._packed_of[rid] = pack(request._all_token_ids)
            except OverflowError as e:
                log.warning("kvfence: request %s refused: %s", rid, e)
                self._refuse(request, REASON_TOKEN_RANGE, EngineRefusal(400, "invalid_request_error", str(e)))
                super().add_request(request)  # type: ignore[misc]
                return
        self._tenant_of[rid] = tenant
        self.fair.arrive(request, tenant)
        shared_tokens = self._shared_start(request) * self.block_size  # not charged to the tenant
        self._fit_to_quota(request, tenant, shared_tokens)
        super().add_request(request)  # type: ignore[misc]

    def _fit_to_quota(self, request: Request, tenant: str, shared_tokens: int) -> bool:
        """Fit a request to its tenant's current maximum (when it arrives, and when a lowered maximum
        left it waiting for room it could never get): refused (True) if the tokens it holds alone do
        not fit; otherwise its ``max_tokens`` cut so that all it can reach fits, and its reach noted."""
        rid = request.request_id
        # The prompt, and the output so far of a request preempted after the maximum was lowered.
        if not self.fence.fits_alone(tenant, request.num_tokens + 1 - shared_tokens):
            self.fence.count("quota_rejected", tenant)
            log.warning(
                "kvfence: request %s of tenant %r refused: its %d tokens exceed the tenant's KV quota",
                rid,
                tenant,
                request.num_tokens,
            )
            self._refuse_quota(request, tenant, shared_tokens)
            return True
        acct = self.fence.account(tenant)
        reach = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        if acct.limited and self.fence.blocks_for(reach - shared_tokens) > acct.max_blocks:
            cut = acct.max_blocks * self.block_size + shared_tokens - request.num_prompt_tokens
            log.info(
                "kvfence: request %s of tenant %r: max_tokens %d cut to %d to fit its KV quota",
                rid,
                tenant,
                request.max_tokens,
                cut,
            )
            request.max_tokens = cut
            reach = request.num_prompt_tokens + cut
        self._reach_of[rid] = reach - shared_tokens
        return False

    def _refuse_quota(self, request: Request, tenant: str, shared_tokens: int) -> None:
        """Refuse a request whose prompt alone (with the output so far, for one preempted after its
        tenant's maximum was lowered) exceeds its tenant's maximum: finished with an error in the next
        update_from_output, its answer left for the middleware first. No wait makes it fit, so the answer
        is the reference engine's ``400 max_kv_blocks_exceeded``, which clients do not retry."""
        need = self.fence.blocks_for(request.num_tokens + 1 - shared_tokens)
        what = (
            "the prompt needs" if request.num_output_tokens == 0 else "the prompt and its output so far need"
        )
        message = (
            f"KV-block quota exceeded for tenant {tenant!r}: {what} {need} KV blocks of "
            f"{self.block_size} tokens, more than the tenant's maximum of "
            f"{self.fence.maximum(tenant)} (maxKVBlocks); the request can never be served within it"
        )
        refusal = EngineRefusal(400, CODE_MAX_KV_BLOCKS_EXCEEDED, message)
        self._refuse(request, "QuotaExceeded", refusal)

    def _refuse(self, request: Request, reason: str, answer: EngineRefusal) -> None:
        """Finish ``request`` with an error in the next update_from_output, ``answer`` left for the
        middleware first (under the request's reference, when it has one)."""
        self._refused[request.request_id] = reason
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        ref = extra.get(XARG_REQUEST_REF) if isinstance(extra, dict) else None
        if ref is not None:
            self._refusals.put(ref, answer)

    # --- declared shared prefixes -----------------------------------------------------------------
    def _plan_pins(self, decls: list[SharedPrefixConfig]) -> list[tuple[str, list[int], int]]:
        """Render each declared prefix as vLLM renders requests (the model's tokenizer and chat
        template): (name, tokens, full blocks). Fails the engine if it cannot (never a declaration
        accepted and ignored)."""
        if not decls:
            return []
        sched: Any = self
        if not self.kv_cache_manager.enable_caching:
            raise FenceError("prefixCache.sharedPrefixes needs prefix caching (--enable-prefix-caching)")
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        try:
            tok = cached_tokenizer_from_config(sched.vllm_config.model_config)
        except Exception as e:  # any failure to load the tokenizer: say so and stop
            raise FenceError(f"prefixCache.sharedPrefixes: cannot load the tokenizer: {e}") from None
        if tok is None:
            raise FenceError("prefixCache.sharedPrefixes needs the tokenizer (--skip-tokenizer-init is set)")
        plans = []
        for d in decls:
            tokens = render_prefix(tok, d.form, d.text)
            k = len(tokens) // self.block_size
            if k == 0:
                log.warning("kvfence: shared prefix %r is shorter than one block: nothing to share", d.name)
                continue
            plans.append((d.name, tokens, k))
        return plans

    def _redeclare(self, decls: list[SharedPrefixConfig]) -> None:
        """A new declared list (the operator rewrote the config): pin what is new now, and release the
        pins no longer declared once the new ones are in place (until then the old ones still serve)."""
        try:
            plans = self._plan_pins(decls)
        except FenceError as e:
            log.error("kvfence: shared prefixes not changed: %s", e)
            return
        self._shared_decls = decls
        kept = {(p.name, tuple(p.tokens)) for p in self.fence.shared}
        self._pins_todo = [pl for pl in plans if (pl[0], tuple(pl[1])) not in kept]
        wanted = {(name, tuple(tokens)) for name, tokens, _ in plans}
        self._retiring = [p for p in self.fence.shared if (p.name, tuple(p.tokens)) not in wanted]
        log.info(
            "kvfence: shared prefixes redeclared: %d to pin, %d to release",
            len(self._pins_todo),
            len(self._retiring),
        )

    def _release_retired(self) -> None:
        """Drop the pins no longer declared: their blocks become ordinary cached blocks of the shared
        namespace (cold, reclaimable by anyone); requests holding them keep them until they finish."""
        retiring, self._retiring = self._retiring, []
        gone = {id(p) for p in retiring}
        self.fence.shared = tuple(p for p in self.fence.shared if id(p) not in gone)
        self.fence.version += 1
        pool = self.kv_cache_manager.block_pool
        for pin in retiring:
            pool.free_blocks(reversed([pool.blocks[bid] for bid in pin.block_ids]))
            log.info("kvfence: shared prefix %r released", pin.name)

    def _start_pins(self) -> None:
        """Queue one request per planned prefix (its full blocks and one more token, one token to
        generate) in the shared namespace; FencedKVCacheManager keeps its blocks when it finishes."""
        sched: Any = self
        if self._hasher is None:
            self._hash_fn = get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
            self._hasher = get_request_block_hasher(sched.hash_block_size, self._hash_fn)
        todo, self._pins_todo = self._pins_todo, []
        self._pin_epoch += 1
        for name, tokens, k in todo:
            rid = f"kvfence-shared-{name}-{self._pin_epoch}"
            n = k * self.block_size
            prompt = [*tokens[:n], tokens[n] if len(tokens) > n else tokens[-1]]
            req = Request(
                rid,
                prompt,
                SamplingParams(max_tokens=1, temperature=0.0),
                None,
                cache_salt=shared_salt(self._keys.trust_class),
                block_hasher=self._hasher,
            )
            self._tenant_of[rid] = SHARED_OWNER
            self.fair.arrive(req, SHARED_OWNER)
            self._reach_of[rid] = len(prompt) + 1
            self._pinning[rid] = (name, tokens, k)
            self._pin_ids.add(rid)
            super().add_request(req)  # type: ignore[misc]

    def _shared_start(self, request: Request) -> int:
        """If the request's prompt begins with a pinned prefix, token for token: its block hashes are
        rewritten so that its first blocks are the pinned ones and its own namespace (its cache salt)
        enters the chain at the first block after them; returns how many blocks it shares."""
        pins = self.fence.shared
        if not pins or request.lora_request is not None or request.mm_features:
            return 0
        if getattr(request, "prompt_embeds", None) is not None or not request.cache_salt:
            return 0
        prompt = request.prompt_token_ids
        if prompt is None:
            return 0
        pin = next((p for p in pins if prompt[: len(p.tokens)] == p.tokens), None)
        if pin is None:
            return 0
        bs = self.block_size
        n = min(pin.num_blocks, (int(request.num_prompt_tokens) - 1) // bs)
        if n == 0:
            return 0
        tokens = request.all_token_ids
        hashes = list(pin.hashes[:n])
        prev = hashes[-1]
        for i in range(n, len(request.block_hashes)):
            extra, _ = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
            if i == n:  # the tenant's namespace enters here, as vLLM puts the salt into block 0
                extra = (*(extra or ()), ("cache_salt", request.cache_salt))
            prev = hash_block_tokens(self._hash_fn, prev, tokens[i * bs : (i + 1) * bs], extra)
            hashes.append(prev)
        request.block_hashes[:] = hashes
        self._shared_of[request.request_id] = n
        self._shared_pin_of[request.request_id] = pin
        return n

    # --- scheduling -------------------------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._maybe_reload()
        if self._pins_todo:
            self._start_pins()
        elif self._retiring and not self._pinning:
            self._release_retired()
        through = self._hold_back(self.fair.before(self))
        view = None
        if through is not None:
            view = WaitingView(self.waiting, through)
            self.waiting = view.view
        try:
            out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            if view is not None:
                self.waiting = view.queue
                view.close()
        self.fair.after(self, out)
        return out

    def _hold_back(self, through: list[Request] | None) -> list[Request] | None:
        """The waiting requests vLLM may admit this step (``through``, in order; None: the whole queue,
        in its order) less those that must not be scheduled: those refused (they finish in
        update_from_output) and those whose tenant is at its maximum, so vLLM's waiting loop (which
        stops at the first request it cannot allocate) never stalls on them. None when that is still
        the whole queue."""
        fence = self.fence
        if (not fence.has_limits and not self._refused) or not self.waiting:  # (a queue's len is a call)
            return through
        # fence.can_admit for each waiting request, with each tenant's room (its maximum less what its
        # admitted requests reserve; None: no maximum) looked up once per step: the queue can be long.
        admitted = fence.admitted
        refused = self._refused
        tenant_of = self._tenant_of
        reach_of = self._reach_of
        bs = fence.block_size
        room: dict[str, int | None] = {}
        pending: dict[str, int] = {}
        held: list[Request] = []
        held_by: dict[str, int] = {}
        candidates = self.waiting if through is None else through
        for request in candidates:
            rid = request.request_id
            if rid in refused:
                held.append(request)
                continue
            if rid in admitted:
                continue
            tenant = tenant_of.get(rid, UNATTRIBUTED)
            if tenant in room:
                left = room[tenant]
            else:
                left = room[tenant] = fence.room(tenant)
            if left is None:
                continue
            need = -(-reach_of.get(rid, request.num_tokens) // bs)
            before = pending.get(tenant, 0)
            if before + need > left and need > (fence.maximum(tenant) or 0):
                # Its tenant's maximum was lowered below what it can reach: it would wait forever.
                # Cut to fit now, or refused if what it holds alone does not fit.
                shared = self._shared_of.get(rid, 0) * bs
                if self._fit_to_quota(request, tenant, shared):
                    held.append(request)
                    continue
                need = -(-reach_of[rid] // bs)
            if before + need > left:
                held.append(request)
                held_by[tenant] = held_by.get(tenant, 0) + 1
            else:
                pending[tenant] = before + need
        if held_by:
            counts = fence.counters.quota_held_back
            for tenant, k in held_by.items():
                counts[tenant] = counts.get(tenant, 0) + k
            fence.version += 1
        if not held:
            return through
        out = set(held)
        return [r for r in candidates if r not in out]

    def update_from_output(self, *args: Any, **kwargs: Any) -> dict[int, Any]:
        outputs: dict[int, Any] = super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        if self._refused:
            self._finish_refused(outputs)
        if self._pin_ids:  # the pin requests' outputs are nobody's
            for eco in outputs.values():
                eco.outputs = [o for o in eco.outputs if o.request_id not in self._pin_ids]
            self._pin_ids.intersection_update(self._pinning)
        return outputs

    def _finish_refused(self, outputs: dict[int, Any]) -> None:
        ids = list(self._refused)
        self._refused.clear()
        sched: Any = self
        for request in sched.finish_requests(ids, RequestStatus.FINISHED_ERROR):
            eco = outputs.get(request.client_index)
            if eco is None:
                eco = outputs[request.client_index] = EngineCoreOutputs()
            eco.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                )
            )

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]
        self.fair.stopped(request.request_id)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        rid = request.request_id
        out = super()._free_request(request, *args, **kwargs)  # type: ignore[misc]
        tenant = self._tenant_of.get(rid)
        if tenant is not None:
            self.fair.leave(request, tenant)
            del self._tenant_of[rid]
        self._reach_of.pop(rid, None)
        self._shared_of.pop(rid, None)
        self._shared_pin_of.pop(rid, None)
        self._packed_of.pop(rid, None)
        return out

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        """vLLM's reset, as vLLM's engine core calls it (``reset_running_requests`` preempts the
        running requests first): the pool forgets every cached block, the declared shared prefixes'
        pinned ones included (KV computed before a reset, e.g. under the weights before an update,
        must not be served after it), and they are computed again from the next step, except those
        whose requests are computing them now."""
        ok: bool = super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc]
        if not ok or not self._shared_decls:
            return ok
        self._retiring = []  # the pool dropped every pin
        try:
            plans = self._plan_pins(self._shared_decls)
        except FenceError as e:
            log.error("kvfence: shared prefixes not pinned again after the prefix-cache reset: %s", e)
            return ok
        computing = {(name, tuple(tokens)) for name, tokens, _ in self._pinning.values()}
        self._pins_todo = [pl for pl in plans if (pl[0], tuple(pl[1])) not in computing]
        return ok

    def shutdown(self) -> None:
        self.stats.stop()
        super().shutdown()  # type: ignore[misc]

    # --- reloads ----------------------------------------------------------------------------------
    def _load_config(self) -> EngineConfig | None:
        if not self._config_path:
            log.warning("kvfence: %s is not set: every tenant gets an unlimited KV quota", ENV_ENGINE_CONFIG)
            return None
        stamp = file_stamp(self._config_path)
        try:
            if stamp is None:
                raise ConfigError(f"cannot read engine config {self._config_path}")
            cfg = load_config(self._config_path)
        except ConfigError as e:
            if self._config_stamp is None:
                raise FenceError(f"cannot load the engine config: {e}") from None
            log.warning("kvfence: engine config not reloaded: %s", e)
            return None
        self._config_stamp = stamp
        return cfg

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now < self._next_reload:
            return
        self._next_reload = now + RELOAD_INTERVAL
        got = self._keys.reload_if_changed(self._key_stamp)
        if got is not None:
            self._key_stamp, self._key_list = got
            self._verified.clear()
        if self._config_path:
            stamp = file_stamp(self._config_path)
            if stamp is not None and stamp != self._config_stamp:
                cfg = self._load_config()
                if cfg is not None:
                    quotas = cfg.quotas
                    try:
                        self.fence.set_quotas(quotas)
                    except FenceError as e:
                        log.warning("kvfence: quotas not applied: %s", e)
                        return
                    self.kv_cache_manager.block_pool.set_quota_mode(self.fence.unlimited)
                    self.fair.set_weights(quotas)
                    log.info("kvfence: KV quotas reloaded (%d tenants listed)", len(quotas.tenants))
                    if cfg.prefix_cache.shared_prefixes != self._shared_decls:
                        self._redeclare(cfg.prefix_cache.shared_prefixes)


class FencedSyncScheduler(FenceMixin, Scheduler):  # type: ignore[misc]
    pass


class FencedAsyncScheduler(FenceMixin, AsyncScheduler):  # type: ignore[misc]
    pass


def FencedScheduler(*args: Any, **kwargs: Any) -> Scheduler:
    """The ``--scheduler-cls`` target: vLLM's scheduler of the kind vLLM chose, fenced."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    use_async = bool(vllm_config is not None and vllm_config.scheduler_config.async_scheduling)
    cls = FencedAsyncScheduler if use_async else FencedSyncScheduler
    return cls(*args, **kwargs)
