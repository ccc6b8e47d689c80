"""``GET /metrics``: this app's metrics in the Prometheus text format (OpenMetrics when the scraper asks for it)."""

from __future__ import annotations

import anyio
from starlette.requests import Request
from starlette.responses import Response

from ttft_sse.api.body import runtime_of


async def metrics(request: Request) -> Response:
    # Rendered in a worker thread: the process collector reads /proc and NVML may take a few milliseconds;
    # the event loop keeps streaming tokens meanwhile.
    body, content_type = await anyio.to_thread.run_sync(
        runtime_of(request).metrics.render, request.headers.get("accept", "")
    )
    return Response(body, headers={"Content-Type": content_type, "Cache-Control": "no-store"})
