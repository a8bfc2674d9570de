"""The reference engine: the isolation core, the tiny model and a batching scheduler.

One scheduler thread steps every running sequence together: each step admits waiting requests
(all or nothing, for the prompt plus ``max_tokens``; first come first served within a tenant, across
tenants by fair share), feeds each running sequence either its next prompt chunk (chunked prefill)
or its last generated token, runs the model once per adapter group, registers the blocks that became
full in the prefix cache, and samples greedily.

Tenants share the engine by weight (:mod:`kvfence.isolation.fairshare`): the waiting queue is taken in
the policy's order, each tenant runs at most its share of the running slots and computes at most its
share of the step's tokens (what a tenant leaves unused goes to the others), and a tenant below its
share of the slots that cannot be admitted preempts a sequence of the tenant furthest above its share
(the sequence returns to the waiting queue and recomputes what the prefix cache no longer holds).
What fair share charges each tenant is exported as ``kvfence_engine_tenant_service_units_total{tenant}``,
and the steps each request waited before the step that admitted it as the histogram
``kvfence_engine_tenant_queue_steps{tenant}``: the series the vLLM plugin exports too.

Prefix-cache hits attach the cached blocks by reference and skip their computation: a request whose
first ``n`` prompt tokens are cached starts its prefill at position ``n``, reading those positions'
K/V from the shared blocks.

Events flow back through a per-request callback, called on the scheduler thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvfence.contract import cache_namespace
from kvfence.contract.engine_config import EngineConfig, SharedPrefixConfig
from kvfence.contract.errors import CODE_KV_CACHE_TOO_SMALL, CODE_MAX_KV_BLOCKS_EXCEEDED
from kvfence.engine.model import EOS, ByteTokenizer, Chunk, IntArray, ModelDims, TinyTransformer
from kvfence.isolation.allocator import (
    AllocationError,
    BeyondMaximum,
    FencedAllocator,
    PoolExhausted,
    QuotaExceeded,
    StaleReference,
)
from kvfence.isolation.fairshare import FairShare, QueueSteps, request_cost
from kvfence.isolation.metrics import EngineMetrics
from kvfence.isolation.prefix_cache import CacheContext, HashFn, PrefixCache
from kvfence.isolation.shared_prefixes import Pinned, SharedPrefixes, render, shared_namespace

log = logging.getLogger("kvfence.engine")

#: Prompt tokens one sequence computes per step (chunked prefill keeps steps short and fair).
PREFILL_CHUNK = 64
#: Tokens computed per step, all sequences together (decode tokens first, then prefill chunks).
MAX_BATCH_TOKENS = 256
#: Sequences running at once.
MAX_RUNNING = 64


@dataclass(frozen=True, slots=True)
class Admitted:
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Token:
    token_id: int


@dataclass(frozen=True, slots=True)
class Finished:
    reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Failed:
    status: int
    code: str
    message: str
    #: seconds after which a retry may succeed (the ``Retry-After`` of a 429); None: no header
    retry_after: int | None = None


Event = Admitted | Token | Finished | Failed


class RequestError(ValueError):
    """A request the engine refuses before queueing it (HTTP 400)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass(eq=False)
