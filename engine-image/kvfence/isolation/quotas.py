"""Per-tenant KV-block accounting: usage, hard maximum, guaranteed share.

A tenant's *usage* is the number of blocks charged to it: every block it allocated that is not back
in the clean free list (active, fenced, or cold and cached). Blocks a tenant merely shares through a
prefix-cache hit (scope TrustClass) stay charged to the tenant that computed them.

* **Hard maximum** (``maxBlocks``): a tenant's usage never exceeds it. When a tenant at its maximum
  needs blocks, its own cold cached blocks are evicted to make room; if its *active* blocks alone
  would exceed the maximum, the request is refused (:class:`QuotaExceeded`; :class:`BeyondMaximum`
  when the request alone needs more than the maximum).
* **Guaranteed share** (``guaranteedBlocks``): ``max(0, guaranteed - usage)`` blocks of the clean free
  list are reserved for the tenant (other tenants cannot allocate them), and other tenants may evict
  the tenant's cold blocks only while its usage is above its guarantee.

Tenants listed in the configuration hold their reservation from the start. Other tenants get the
default quota while they hold blocks or have open sequences, and are forgotten when idle.

Blocks of the trust class's declared shared prefixes (:mod:`kvfence.isolation.shared_prefixes`) are
charged to :data:`SHARED_OWNER`, an account outside every quota: no maximum, no guarantee, never
forgotten, and no tenant id can name it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.contract.engine_config import QuotasConfig, TenantQuota
from kvfence.isolation.blocks import BlockList

#: The owner of pinned shared-prefix blocks (tenant ids match ``[a-z0-9][-a-z0-9_.]*``: never this).
SHARED_OWNER = "kvfence:shared"


class AllocationError(Exception):
    """A request for blocks cannot be granted; nothing was allocated."""


class QuotaExceeded(AllocationError):
    """The tenant's hard maximum would be exceeded."""

    def __init__(self, tenant: str, needed: int, active: int, maximum: int) -> None:
        super().__init__(
            f"KV-block quota exceeded for tenant {tenant!r}: the request needs {needed} blocks, the tenant "
            f"holds {active} active blocks and its maximum is {maximum}"
        )
        self.tenant = tenant
        self.needed = needed
        self.active = active
        self.maximum = maximum


class BeyondMaximum(QuotaExceeded):
    """The request alone needs more blocks than the tenant's hard maximum: no wait can make it fit."""

    def __init__(self, tenant: str, needed: int, maximum: int, block_size: int) -> None:
        AllocationError.__init__(
            self,
            f"KV-block quota exceeded for tenant {tenant!r}: the prompt and max_tokens need {needed} KV "
            f"blocks of {block_size} tokens, more than the tenant's maximum of {maximum} (maxKVBlocks); "
            "the request can never be served within it",
        )
        self.tenant = tenant
        self.needed = needed
        self.active = 0
        self.maximum = maximum


class PoolExhausted(AllocationError):
    """Not enough blocks obtainable for the tenant right now (free, own cold, or reclaimable)."""

    def __init__(self, tenant: str, needed: int, obtainable: int) -> None:
        super().__init__(
            f"KV cache exhausted: tenant {tenant!r} needs {needed} blocks, only {obtainable} are obtainable"
        )
        self.tenant = tenant
        self.needed = needed
        self.obtainable = obtainable


@dataclass(slots=True, eq=False)
class TenantAccount:
    tenant: str
    max_blocks: int
    guaranteed: int
    listed: bool
    #: False when the tenant has no ``maxBlocks`` (its maximum is then the pool itself)
    limited: bool = True
    usage: int = 0
    open_sequences: int = 0
    #: the tenant's unreferenced cached blocks, least recently used first
    cold: BlockList = field(default_factory=BlockList)

    @property
    def active(self) -> int:
        """Charged blocks that are not cold (active or fenced)."""
        return self.usage - len(self.cold)

    @property
    def unused_reservation(self) -> int:
        return max(0, self.guaranteed - self.usage)

    @property
    def reclaimable_by_others(self) -> int:
        """Cold blocks other tenants may evict: only those beyond the guaranteed share."""
        return min(len(self.cold), max(0, self.usage - self.guaranteed))


class QuotaBook:
    """The accounts of one allocator. Guarded by the allocator's lock."""

    def __init__(self, quotas: QuotasConfig, num_blocks: int) -> None:
        self._quotas = quotas
        self._num_blocks = num_blocks
        self.accounts: dict[str, TenantAccount] = {}
        #: sum over accounts of ``unused_reservation``, maintained incrementally
        self.total_unused_reservation = 0
        for tenant in quotas.tenants:
            self._open(tenant, listed=True)

    def _limits(self, q: TenantQuota) -> tuple[int, int]:
        maximum = self._num_blocks if q.max_blocks is None else min(q.max_blocks, self._num_blocks)
        return maximum, min(q.guaranteed_blocks, maximum)

    def _quota(self, tenant: str) -> TenantQuota:
        return TenantQuota() if tenant == SHARED_OWNER else self._quotas.for_tenant(tenant)

    def _open(self, tenant: str, *, listed: bool) -> TenantAccount:
        q = self._quota(tenant)
        listed = listed or tenant == SHARED_OWNER
        maximum, guaranteed = self._limits(q)
        cold = BlockList(f"cold/{tenant}")
        acct = TenantAccount(tenant, maximum, guaranteed, listed, limited=q.max_blocks is not None, cold=cold)
        self.accounts[tenant] = acct
        self.total_unused_reservation += acct.unused_reservation
        return acct

    def set_quotas(self, quotas: QuotasConfig) -> None:
        """Apply new limits (the operator rewrote the ConfigMap): every account keeps its usage and
        blocks; only its maximum, guarantee and listing change. A maximum below current usage refuses
        the tenant's next allocations until it is under again; nothing is taken away."""
        self._quotas = quotas
        for tenant in quotas.tenants:
            if tenant not in self.accounts:
                self._open(tenant, listed=True)
        for acct in list(self.accounts.values()):
            q = self._quota(acct.tenant)
            before = acct.unused_reservation
            acct.max_blocks, acct.guaranteed = self._limits(q)
            acct.limited = q.max_blocks is not None
            acct.listed = acct.tenant in quotas.tenants or acct.tenant == SHARED_OWNER
            self.total_unused_reservation += acct.unused_reservation - before
            self.forget_if_idle(acct)

    def account(self, tenant: str) -> TenantAccount:
        acct = self.accounts.get(tenant)
        return acct if acct is not None else self._open(tenant, listed=False)

    def add_usage(self, acct: TenantAccount, delta: int) -> None:
        before = acct.unused_reservation
        acct.usage += delta
        if acct.usage < 0:
            raise RuntimeError(f"usage of tenant {acct.tenant!r} went negative")
        self.total_unused_reservation += acct.unused_reservation - before

    def forget_if_idle(self, acct: TenantAccount) -> None:
        if not acct.listed and acct.usage == 0 and acct.open_sequences == 0:
            self.total_unused_reservation -= acct.unused_reservation
            del self.accounts[acct.tenant]

    def reserved_for_others(self, acct: TenantAccount) -> int:
        return self.total_unused_reservation - acct.unused_reservation
