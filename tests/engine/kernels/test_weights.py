"""Weight layouts for fp32 on CPU: column-major weights, and oneDNN pre-packed copies for 2-32 rows."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from ttft_sse.engine.kernels import weights

torch = pytest.importorskip("torch")


def model(bias: bool = False) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96, bias=bias), torch.nn.LayerNorm(96), torch.nn.Linear(96, 64, bias=bias)
    ).eval()


@pytest.mark.parametrize("bias", [False, True])
def test_packed_layers_compute_what_the_plain_ones_do_for_any_number_of_rows(bias: bool) -> None:
    plain, arranged = model(bias), model(bias)
    assert weights.arrange(arranged, torch, packed=True) == "column-major+packed"
    for rows in (1, 2, 8, 32, 33, 100):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            assert torch.allclose(arranged(x), plain(x), rtol=1e-4, atol=1e-5), rows
    x = torch.randn(1, 7, 64)  # a prompt of 7 tokens, as the model runs it: [batch, tokens, features]
    with torch.inference_mode():
        assert arranged(x).shape == (1, 7, 64)
        assert torch.allclose(arranged(x), plain(x), rtol=1e-4, atol=1e-5)


def test_the_packed_weight_is_taken_for_2_to_32_rows_and_the_column_major_one_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    arranged = model()
    weights.arrange(arranged, torch, packed=True)
    first = arranged[0]
    calls: list[int] = []
    real = weights.packed_linear

    def spy(torch_: Any, x: Any, packed_weight: Any, bias: Any) -> Any:
        calls.append(x.numel() // x.shape[-1])
        return real(torch_, x, packed_weight, bias)

    monkeypatch.setattr(weights, "packed_linear", spy)
    for rows in (1, 2, 8, 32, 33, 64):
        first(torch.randn(rows, 64))
    assert calls == [2, 8, 32]
    assert list(weights.PACKED_ROWS) == list(range(2, 33))


def test_weights_become_column_major_with_the_same_values_and_every_tensor_is_copied() -> None:
    plain, arranged = model(bias=True), model(bias=True)
    before = {name: tensor.data_ptr() for name, tensor in arranged.state_dict().items()}
    assert weights.arrange(arranged, torch, packed=False) == "column-major"
    for (name, tensor), (_, original) in zip(arranged.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(tensor, original), name
        assert tensor.data_ptr() != before[name], name  # a copy: no view of the checkpoint's memory map is left
    for linear in (arranged[0], arranged[2]):
        assert linear.weight.stride() == (1, linear.out_features)
        assert type(linear) is torch.nn.Linear  # packed off: the plain class, no packed copy


def test_without_a_plain_linear_layer_left_no_tensor_is_copied() -> None:
    """The block kernel serves every linear layer: nothing read the checkpoint's map wholesale, so its views stay
    (an embedding table is read row by row as tokens come, not copied whole at the start)."""
    modules = torch.nn.ModuleDict({"embedding": torch.nn.Embedding(50, 16), "norm": torch.nn.LayerNorm(16)})
    before = {name: tensor.data_ptr() for name, tensor in modules.state_dict().items()}
    with capture_logs() as logs:
        assert weights.arrange(modules, torch, packed=True) == "column-major"  # nothing to pack: no warning either
    assert logs == []
    assert {name: tensor.data_ptr() for name, tensor in modules.state_dict().items()} == before


def test_a_tied_weight_is_transposed_once_and_stays_shared() -> None:
    embedding = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = embedding.weight
    tied = torch.nn.ModuleDict({"embedding": embedding, "head": head})
    original = embedding.weight.detach().clone()
    weights.arrange(tied, torch, packed=True)
    assert head.weight is embedding.weight
    assert torch.equal(embedding.weight, original)
    assert embedding.weight.stride() == (1, 50)


def without_packing(reorder: Any) -> Any:
    """A ``torch`` whose oneDNN reorder is ``reorder``; everything else is torch's."""
    mkldnn = SimpleNamespace(_reorder_linear_weight=reorder, _linear_pointwise=torch.ops.mkldnn._linear_pointwise)
    return SimpleNamespace(
        ops=SimpleNamespace(mkldnn=mkldnn), nn=torch.nn, linspace=torch.linspace, allclose=torch.allclose
    )


def test_a_torch_that_cannot_pack_leaves_the_plain_layers_and_says_why() -> None:
    def refuse(weight: Any, hint: int) -> Any:
        raise RuntimeError("mkldnn is not available in this build")

    arranged = model()
    with capture_logs() as logs:
        layout = weights.arrange(arranged, without_packing(refuse), packed=True)
    assert layout == "column-major"
    assert type(arranged[0]) is torch.nn.Linear
    assert [entry["event"] for entry in logs] == ["weights_not_packed"]
    assert "mkldnn is not available" in logs[0]["reason"]


def test_a_packed_gemm_that_disagrees_with_the_plain_one_is_not_used() -> None:
    def wrong(weight: Any, hint: int) -> Any:
        return torch.ops.mkldnn._reorder_linear_weight(weight * 2, hint)

    arranged = model()
    with capture_logs() as logs:
        layout = weights.arrange(arranged, without_packing(wrong), packed=True)
    assert layout == "column-major"
    assert type(arranged[0]) is torch.nn.Linear
    reason = "the packed GEMM disagrees with the plain one"
    assert logs == [{"event": "weights_not_packed", "log_level": "warning", "reason": reason}]
