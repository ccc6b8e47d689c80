"""The batched engine (``engine``) and its parts: the scheduler (``scheduler``), token selection and first-token
claims (``selection``), the hooks into transformers' continuous batching (``hooks``), and first tokens beside the
batch (``interlude``, ``prefill``). See docs/engine.md."""
