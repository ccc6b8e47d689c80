"""The app factory: routes, middleware, exception handlers, lifespan. Wiring only; nothing runs at import."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Mount, Route, WebSocketRoute

from ttft_sse.api.chat import chat, upgrade_required
from ttft_sse.api.complete import complete
from ttft_sse.api.health import healthz, readyz
from ttft_sse.api.jobs import cancel_job, job_result, submit_job
from ttft_sse.api.metrics import metrics
from ttft_sse.api.openai import chat_completions, completions, list_models, retrieve_model
from ttft_sse.api.page import page, static_files
from ttft_sse.api.prefill import prefill
from ttft_sse.api.resumable import create_stream, stream_resource
from ttft_sse.api.spec import openapi_json
from ttft_sse.api.sse import stream
from ttft_sse.engine.base import Engine
from ttft_sse.engine.choice import create_engine
from ttft_sse.errors import EXCEPTION_HANDLERS
from ttft_sse.http.connection import CloseWhenBodyUnread
from ttft_sse.http.hosts import HostCheck, parse_hosts
from ttft_sse.log import RequestContext
from ttft_sse.runtime import Runtime, lifespan
from ttft_sse.settings import Settings


def create_app(settings: Settings | None = None, engine: Engine | None = None) -> Starlette:
    """Build the ASGI app. ``engine`` defaults to the engine ``settings.engine`` names (engine/choice.py), for
    ``settings.model``.

    The model is loaded by the app's lifespan, not here: creating an app is cheap and has no side effects.
    """
    settings = settings or Settings()
    if engine is None:
        engine = create_engine(settings)
    app = Starlette(
        routes=[
            Route("/", page, methods=["GET"]),
            Mount("/static", static_files(), name="static"),
            Route("/stream", stream, methods=["GET", "POST"]),
            Route("/streams", create_stream, methods=["POST"]),
            Route("/streams/{stream_id}", stream_resource, methods=["GET", "DELETE"]),
            Route("/complete", complete, methods=["POST"]),
            Route("/prefill", prefill, methods=["POST"]),
            WebSocketRoute("/chat", chat),  # the seed design's WebSocket protocol (compatibility; SSE is primary)
            Route("/chat", upgrade_required, methods=["GET"]),
            Route("/jobs", submit_job, methods=["POST"]),
            Route("/result/{job_id}", job_result, methods=["GET"]),
            Route("/jobs/{job_id}", cancel_job, methods=["DELETE"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi_json, methods=["GET"]),
        ],
        middleware=[
            Middleware(RequestContext),
            Middleware(CloseWhenBodyUnread),
            Middleware(HostCheck, allowed=parse_hosts(settings.allowed_hosts or "*")),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.runtime = Runtime(settings, engine)
    return app
