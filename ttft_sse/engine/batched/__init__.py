"""The batched engine (``engine``): transformers' continuous batching over a loaded model, with prefills' pins
(``pins``), a step's outputs held until the next step's layers are in C (``held``), the paged cache's memory
(``memory``) and what it tells of its loop (``stats``). What it builds of the library is in engine/library/, first
tokens beside it in engine/first/. See docs/engine.md."""
