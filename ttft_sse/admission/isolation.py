"""Whose requests share prefix-cache blocks: the cache salt of a request, from its caller's key and its own.

A shared prefix cache answers a prompt it holds the start of sooner, so a caller can learn, by timing its own
requests, whether someone else sent a given prompt lately (a system prompt, a document). ``TTFT_PREFIX_ISOLATION=key``
keeps each API key's prefixes apart; a request's ``cache_salt`` (vLLM's name) keeps its own apart from every request
with another salt or none. The trade-off, and why the default is ``shared``: docs/settings.md, "Isolation".
"""

from __future__ import annotations

SHARED = "shared"
KEY = "key"


def cache_salt(isolation: str, key_id: str | None, requested: str) -> str:
    """The salt the engine hashes the request's blocks from: its key's under ``isolation="key"`` (none for an open
    server, whose callers are one), and its own ``requested`` one; empty where neither applies (the shared cache)."""
    parts = []
    if isolation == KEY and key_id is not None:
        parts.append(f"key:{key_id}")
    if requested:
        parts.append(f"salt:{requested}")
    return "\x00".join(parts)