class Request:
    request_id: str
    tenant: str
    ctx: CacheContext
    prompt: IntArray
    max_tokens: int
    sink: Callable[[Event], None]
    # --- scheduler state ---
    tokens: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    length: int = 0  # tokens known (prompt + generated)
    computed: int = 0  # tokens whose K/V is in the pool
    generated: int = 0
    cached_tokens: int = 0
    admitted: bool = False
    cancelled: bool = False
    arrived_step: int = 0  # the engine's step count when it was submitted

    @property
    def adapter(self) -> str:
        return self.ctx.adapter


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        metrics: EngineMetrics | None = None,
        hash_fn: HashFn | None = None,
        dims: ModelDims | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self.model = TinyTransformer(
            config.model.name,
            config.model.revision,
            max_len=config.max_model_len,
            adapters=config.adapters,
            quantization=config.quantization,
            dtype=config.dtype,
            dims=dims,
        )
        self.kv = self.model.new_kv_pool(config.num_blocks, config.block_size)
        pc = config.prefix_cache
        self.prefix_cache = (
            PrefixCache(config.block_size, self.metrics, hash_algorithm=pc.hash_algorithm, hash_fn=hash_fn)
            if pc.enabled
            else None
        )
        self.allocator = FencedAllocator(
            config.trust_class,
            config.num_blocks,
            config.block_size,
            tensor_parallel_size=config.tensor_parallel_size,
            quotas=config.quotas,
            metrics=self.metrics,
            prefix_cache=self.prefix_cache,
        )
        self.fair = FairShare(config.quotas.default.weight, config.quotas.weights())
        #: the steps run so far, and what each request waited before the one that admitted it
        self.steps = 0
        self.waits = QueueSteps()
        self.metrics.export_queue_steps(self.waits)
        self.tokenizer = ByteTokenizer()
        #: the declared shared prefixes, pinned (replaced on the scheduler thread only)
        self.shared = SharedPrefixes()
        self._pending_shared: list[SharedPrefixConfig] | None = None
        self._pin_epoch = 0
        if self.prefix_cache is not None and pc.shared_prefixes:
            # At start a prefix that cannot be pinned fails the engine: a declaration is never accepted
            # and ignored.
            self.shared = self._pin_all(pc.shared_prefixes, strict=True)
        elif pc.shared_prefixes:
            raise ValueError("prefixCache.sharedPrefixes needs the prefix cache (prefixCache.enabled)")
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._by_id: dict[str, Request] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._busy = False
        self._register_gauges()

    def _register_gauges(self) -> None:
        """Gauges read from the allocator and the queues at scrape time."""
        m = self.metrics
        a = self.allocator
        m.gauge_function("kvfence_engine_kv_blocks_total", "KV blocks in the pool", lambda: a.num_blocks)
        m.gauge_function(
            "kvfence_engine_kv_blocks_free", "KV blocks in the clean free list", lambda: a.num_free
        )
        m.gauge_function(
            "kvfence_engine_kv_blocks_active", "KV blocks referenced by sequences", lambda: a.num_active
        )
        m.gauge_function(
            "kvfence_engine_kv_blocks_fenced", "KV blocks waiting for their writers", lambda: a.num_fenced
        )
        m.gauge_function(
            "kvfence_engine_kv_blocks_cached", "Unreferenced KV blocks held by the cache", lambda: a.num_cold
        )
        m.gauge_function(
            "kvfence_engine_kv_blocks_pinned",
            "KV blocks pinned for the declared shared prefixes (outside every tenant's quota)",
            lambda: a.num_pinned,
        )
        m.gauge_function(
            "kvfence_engine_shared_prefixes_pinned",
            "Declared shared prefixes computed and pinned (one per prefix and served model)",
            lambda: len(self.shared),
        )
        m.gauge_function(
            "kvfence_engine_requests_waiting", "Requests waiting for KV blocks", lambda: len(self._waiting)
        )
        m.gauge_function(
            "kvfence_engine_requests_running", "Requests being generated", lambda: len(self._running)
        )

    # --- request construction ---------------------------------------------------------------------
    def served_models(self) -> list[str]:
        return [self.config.model.served, *self.config.adapters]

    def adapter_for(self, model: str) -> str | None:
        """The adapter a `model` field selects ("" for the base model), or None if not served."""
        if model == self.config.model.served:
            return ""
        return model if model in self.config.adapters else None

    def context(self, namespace: str, adapter: str) -> CacheContext:
        c = self.config
        return CacheContext(c.model.name, c.model.revision, adapter, c.quantization, c.trust_class, namespace)

    def expected_namespace(self, tenant: str) -> str:
        return cache_namespace(self.config.trust_class, tenant, self.config.prefix_cache.scope)

    def check_lengths(self, prompt_tokens: int, max_tokens: int, param: str = "prompt") -> None:
        limit = self.config.max_model_len
        if max_tokens < 1:
            raise RequestError("invalid_value", "max_tokens must be at least 1", "max_tokens")
        if prompt_tokens + max_tokens > limit:
            raise RequestError(
                "context_length_exceeded",
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {param}, {max_tokens} in the "
                f"completion). Please reduce the length of the {param} or completion.",
                param,
            )

    # --- declared shared prefixes ---------------------------------------------------------------------
    def _pin_all(self, decls: Sequence[SharedPrefixConfig], *, strict: bool) -> SharedPrefixes:
        """Compute and pin every declared prefix for every served model. ``strict``: a prefix that
        cannot be pinned raises (at start); otherwise it is logged and left out (on a reload)."""
        pinned: list[Pinned] = []
        for decl in decls:
            for adapter in ["", *self.config.adapters]:
                try:
                    p = self._pin(decl, adapter)
                except (AllocationError, ValueError) as e:
                    msg = f"shared prefix {decl.name!r} (model {adapter or self.config.model.served!r}): {e}"
                    if strict:
                        raise ValueError(f"cannot pin {msg}") from None
                    log.error("not pinned: %s", msg)
                    continue
                if p is not None:
                    pinned.append(p)
        return SharedPrefixes(pinned)

    def _pin(self, decl: SharedPrefixConfig, adapter: str) -> Pinned | None:
        tokens = render(decl, self.tokenizer)
        bs = self.config.block_size
        full = len(tokens) // bs * bs
        if full == 0:
            log.warning("shared prefix %r is shorter than one block: nothing to share", decl.name)
            return None
        self._pin_epoch += 1  # a re-pin (reload) opens its sequence while the old one still holds
        seq_id = ("kvfence-shared", decl.name, adapter, self._pin_epoch)
        ctx = self.context(shared_namespace(self.config.trust_class), adapter)
        alloc = self.allocator.pin(seq_id, ctx, tokens[:full])
        try:
            done = alloc.num_cached_tokens
            while done < full:  # compute what the shared namespace does not hold yet
                end = min(full, done + PREFILL_CHUNK)
                self.model.forward(self.kv, [Chunk(alloc.table, done, tokens[done:end])], adapter)
                done = end
            self.allocator.commit(seq_id, tokens, full)
            blocks, handles, keys = self.allocator.pinned_chain(seq_id)
        except BaseException:
            self.allocator.release(seq_id)
            raise
        log.info("shared prefix %r pinned: %d blocks (model %r)", decl.name, len(blocks), adapter or "base")
        return Pinned(decl.name, adapter, tokens, tuple(blocks), tuple(handles), tuple(keys), seq_id)

    def set_shared_prefixes(self, decls: Sequence[SharedPrefixConfig]) -> None:
        """Declare a new list (a reloaded config): the scheduler pins the new list before its next step,
        switches to it, then unpins what the old one held (any thread)."""
        if self.prefix_cache is None:
            if decls:
                log.warning("sharedPrefixes ignored: the prefix cache is disabled")  # refused at start
            return
        with self._cond:
            self._pending_shared = list(decls)
            self._cond.notify_all()

    def _apply_shared(self) -> None:
        with self._cond:
            decls, self._pending_shared = self._pending_shared, None
        if decls is None:
            return
        new = self._pin_all(decls, strict=False)
        old, self.shared = self.shared, new
        for p in old.pinned:  # their blocks stay cached (cold, reclaimable by anyone) until evicted
            self.allocator.release(p.seq_id)
        log.info("shared prefixes: %d pinned (%d blocks)", len(new), new.num_blocks)

    # --- submission (any thread) --------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        self.check_lengths(len(req.prompt), req.max_tokens)
        total = len(req.prompt) + req.max_tokens
        req.tokens = np.zeros(total, dtype=np.int32)
        req.tokens[: len(req.prompt)] = req.prompt
        req.length = len(req.prompt)
        with self._cond:
            if self._stopping:
                req.sink(Failed(503, "engine_shutting_down", "the engine is shutting down"))
                return
            if req.request_id in self._by_id:
                raise ValueError(f"duplicate request id {req.request_id!r}")
            self._by_id[req.request_id] = req
            req.arrived_step = self.steps
            self._waiting.append(req)
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        with self._cond:
            req = self._by_id.get(request_id)
            if req is not None:
                req.cancelled = True
                self._cond.notify_all()

    # --- scheduler --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="kvfence-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what is running (up to ``timeout``), fail what is waiting, stop the thread."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._stopping = True
            waiting = list(self._waiting)
            self._waiting.clear()
            for r in waiting:
                self._by_id.pop(r.request_id, None)
            self._cond.notify_all()
        for r in waiting:
            r.sink(Failed(503, "engine_shutting_down", "the engine is shutting down"))
        with self._cond:
            while (self._running or self._busy) and time.monotonic() < deadline:
                self._cond.wait(0.05)
            for r in self._running:
                r.cancelled = True
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()) + 5.0)
            self._thread = None
        else:
            self._reap()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._stopping
                    and not self._waiting
                    and not self._running
                    and self._pending_shared is None
                ):
                    self._cond.wait()
                if self._stopping and not self._running:
                    return
                self._busy = True
            try:
                self.step()
            except Exception:  # keep serving: fail what was in the step, never leak its blocks
                log.exception("scheduler step failed")
                self._fail_running(500, "internal_error", "the engine failed to compute this request")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def run_until_idle(self) -> None:
        """Step in the calling thread until nothing is waiting or running (tests, benchmarks)."""
        if self._thread is not None:
            raise RuntimeError("the scheduler thread is running")
        while True:
            with self._cond:
                if not self._waiting and not self._running and self._pending_shared is None:
                    return
            self.step()

    def _reap(self) -> None:
        """Release cancelled running sequences and drop cancelled waiting requests."""
        keep: list[Request] = []
        for r in self._running:
            if r.cancelled:
                self._finish(r, None)
            else:
                keep.append(r)
        self._running = keep
        with self._cond:
            dropped = [r for r in self._waiting if r.cancelled]
            for r in dropped:
                self._waiting.remove(r)
                self._by_id.pop(r.request_id, None)

    def set_weights(self, default_weight: int, weights: dict[str, int]) -> None:
        """New fair-share weights (a reloaded config), used from the next step on (any thread)."""
        self.fair.set_weights(default_weight, weights)

    def _admit(self) -> None:
        """Admit waiting requests in the fair-share order, each tenant up to its share of the running
        slots. A request that does not fit yet blocks only later requests of *its own tenant*
        (per-tenant FIFO): one tenant's large request cannot hold back another tenant whose request
        fits, e.g. in its guaranteed share. A tenant below its share of the slots that finds no free
        slot, or no free blocks, preempts one sequence of the tenant furthest above its share."""
        with self._cond:
            if self._stopping:
                return
            queue = [r for r in self._waiting if not r.cancelled]
        running = Counter(r.tenant for r in self._running)
        self.fair.sync({*running, *(r.tenant for r in queue)})
        shares = self.fair.divide(MAX_RUNNING, running + Counter(r.tenant for r in queue))
        blocked: set[str] = set()
        exhausted: list[tuple[Request, PoolExhausted]] = []
        for req in self.fair.order(queue, _tenant_of, _prompt_cost):
            if req.tenant in blocked or running[req.tenant] >= shares[req.tenant]:
                continue
            if len(self._running) >= MAX_RUNNING and not self._preempt(running, shares):
                return
            try:
                self._start(req)
            except BeyondMaximum as e:  # no wait makes it fit: a 4xx that clients do not retry
                self._drop_waiting(req, Failed(400, CODE_MAX_KV_BLOCKS_EXCEEDED, str(e)))
                continue
            except QuotaExceeded as e:  # the tenant's other requests hold its blocks: fits once they end
                self._drop_waiting(req, Failed(429, "quota_exceeded", str(e), retry_after=1))
                continue
            except PoolExhausted as e:
                blocked.add(req.tenant)
                exhausted.append((req, e))
                self._preempt(running, shares)  # frees blocks for the next step
                continue
            running[req.tenant] += 1
        if exhausted and not self._running:
            # Nothing runs, so nothing will free blocks: the first request that did not fit never will.
            # The request made this, not the engine: a 400 that clients do not retry.
            first, err = exhausted[0]
            self._drop_waiting(
                first, Failed(400, CODE_KV_CACHE_TOO_SMALL, f"{err}; it can never fit this engine")
            )

    def _start(self, req: Request) -> None:
        """Open ``req``'s sequence (raises the allocator's errors) and move it to the running list. A
        preempted request resumes: what the prefix cache still holds of its tokens is not recomputed."""
        alloc = self.allocator.allocate_sequence(
            req.request_id,
            req.tenant,
            len(req.tokens),
            ctx=req.ctx,
            prompt=req.tokens[: req.length],
            shared=self.shared.match(req.adapter, req.prompt) if self.shared.pinned else None,
        )
        with self._cond:
            self._waiting.remove(req)
        req.computed = alloc.num_cached_tokens
        self._charge(req.tenant, request_cost(cached=alloc.num_cached_tokens))
        self._running.append(req)
        if not req.admitted:
            req.admitted = True
            self.waits.started(req.tenant, req.arrived_step, self.steps)
            req.cached_tokens = alloc.num_cached_tokens
            req.sink(Admitted(alloc.num_cached_tokens))

    def _preempt(self, running: Counter[str], shares: dict[str, int]) -> bool:
        """Send the latest sequence of the tenant furthest above its share of the slots back to the
        front of the waiting queue (its blocks released); False when no tenant is above its share."""
        tenant = self.fair.victim(running, shares)
        if tenant is None:
            return False
        victim = next(r for r in reversed(self._running) if r.tenant == tenant)
        self._running.remove(victim)
        self.allocator.release(victim.request_id)
        victim.computed = 0
        running[tenant] -= 1
        with self._cond:
            self._waiting.appendleft(victim)
        self.metrics.preemptions.inc()
        return True

    def _drop_waiting(self, req: Request, event: Failed) -> None:
        with self._cond:
            self._waiting.remove(req)
            self._by_id.pop(req.request_id, None)
        req.sink(event)

    def step(self) -> None:
        """One scheduler iteration."""
        self.steps += 1
        if self._pending_shared is not None:
            self._apply_shared()
        self._reap()
        self._admit()
        if not self._running:
            return
        groups: dict[str, list[tuple[Request, Chunk, bool]]] = {}
        grants = self._token_grants()
        # Within a tenant's grant its decoding sequences come first, then prefill chunks in admission order.
        for r in sorted(self._running, key=lambda r: r.length - r.computed > 1):
            try:
                table = self.allocator.readable_table(r.request_id)
            except StaleReference as e:  # refused and counted by the allocator; never read
                self._running.remove(r)
                if self.allocator.is_open(r.request_id):
                    self.allocator.release(r.request_id)
                with self._cond:
                    self._by_id.pop(r.request_id, None)
                r.sink(Failed(500, "stale_reference", str(e)))
                continue
            n = min(r.length - r.computed, PREFILL_CHUNK, grants[r.tenant])
            if n <= 0:
                continue
            grants[r.tenant] -= n
            end = r.computed + n
            groups.setdefault(r.adapter, []).append(
                (r, Chunk(table, r.computed, r.tokens[r.computed : end]), end == r.length)
            )
        for adapter, items in groups.items():
            logits = self.model.forward(self.kv, [c for _, c, _ in items], adapter)
            next_ids = self.model.greedy(logits)
            for (r, c, sample), nxt in zip(items, next_ids, strict=True):
                self._advance(r, c, sample, int(nxt))
        self._running = [r for r in self._running if r.request_id in self._by_id]

    def _token_grants(self) -> dict[str, int]:
        """Each tenant's share of the step's tokens: what its running sequences could compute (one
        token per decoding sequence, a prompt chunk per prefilling one) divided by weight."""
        demand: Counter[str] = Counter()
        for r in self._running:
            demand[r.tenant] += min(r.length - r.computed, PREFILL_CHUNK)
        return self.fair.divide(MAX_BATCH_TOKENS, demand)

    def _charge(self, tenant: str, units: int) -> None:
        """Charge fair share, and count the units on the tenant's exported service counter."""
        self.fair.charge(tenant, units)
        if units:
            self.metrics.service_units.labels(tenant).inc(units)

    def _advance(self, r: Request, c: Chunk, sample: bool, tok: int) -> None:
        """Account a computed chunk of ``r`` and, at its end, the token sampled after it. A decoding
        step (the last generated token fed back) is charged as the output token it yields; any other
        chunk is charged as computed prompt tokens, plus the output token it may yield."""
        decode = len(c.tokens) == 1 and r.computed >= len(r.prompt)
        r.computed += len(c.tokens)
        self.allocator.commit(r.request_id, r.tokens, r.computed)
        self._charge(r.tenant, request_cost(prefill=0 if decode else len(c.tokens), output=int(sample)))
        if not sample:
            return
        if tok == EOS:
            self._finish(r, "stop")
            return
        r.tokens[r.length] = tok
        r.length += 1
        r.generated += 1
        self.metrics.generated_tokens.inc()
        r.sink(Token(tok))
        if r.generated >= r.max_tokens:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str | None) -> None:
        """Release a sequence's blocks (its writes are complete: every rank signals the fence)."""
        self.allocator.release(r.request_id)
        with self._cond:
            self._by_id.pop(r.request_id, None)
        if reason is not None:
            r.sink(Finished(reason, len(r.prompt), r.generated, r.cached_tokens))

    def _fail_running(self, status: int, code: str, message: str) -> None:
        for r in self._running:
            if self.allocator.is_open(r.request_id):
                self.allocator.release(r.request_id)
            with self._cond:
                self._by_id.pop(r.request_id, None)
            r.sink(Failed(status, code, message))
        self._running = []

    # --- synchronous helper -------------------------------------------------------------------------
    def generate(
        self,
        tenant: str,
        prompt: IntArray,
        max_tokens: int,
        *,
        adapter: str = "",
        namespace: str | None = None,
        request_id: str | None = None,
    ) -> tuple[list[int], Finished | Failed]:
        """Generate in the calling thread (no scheduler thread). Returns the tokens and the end event."""
        out: list[int] = []
        end: list[Finished | Failed] = []

        def sink(ev: Event) -> None:
            if isinstance(ev, Token):
                out.append(ev.token_id)
            elif isinstance(ev, Finished | Failed):
                end.append(ev)

        ns = namespace if namespace is not None else self.expected_namespace(tenant)
        rid = request_id or f"gen-{id(out)}-{time.monotonic_ns()}"
        self.submit(Request(rid, tenant, self.context(ns, adapter), prompt, max_tokens, sink))
        self.run_until_idle()
        return out, end[0]


def _tenant_of(r: Request) -> str:
    return r.tenant


def _prompt_cost(r: Request) -> int:
    """What admitting ``r`` is projected to cost its tenant: computing its tokens so far."""
    return request_cost(prefill=r.length)
