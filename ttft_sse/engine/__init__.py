"""The model behind one interface. What is where:

``base``       the interface every engine implements and the value types that cross it (imports no torch)
``prompts``    a request's prompt as the model reads it (chat template, special tokens, context check)
``text``       token ids to text pieces, stop sequences
``sampling``   the rule every engine draws sampled tokens by
``fake``       a scripted engine for transport and framing tests
``single``     one ``model.generate`` per request in a worker thread (GPU, other models, seeded requests)
``loading/``   where weights come from (``sources``) and how a model is loaded and laid out (``model``)
``batched/``   concurrent requests in one forward pass per step (transformers' continuous batching, with our
               scheduler, token selection, modes and library hooks), and first tokens beside the batch
               (``interlude``: between two layers of the step in flight; ``prefill``: a second process)
``llamacpp/``  a GGUF on llama.cpp (llama-cpp-python's low-level API, the ``llamacpp`` extra), with our own
               continuous batching, prompts, text and sampling on top
``choice``     which engine runs: the setting, or for ``auto`` the faster of ``batched`` and ``llamacpp``, measured once
               per model file and remembered
``cpu/``       the C kernels and their Python wrappers: block kernel over a GGUF's own blocks (``kernel``,
               ``codes``), decoder layers in C (``decoder``), attention request by request over the KV cache in
               place (``attention``), transformers' ``sdpa`` function replaced and grouped KV heads read in place
               (``grouped``), the greedy pick (``argmax``), fp32 weight layouts (``weights``)

Imports run downward only: ``choice`` uses the engines; ``batched`` uses ``single``, ``loading`` and ``cpu``;
``llamacpp`` uses ``loading`` (for the tokenizer); ``cpu`` uses none of them.
How the CPU engine works: docs/engine.md.
"""

from __future__ import annotations

from ttft_sse.engine.base import (
    ChatMessage,
    Engine,
    Finished,
    ModelInfo,
    Piece,
    Prompt,
    SamplingParams,
    Usage,
)

__all__ = ["ChatMessage", "Engine", "Finished", "ModelInfo", "Piece", "Prompt", "SamplingParams", "Usage"]
