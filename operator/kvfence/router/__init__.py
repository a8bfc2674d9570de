"""kvfence.router: the authenticated, quota-enforcing, OpenAI-compatible gateway from tenants to the
engine of their trust class (``kvfence-router``). See docs/router.md.

Modules: :mod:`.table` (routing table: load, validate, compile, hot reload), :mod:`.auth` (API key ->
tenant), :mod:`.quotas` (concurrency, requests and tokens per minute), :mod:`.proxy` (strip, salt,
sign, relay, engine health), :mod:`.server` (HTTP API, CLI, shutdown), :mod:`.http` (the HTTP/1.1
server), :mod:`.upstream` (the keep-alive client to the engines), :mod:`.metrics`, :mod:`.errors`.
"""
