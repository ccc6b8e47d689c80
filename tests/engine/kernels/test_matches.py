"""The account of each GGUF type's path (engine/kernels/matches.py)."""

from __future__ import annotations

from ttft_sse.engine.kernels import matches


def test_the_account_lists_each_path_a_types_layers_take() -> None:
    kinds = {"a": "Q4_K", "b": "BF16", "c": "Q4_K", "d": "Q6_K", "e": matches.UNKNOWN, "f": "Q8_0", "g": "Q3_K"}
    kinds["h"] = "BF16"
    rows = {"a": "int8", "b": "fp32", "d": "int8", "f": "int8"}
    assert matches.by_type(kinds, rows, "int8") == {
        "BF16": "blocks, fp32 rows: 1 (not quantised: int8 rows multiply quantised blocks); "
        "fp32: 1 (its values do not give back the file's weight bit for bit)",
        "Q4_K": "blocks, int8 rows: 1; fp32: 1 (its blocks do not give back the file's dequantisation bit for bit)",
        "Q3_K": "fp32: 1 (no kernel layout for 16-input scales and minimums)",
        "Q6_K": "blocks, int8 rows: 1",
        "Q8_0": "blocks, int8 rows: 1",
        "unknown": "fp32: 1 (the file holds no tensor for it)",
    }
