"""Bearer API key -> tenant.

The routing table holds only ``sha256:<hex>`` of each key. The router hashes the presented key, looks
the digest up in a dict (the lookup's timing depends on the digest, not on the secret key, so it
reveals nothing usable) and confirms the match with :func:`hmac.compare_digest`. A key that is not in
the current table (unknown, or revoked by removing it from the binding) is a 401.
"""

from __future__ import annotations

import hashlib
import hmac

from kvfence.router.table import CompiledTable, TenantPlan

MAX_KEY_LENGTH = 512


class AuthError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise AuthError("missing", "Missing API key: send 'Authorization: Bearer <key>'.")
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError("malformed", "Malformed Authorization header: expected 'Bearer <key>'.")
    if len(token) > MAX_KEY_LENGTH:
        raise AuthError("malformed", "API key too long.")
    return token


def authenticate(table: CompiledTable, authorization: str | None) -> TenantPlan:
    """The tenant that owns the presented key, or :class:`AuthError`."""
    token = bearer_token(authorization)
    digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()
    entry = table.key_hashes.get(digest)
    # Confirm in constant time against the stored digest, so that no code path compares
    # secret-derived strings with an early-exit comparison.
    if entry is None or not hmac.compare_digest(entry[0], digest):
        raise AuthError("invalid", "Invalid or revoked API key.")
    return entry[1]
