"""decoder.c's structures as ctypes sees them (engine/library/decoder.py fills them): each field in the C order."""

from __future__ import annotations

import ctypes

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
LINEARS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}
LINEARS |= {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
"""decoder.c's linear layers, in the order of ``struct layer``'s, and the submodules of a decoder layer that hold
them."""
JOINED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
"""decoder.c's joined layers (kernel.join): one call each where the layers they join would take three and two."""


class Linear(ctypes.Structure):
    """decoder.c's ``struct linear``: a layer in the block kernel's layout."""

    _fields_ = [
        ("codes", _PTR),
        ("scale", _PTR),
        ("zero", _PTR),
        ("inputs", _I64),
        ("outputs", _I64),
        ("bits", _I64),
        ("int8", _I64),
    ]


class Layer(ctypes.Structure):
    """decoder.c's ``struct layer``: a decoder layer's sizes, norm weights and linear layers."""

    _fields_ = [
        *((name, _I64) for name in ("hidden", "heads", "kv_heads", "dim", "intermediate")),
        ("eps", ctypes.c_double),
        ("input_norm", _PTR),
        ("post_norm", _PTR),
        *((name, Linear) for name in LINEARS),
        *((name, Linear) for name in JOINED),
        # A family's extra parts (engine/library/families.py), NULL or 0 where it has none.
        *((name, _PTR) for name in ("q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "attention_norm", "mlp_norm")),
        ("gelu", _I64),
    ]


class Step(ctypes.Structure):
    """decoder.c's ``struct step``: what the layers of a batched step share (:class:`attention.Step`), and the
    attention function they call (attention.c's, from its own library)."""

    _fields_ = [
        ("attend", _PTR),
        ("attend_part", _PTR),  # None: the step's attention is not shared with the kernel's helper threads
        *((name, _PTR) for name in ("write", "index", "cu_q", "cu_k")),
        *((name, _I64) for name in ("requests", "key_stride", "head_stride", "max_rows")),
        ("half", _I64),  # the cache holds fp16 values (TTFT_KV_DTYPE=f16), and ``attend`` is the function for them
        ("scale", ctypes.c_float),
    ]


class Stack(ctypes.Structure):
    """decoder.c's ``struct stack``: a batched step's layers in order, each with its step and its cache rows, the
    flag that stops the call between two of them, and each layer's rotary embedding where they differ (else NULL:
    the call's)."""

    _fields_ = [
        ("count", _I64),
        *((name, _PTR) for name in ("layers", "steps", "keys", "values", "waiting", "cos", "sin")),
    ]
