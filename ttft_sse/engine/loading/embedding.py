"""A token embedding kept in the GGUF file's own type, its rows dequantised as tokens come.

The embedding table is the model's largest matrix on a large vocabulary (Llama 3's 128,256 x 4,096: 2.1 GB in fp32,
0.3 GB as Q4_K), and a step reads one row of it per token. So it stays in the file, mapped read-only (a row's pages
are read when a token first needs it, and the page cache shares them between processes), and a forward pass
dequantises the rows its tokens name with gguf's own dequantisation: the same fp32 values transformers' loader gives
the whole table, so the answers are the fp32 model's.

A model's embedding module becomes a subclass of its own class (``nn.Embedding``, or a scaled one such as Gemma 3's,
which multiplies by its ``embed_scale``) whose forward reads the file; a class that does anything else keeps its
fp32 table (:func:`supported`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ttft_sse.engine.kernels.stored import Tensor


def supported(module: Any, torch: Any) -> bool:
    """Whether ``module``'s forward is a plain lookup (``nn.Embedding``'s), or one times its ``embed_scale`` (a scaled
    embedding's: transformers' ``*ScaledWordEmbedding`` classes)."""
    kind = type(module)
    if kind.forward is torch.nn.Embedding.forward:
        return True
    return kind.__name__.endswith("ScaledWordEmbedding") and hasattr(module, "embed_scale")


def from_file(module: Any, rows: npt.NDArray[np.uint8], tensor: Tensor, torch: Any) -> None:
    """Make ``module`` (a :func:`supported` embedding) read its rows from ``rows``, the table's stored bytes ``(tokens,
    bytes a row)`` of ``tensor``'s type; its fp32 table goes."""
    import gguf

    module.stored_rows = rows
    module.stored_kind = gguf.GGMLQuantizationType(tensor.kind)
    module.scaled = type(module).forward is not torch.nn.Embedding.forward
    module.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    module.__class__ = _rows_class(type(module))


_CLASSES: dict[type[Any], type[Any]] = {}
"""The reading class made for each embedding class (one each, so that ``isinstance`` and pickling see one)."""


def _rows_class(base: type[Any]) -> type[Any]:
    if base in _CLASSES:
        return _CLASSES[base]
    import gguf
    import torch

    class FileRows(base):  # type: ignore[misc]
        stored_rows: npt.NDArray[np.uint8]
        stored_kind: Any
        scaled: bool

        def forward(self, input_ids: Any) -> Any:
            ids = input_ids.reshape(-1).numpy()
            wanted, where = np.unique(ids, return_inverse=True)
            values = gguf.quants.dequantize(self.stored_rows[wanted], self.stored_kind)
            table = torch.from_numpy(np.asarray(values, np.float32).reshape(len(wanted), -1))
            out = table[torch.from_numpy(where.reshape(-1))].reshape(*input_ids.shape, table.shape[-1])
            return out * self.embed_scale.to(torch.float32) if self.scaled else out

    FileRows.__name__ = FileRows.__qualname__ = f"FileRows{base.__name__}"
    _CLASSES[base] = FileRows
    return FileRows
