"""The llama.cpp engine (``TTFT_ENGINE=llamacpp``): a GGUF model run by llama.cpp through llama-cpp-python's
low-level API, with the project's own continuous batching, prompts, text and sampling on top.

``library``      llama.cpp's model, context, batch, decode, logits and KV cells (the one module importing the binding)
``schedule``     which rows each step computes: sequences admitted, decoding rows, prompt chunks (pure Python)
``engine``       the engine interface over both, with one loop thread (ttft_sse/engine/threads.py's ``Loop``)
``prefix_store`` the free sequences' KV cells written on drain and read back at start (``TTFT_PREFIX_STORE_MB``)

How it compares with the batched engine and when ``TTFT_ENGINE=auto`` picks it: docs/engine.md.
"""
