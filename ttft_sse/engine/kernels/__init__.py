"""The CPU kernels: C sources built for this CPU at the first start (AVX-512, or AVX2 with FMA), each with the Python
wrapper that builds, checks and calls it. See docs/engine.md."""
