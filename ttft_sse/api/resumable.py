"""``POST /streams``, ``GET|DELETE /streams/{id}``: resumable streams, for ``EventSource`` and flaky networks.

``POST /streams`` takes the body of ``POST /stream`` (a whole conversation fits; a query string would not),
starts the generation at once and answers 201 ``{"id", "url", "lane"}``. ``GET`` on the url is the same SSE stream as
``/stream`` — ``queued``, ``progress`` (a long prompt), ``token`` … ``done`` | ``error`` — where every token and the
final event carry an id (``queued`` and ``progress`` are states, not history: no id);
a reconnect with ``Last-Event-ID`` (header, which ``EventSource`` sends by itself, or ``?lastEventId=``) gets
exactly what it missed, then the live rest. ``DELETE`` stops the generation. The rules (grace, buffers, ids) are
in :mod:`ttft_sse.stores.resumable`.

With ``TTFT_API_KEYS``, a stream is its creator key's: ``GET`` and ``DELETE`` take that key in a header, or the
stream's grant (``?grant=``, in the ``url`` the ``POST`` answered), which ``EventSource`` can send
(:mod:`ttft_sse.admission.grants`). Another key gets 404, as for an unknown id; no credential, 401.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ttft_sse.admission.grants import GRANT_PARAMETER, Grants
from ttft_sse.api.body import arrival_of, caller_of, generation_request, query_of, runtime_of
from ttft_sse.api.sse import CACHE_CONTROL, SSE_HEADERS, TokenStream, sse_event
from ttft_sse.engine.base import Progress
from ttft_sse.errors import InvalidRequest, Overloaded, Unauthorized, listed
from ttft_sse.generation import Queued
from ttft_sse.stores.resumable import Position, StreamStore, event_id

# Sent first on every stream: EventSource waits this long before reconnecting (browsers default to ~3 s).
RECONNECT_MS = 1000
# What clients that cannot set headers may send instead: Last-Event-ID, and (with keys) the stream's grant.
QUERY = ("lastEventId", GRANT_PARAMETER)
ENDPOINT = "streams"  # the label of these generations in logs and metrics


async def create_stream(request: Request) -> Response:
    runtime = runtime_of(request)
    caller = caller_of(request)  # with TTFT_API_KEYS, creating a stream needs a key, and the stream is that key's
    generation = await generation_request(request)
    streams = runtime.streams
    try:
        streams.reserve()
    except Overloaded as exc:
        runtime.metrics.observe_refused(ENDPOINT, exc)
        raise
    try:
        run = await runtime.generations.open(generation, caller=caller, arrival=arrival_of(request), endpoint=ENDPOINT)
    except BaseException:
        streams.unreserve()
        raise
    stream_id = await streams.start(run)
    url = f"{request.scope.get('root_path', '')}/streams/{stream_id}"
    body = {"id": stream_id, "url": url, "lane": caller.lane.label}  # the lane the caller's key gives it
    if caller.key_id is not None:
        grant = Grants(runtime.keyring).grant(stream_id, caller.key_id)
        body.update(url=f"{url}?{GRANT_PARAMETER}={grant}", grant=grant)
    return JSONResponse(body, status_code=201, headers={"Location": body["url"]})


async def stream_resource(request: Request) -> Response:
    runtime = runtime_of(request)
    stream_id: str = request.path_params["stream_id"]
    query = query_of(request)
    unknown = sorted(set(query) - set(QUERY))
    if unknown:
        raise InvalidRequest(
            f"unknown query parameter(s): {listed(unknown)}; accepted: {', '.join(QUERY)}", param=unknown[0]
        )
    for name in QUERY:
        if len(query.getlist(name)) > 1:
            raise InvalidRequest(f"{name} is given more than once", param=name)
    owner = _owner(request, stream_id)
    if request.method == "DELETE":
        await runtime.streams.delete(stream_id, owner)
        return Response(status_code=204)
    last_event_id = request.headers.get("last-event-id") or query.get("lastEventId")
    position = await runtime.streams.locate(stream_id, last_event_id, owner)
    if position.finished:
        # The client has the final event already. 204 is what tells EventSource to stop reconnecting
        # (a 200 that ends at once would have it come back every RECONNECT_MS).
        return Response(status_code=204)
    if request.method == "HEAD":
        return Response(headers=SSE_HEADERS)
    return TokenStream(
        _events(runtime.streams, position),
        headers={"Cache-Control": CACHE_CONTROL},
        ping=runtime.settings.ping_seconds,
        send_timeout=60,
    )


def _owner(request: Request, stream_id: str) -> str | None:
    """The key id the request speaks for: its key (in a header), else the stream's grant; None without keys."""
    keyring = runtime_of(request).keyring
    if not keyring.enabled:
        return None
    grant = request.query_params.get(GRANT_PARAMETER)
    if grant is None or "authorization" in request.headers or "x-api-key" in request.headers:
        return caller_of(request).key_id  # 401 without a valid key
    if not grant:
        raise Unauthorized("the stream's grant is empty", code="invalid_grant")
    return Grants(keyring).holder(stream_id, grant)


async def _events(streams: StreamStore, position: Position) -> AsyncIterator[ServerSentEvent]:
    yield ServerSentEvent(retry=RECONNECT_MS)
    try:
        # aclosing: when the client goes, this generator is closed at its own yield; the reader must detach
        # then (it starts the grace clock), not whenever the garbage collector gets to it.
        async with aclosing(streams.follow(position)) as entries:
            async for entry in entries:
                if isinstance(entry, Queued | Progress):
                    yield sse_event(entry)
                else:
                    yield sse_event(entry.item, id=event_id(position.stream_id, entry.seq))
    except Exception as exc:  # falling behind the buffer (Gone), or the store failing; no id: it is not buffered
        yield sse_event(exc)
