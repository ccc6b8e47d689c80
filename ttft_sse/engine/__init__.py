"""The model behind one interface. What is where:

``base``       the interface every engine implements and the value types that cross it (imports no torch)
``prompts``    a request's prompt as the model reads it (chat template, special tokens, context check)
``text``       token ids to text pieces, stop sequences
``sampling``   the rule every engine draws sampled tokens by
``fake``       a scripted engine for transport and framing tests
``threads``    where the engines' threads meet the event loop
``loading/``   where weights come from (``sources``) and how a model is loaded and laid out (``model``)
``loaded``     a transformers model loaded once, which the single and batched engines share
``single``     one ``model.generate`` per request in a worker thread (GPU, other models, seeded requests)
``modes``      the batched engine's modes, switched between two steps
``batched/``   concurrent requests in one forward pass per step (transformers' continuous batching), prefills' pins,
               a step's outputs held until the next step's layers are in C, the paged cache's memory
``first/``     first tokens beside the batch (``interlude``: between two layers of the step in flight;
               ``process``: a second process), raced against the batch
``library/``   transformers glue: its private parts through ``internals`` alone; the manager, paged cache and
               scheduler the batched engine builds (``hooks``, ``paged_cache``, ``scheduler``), the cache read in
               place (``in_place``), the engine's attention function (``grouped``), token selection, decoder
               layers in C around the library's cache and attention (``decoder``, ``stack``, ``families``)
``kernels/``   the C sources and their Python wrappers: block kernel over a GGUF's own blocks (``kernel``,
               ``codes``), the decoder layers' C (``structs``), attention request by request (``attention``), the
               greedy pick (``argmax``), fp32 weight layouts (``weights``), the builds (``compiler``)
``llamacpp/``  a GGUF on llama.cpp (llama-cpp-python's low-level API, the ``llamacpp`` extra), with our own
               continuous batching, prompts, text and sampling on top
``choice``     which engine runs: the setting, or for ``auto`` the faster of ``batched`` and ``llamacpp``, measured once
               per model file and remembered

Imports run downward only: ``choice`` uses the engines; ``batched`` uses ``first``, ``single``, ``loaded`` and
``library``; ``loading`` uses ``library`` and ``kernels``; ``library`` uses ``kernels``; ``kernels`` uses none of them.
``llamacpp`` uses ``loading`` (for the tokenizer). How the CPU engine works: docs/engine.md.
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
