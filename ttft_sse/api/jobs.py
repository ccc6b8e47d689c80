"""Overflow jobs: ``POST /jobs`` (a ``/complete`` body) → 202 + id; ``GET /result/{id}``; ``DELETE /jobs/{id}``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from ttft_sse.api.body import caller_of, generation_request, runtime_of
from ttft_sse.stores.jobs import Job, JobStore


def _store(request: Request) -> JobStore:
    jobs = runtime_of(request).jobs
    if jobs is None:  # create_app always sets one; a bare Runtime (a worker's) serves no HTTP
        raise RuntimeError("this app has no job store; build it with create_app")
    return jobs


def _view(job: Job) -> dict[str, Any]:
    return {**job.view(), "result_url": f"/result/{job.id}"}


async def submit_job(request: Request) -> JSONResponse:
    """Validated like ``/complete`` (a bad body or too long a prompt is a 4xx now, not a failed job later)."""
    runtime = runtime_of(request)
    caller = caller_of(request)
    body = await generation_request(request)
    prepared = await runtime.generations.prepare(body)
    job = await _store(request).submit(body, prepared, caller)
    return JSONResponse(_view(job), status_code=202, headers={"Location": f"/result/{job.id}"})


async def job_result(request: Request) -> JSONResponse:
    job = await _store(request).get(request.path_params["job_id"], caller_of(request))
    return JSONResponse(_view(job))


async def cancel_job(request: Request) -> JSONResponse:
    job = await _store(request).cancel(request.path_params["job_id"], caller_of(request))
    return JSONResponse(_view(job))
