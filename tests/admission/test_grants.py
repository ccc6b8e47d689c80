"""A stream's grant (ttft_sse/admission/grants.py): made by one key for one stream, for a while, and checked by the
keyring."""

from __future__ import annotations

import pytest

from tests.support.servers import ALICE, BOB, TWO_KEYS
from ttft_sse.admission.auth import Keyring, key_id
from ttft_sse.admission.grants import GRANT_SECONDS, Grants, digest
from ttft_sse.errors import Unauthorized


def test_a_grant_stands_for_its_key_on_its_stream_until_it_expires() -> None:
    grants = Grants(Keyring.from_spec(TWO_KEYS))
    grant = grants.grant("stream-a", key_id(ALICE), now=1000.0)
    assert grants.holder("stream-a", grant, now=1000.0 + GRANT_SECONDS) == key_id(ALICE)
    with pytest.raises(Unauthorized) as expired:
        grants.holder("stream-a", grant, now=1001.0 + GRANT_SECONDS)
    assert expired.value.code == "expired_grant"
    for stream, wrong in (("stream-b", grant), ("stream-a", grant.replace(".", ".x", 1)), ("stream-a", "1.")):
        with pytest.raises(Unauthorized) as refused:
            grants.holder(stream, wrong, now=1000.0)
        assert refused.value.code == "invalid_grant"
    assert grants.holder("stream-a", grants.grant("stream-a", key_id(BOB), now=1000.0), now=1000.0) == key_id(BOB)


def test_a_grant_made_with_other_keys_opens_nothing() -> None:
    """A server with other keys (another deployment) cannot make or take this one's grants."""
    ours, theirs = Grants(Keyring.from_spec(TWO_KEYS)), Grants(Keyring.from_spec("someone-else-key:high"))
    with pytest.raises(Unauthorized):
        ours.holder("s", theirs.grant("s", key_id("someone-else-key"), now=0.0), now=0.0)


def test_a_streams_digest_is_short_stable_and_not_the_id() -> None:
    assert digest("abc") == digest("abc") != digest("abd")
    assert digest("abc").startswith("s-") and len(digest("abc")) == 12 and "abc" not in digest("abc")
