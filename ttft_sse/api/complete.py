"""``POST /complete``: the whole reply as one JSON document — the batch path, beside the stream for comparison."""

from __future__ import annotations

from contextlib import aclosing

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ttft_sse.api.body import arrival_of, caller_of, generation_request, runtime_of
from ttft_sse.engine.base import Finished, Piece
from ttft_sse.generation import Run


async def complete(request: Request) -> Response:
    runtime = runtime_of(request)
    caller = caller_of(request)
    run = await runtime.generations.open(
        await generation_request(request), caller=caller, arrival=arrival_of(request), endpoint="complete"
    )
    reply = await collect(request, run)
    if reply is None:  # only when the client disconnected; nobody reads this
        return Response(status_code=499)
    text, finished = reply
    return JSONResponse(
        {
            "text": text,
            "finish_reason": finished.finish_reason,
            "usage": finished.usage.as_dict(),
            "timings": finished.timings,
            "degraded": finished.degraded,
        },
        headers={"Server-Timing": server_timing(finished.timings)},
    )


async def collect(request: Request, run: Run) -> tuple[str, Finished] | None:
    """Run ``run`` to the end and join its text; ``None`` when the client left first (its generation is stopped).

    Every non-streaming surface (``/complete``, ``/v1/…`` with ``stream: false``) answers through this one loop.
    """
    result: list[Finished] = []
    parts: list[str] = []
    failures: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def gather() -> None:
            try:
                await _collect(run, parts, result)
            except Exception as exc:  # re-raised below, outside the task group, so handlers see it bare
                failures.append(exc)
            finally:
                group.cancel_scope.cancel()

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()  # the caller left: stop its generation

        group.start_soon(gather)
        group.start_soon(watch_disconnect)
    if failures:
        raise failures[0]
    if not result:
        return None
    return "".join(parts), result[0]


async def _collect(run: Run, parts: list[str], result: list[Finished]) -> None:
    async with aclosing(run.events()) as events:
        async for item in events:
            if isinstance(item, Piece):
                parts.append(item.text)
            elif isinstance(item, Finished):
                result.append(item)


def server_timing(timings: dict[str, float]) -> str:
    """``Server-Timing: queue;dur=0.1, prefill;dur=151.2, …`` — browsers' dev tools show it per request.

    The parts are the ones the metrics observe, from the same clock readings: ``queue`` is
    ``ttft_sse_queue_wait_seconds``, ``prefill`` ``ttft_sse_prefill_seconds``, ``ttft``
    ``ttft_sse_time_to_first_token_seconds``, ``total`` ``ttft_sse_request_duration_seconds``.
    """
    return ", ".join(f"{name.removesuffix('_ms')};dur={value}" for name, value in timings.items())
