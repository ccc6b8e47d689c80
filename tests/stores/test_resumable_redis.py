"""The Redis stream store's stored form of an item (``encode`` / ``decode``): what a reader on another replica reads
back is the item the owner wrote. The store against a real Redis: tests/integration/test_redis_streams.py."""

from __future__ import annotations

import pytest

from ttft_sse.engine.base import Finished, Piece, Usage
from ttft_sse.errors import Overloaded
from ttft_sse.stores.resumable import Item
from ttft_sse.stores.resumable_redis import decode, encode


@pytest.mark.parametrize(
    "item",
    [
        Piece(3, " café ✓"),
        Finished("length", Usage(1147, 8, 1116), {"prefill_ms": 97.9, "decode_ms": 97.1}),
        Finished("stop", Usage(44, 2, 0), {}, degraded=True),
    ],
)
def test_an_item_reads_back_as_written(item: Item) -> None:
    assert decode(*encode(item)) == item


def test_an_error_reads_back_as_the_same_json() -> None:
    error = Overloaded("the server is full", code="queue_full")
    assert decode(*encode(error)).to_dict() == error.to_dict()  # its class is not kept: the event's JSON is
