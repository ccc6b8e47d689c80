"""API keys: who may generate, and in which priority lane.

``TTFT_API_KEYS`` lists ``key[:lane]`` entries separated by commas (or newlines), lane one of ``high``, ``normal``
(the default) or ``low``; ``@/path/to/file`` reads the same entries from a file instead (``#`` starts a comment),
which keeps the keys out of the process environment. With no keys configured the server is open and every
request takes the ``normal`` lane; with keys, a generating request without a valid one gets 401.

Keys are kept only as SHA-256 digests once parsed. What reaches logs, job records and responses is a *key id*
(``key-`` and the digest's first 8 hex digits), never the key itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ttft_sse.admission.gate import KEY_LANES, Lane
from ttft_sse.errors import Unauthorized

MIN_KEY_LENGTH = 8


@dataclass(frozen=True)
class Caller:
    """Who is asking: the lane their requests queue in, and the id of the key they showed (None when open)."""

    lane: Lane
    key_id: str | None = None

    def as_job(self) -> Caller:
        """The same caller's overflow job: always the lowest lane, below every interactive request."""
        return Caller(Lane.JOBS, self.key_id)


ANONYMOUS = Caller(Lane.NORMAL)


def key_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def parse_keys(spec: str) -> dict[str, Lane]:
    """``key[:lane]`` entries (or ``@file`` holding them) → {key: lane}. Raises ``ValueError`` with a sentence.

    Messages never quote a key: they name the entry by its position.
    """
    text = spec.strip()
    where = "TTFT_API_KEYS"
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read the API key file {str(path)!r}: {exc.strerror or exc}") from None
        where = f"the API key file {str(path)!r}"
        text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    keys: dict[str, Lane] = {}
    entries = [entry.strip() for line in text.splitlines() for entry in line.split(",")]
    for number, entry in enumerate((e for e in entries if e), start=1):
        key, lane_name = entry, "normal"
        if ":" in entry:
            key, _, lane_name = entry.rpartition(":")
        lane = KEY_LANES.get(lane_name.strip().lower())
        if lane is None:
            raise ValueError(
                f"{where}: entry {number} names lane {lane_name.strip()!r}; lanes are {', '.join(KEY_LANES)}"
            )
        key = key.strip()
        if len(key) < MIN_KEY_LENGTH or not key.isascii() or not key.isprintable() or " " in key:
            raise ValueError(
                f"{where}: entry {number} is not a usable key: use at least {MIN_KEY_LENGTH} printable ASCII "
                "characters without spaces or commas"
            )
        if key in keys:
            raise ValueError(f"{where}: entry {number} repeats an earlier key")
        keys[key] = lane
    if not keys:
        raise ValueError(f"{where} holds no keys; leave it unset for an open server")
    return keys


class Keyring:
    """Looks a presented key up by its digest and says which lane it takes."""

    def __init__(self, keys: Mapping[str, Lane] | None = None) -> None:
        self._by_digest = {
            hashlib.sha256(key.encode()).digest(): Caller(lane, key_id(key)) for key, lane in (keys or {}).items()
        }

    @classmethod
    def from_spec(cls, spec: str | None) -> Keyring:
        return cls(parse_keys(spec) if spec else None)

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(caller.key_id for caller in self._by_digest.values() if caller.key_id is not None)

    def secret(self, key_id: str) -> bytes:
        """The digest of the key ``key_id`` names: a secret only its holder and this server know (grants.py, beside
        it, signs with it). ``KeyError`` for a key id this keyring does not hold."""
        for digest, caller in self._by_digest.items():
            if caller.key_id == key_id:
                return digest
        raise KeyError(key_id)

    def identify(self, presented: str | None) -> Caller:
        """The caller for a presented key (None: none was sent). Raises ``Unauthorized`` when keys are on."""
        if not self.enabled:
            return ANONYMOUS
        if not presented:
            raise Unauthorized(
                "an API key is required: send it as 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
                code="missing_api_key",
            )
        caller = self._by_digest.get(hashlib.sha256(presented.encode()).digest())
        if caller is None:
            raise Unauthorized("the API key is not valid", code="invalid_api_key")
        return caller
