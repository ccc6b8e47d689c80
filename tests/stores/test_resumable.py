"""The stream buffer's rules on their own: resume points, the ring, the queue and progress states. HTTP is in
integration/."""

from __future__ import annotations

import pytest

from ttft_sse.engine.base import Finished, Piece, Progress, Usage
from ttft_sse.errors import Gone, InvalidRequest
from ttft_sse.generation import Queued
from ttft_sse.stores.resumable import Entry, Stream, Streams


def make(buffer_events: int = 8) -> Stream:
    return Stream(Streams(grace=60, max_streams=4, buffer_events=buffer_events), "abc", buffer_events=buffer_events)


def test_resume_points_follow_the_ids_of_this_stream_only() -> None:
    stream = make()
    assert stream.resume_point(None) == 0 and stream.resume_point("") == 0
    with pytest.raises(InvalidRequest, match="has sent events up to none yet"):
        stream.resume_point("abc.0")
    for i in range(3):
        stream._publish(Piece(i, f"t{i}"))
    assert [stream.resume_point(f"abc.{n}") for n in range(3)] == [1, 2, 3]
    refusals = {
        "xyz.1": "foreign_event_id",  # another stream's
        "abc.3": "foreign_event_id",  # not sent yet
        "1": "invalid_event_id",
        "abc.": "invalid_event_id",
        "abc.-1": "invalid_event_id",
        "abc.\u0661": "invalid_event_id",  # ARABIC-INDIC DIGIT ONE: a digit, but not an ASCII one
        "abc.1234567890123": "invalid_event_id",
    }
    for last, code in refusals.items():
        with pytest.raises(InvalidRequest) as refused:
            stream.resume_point(last)
        assert (refused.value.code, refused.value.param) == (code, "Last-Event-ID"), last


def test_the_buffer_is_a_ring_and_nothing_is_published_after_the_final_item() -> None:
    stream = make(buffer_events=3)
    for i in range(5):
        stream._publish(Piece(i, f"t{i}"))
    stream._publish(Finished("stop", Usage(1, 5)))
    stream._publish(Piece(6, "late"))
    assert (stream.first, stream.last, stream.buffered, stream.ended) == (3, 5, 3, True)
    assert stream.resume_point("abc.2") == 3
    with pytest.raises(Gone, match="keeps the last 3 events"):
        stream.resume_point("abc.1")


async def test_a_reader_that_falls_behind_the_ring_is_told_so() -> None:
    stream = make(buffer_events=2)
    reader = stream.follow(0)
    stream._publish(Piece(0, "a"))
    assert await anext(reader) == Entry(0, Piece(0, "a"))
    for i in range(1, 4):  # the reader is slow: three more while it still holds the first
        stream._publish(Piece(i, "x"))
    with pytest.raises(Gone) as dropped:
        await anext(reader)
    assert dropped.value.code == "events_dropped"
    assert not stream.attached


async def test_the_queue_position_is_a_state_told_once_per_change_not_history() -> None:
    stream = make()
    stream._queued(2)
    reader = stream.follow(0)
    assert await anext(reader) == Queued(2)
    stream._queued(1)
    assert await anext(reader) == Queued(1)
    stream._publish(Piece(0, "a"))
    assert await anext(reader) == Entry(0, Piece(0, "a"))
    await reader.aclose()
    assert not stream.attached
    # A later reader is not told positions from before: only what is buffered.
    stream._publish(Finished("stop", Usage(1, 1)))
    assert [item async for item in stream.follow(0)] == [
        Entry(0, Piece(0, "a")),
        Entry(1, Finished("stop", Usage(1, 1))),
    ]


async def test_progress_is_a_state_told_once_per_change_and_gone_at_the_first_token() -> None:
    stream = make(buffer_events=2)
    stream._queued(1)
    stream._progressed(Progress(100, 24))  # admitted: the prompt is computing
    late = stream.follow(0)  # a reader that attaches mid-prompt hears the latest progress, not the queue before it
    assert await anext(late) == Progress(100, 24)
    stream._progressed(Progress(100, 24))  # the same again is no change: nothing to tell
    stream._progressed(Progress(100, 56))
    assert await anext(late) == Progress(100, 56)
    stream._publish(Piece(0, "a"))
    stream._progressed(Progress(100, 88))  # too late: the first token has come, so it is not kept
    stream._publish(Piece(1, "b"))
    assert [await anext(late), await anext(late)] == [Entry(0, Piece(0, "a")), Entry(1, Piece(1, "b"))]
    await late.aclose()
    # Not history: it takes no number and no place in the ring (2 items kept, both tokens), and a reader that
    # resumes, or starts over, gets the buffered items alone.
    stream._publish(Finished("stop", Usage(100, 2)))
    assert (stream.first, stream.last, stream.buffered) == (1, 2, 2)
    assert [item async for item in stream.follow(stream.resume_point("abc.0"))] == [
        Entry(1, Piece(1, "b")),
        Entry(2, Finished("stop", Usage(100, 2))),
    ]


async def test_a_reader_that_arrives_after_the_stream_went_is_told_why() -> None:
    registry = Streams(grace=60, max_streams=4, buffer_events=8)
    stream = Stream(registry, "abc", buffer_events=8)
    stream._publish(Piece(0, "a"))
    registry._remove(stream, "it was deleted")
    with pytest.raises(Gone, match="stream abc is gone: it was deleted") as gone:
        await anext(stream.follow(0))
    assert gone.value.code == "stream_expired"
