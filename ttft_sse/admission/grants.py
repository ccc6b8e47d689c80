"""Who may read and delete a resumable stream, when ``TTFT_API_KEYS`` is set: its creator's key, or its grant.

A stream belongs to the key that created it. ``GET`` and ``DELETE`` on it take that key (``Authorization: Bearer``
or ``X-API-Key``); any other key is told what an unknown id is told (404), and no credential at all gets 401. A
browser's ``EventSource`` cannot send a header, so ``POST /streams`` also answers a *grant*: a short-lived token in
the stream's url (``?grant=``) that stands for the creator's key on that one stream, for ``GRANT_SECONDS``. It is an
HMAC of the stream's id and its expiry, keyed by the creator's key's SHA-256 digest (what every replica with the same
``TTFT_API_KEYS`` holds, and no one without the key can make). The key itself never travels in a url, where proxies
and browsers write it down.

Without keys, the id is the credential: anyone who has it may read and delete the stream, as before.

Stream ids are credentials either way, so logs show :func:`digest` of an id, never the id.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

from ttft_sse.admission.auth import Keyring
from ttft_sse.errors import Unauthorized

GRANT_SECONDS = 3600
"""How long a stream's grant opens it: longer than any one answer takes, so that a reconnect or a reloaded page
still resumes; after that, the key (in a header) still does."""
GRANT_PARAMETER = "grant"


def digest(stream_id: str) -> str:
    """What logs show of a stream's id: ``s-`` and 10 hex digits of its SHA-256, enough to follow one stream's lines
    and nothing to open it with."""
    return "s-" + hashlib.sha256(stream_id.encode()).hexdigest()[:10]


class Grants:
    """Makes and checks the grants of one keyring's keys (:mod:`ttft_sse.admission.grants`)."""

    def __init__(self, keyring: Keyring, *, seconds: float = GRANT_SECONDS) -> None:
        self._keyring = keyring
        self._seconds = seconds

    def grant(self, stream_id: str, key_id: str, *, now: float | None = None) -> str:
        """The grant for ``stream_id``, created by the key ``key_id``: ``<expiry>.<signature>``."""
        expires = int((time.time() if now is None else now) + self._seconds)
        return f"{expires}.{self._signature(stream_id, key_id, expires)}"

    def holder(self, stream_id: str, grant: str, *, now: float | None = None) -> str:
        """The key id a grant stands for on ``stream_id``; ``Unauthorized`` for one that is malformed, made for
        another stream or by no key of this server, or expired."""
        expiry, _, signature = grant.partition(".")
        if expiry.isascii() and expiry.isdigit() and len(expiry) <= 12:
            expires = int(expiry)
            for key_id in self._keyring.key_ids:
                if hmac.compare_digest(self._signature(stream_id, key_id, expires), signature):
                    if expires < (time.time() if now is None else now):
                        raise Unauthorized(
                            "the stream's grant has expired; send the API key in a header", code="expired_grant"
                        )
                    return key_id
        raise Unauthorized("the stream's grant is not valid for this stream", code="invalid_grant")

    def _signature(self, stream_id: str, key_id: str, expires: int) -> str:
        secret = self._keyring.secret(key_id)
        mac = hmac.new(secret, f"ttft-stream-grant\n{stream_id}\n{expires}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac[:24]).decode()
