"""Context Cache and Action Cache arithmetic (PyTorch reference), including the exactness guarantees."""

from __future__ import annotations

import pytest
import torch

from rmuscle_ros.cache.sparse_ffn import (
    action_cached_ffn,
    captured_change,
    context_cached_ffn,
    contribution_scores,
    dense_ffn,
    geglu_activations,
    kept_contribution,
    mask_overlap,
    select_drifted_tokens,
    top_neurons,
)

W, F = 32, 96


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


@pytest.fixture
def weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(s, generator=g) * 0.2 for s in ((F, W), (F, W), (W, F)))


def test_rho_one_is_bit_identical_to_dense(weights) -> None:
    x = torch.randn(40, W)
    ref_in, ref_out = torch.randn(30, W), torch.randn(30, W)
    dense = dense_ffn(x, *weights)
    assert torch.equal(context_cached_ffn(x, 30, ref_in, ref_out, *weights, rho=1.0), dense)
    act = geglu_activations(x, weights[0], weights[1])
    neurons = torch.arange(10)
    assert torch.equal(action_cached_ffn(x, neurons, act, dense, *weights, rho=1.0), dense)


def test_context_cache_recomputes_drifted_and_text_tokens_and_copies_the_rest(weights) -> None:
    ref_in = torch.randn(10, W)
    x = torch.cat([ref_in.clone(), torch.randn(4, W)])  # 10 visual tokens, 4 text tokens
    x[[2, 7]] += 1.0  # two visual tokens drifted
    ref_out = dense_ffn(ref_in, *weights)
    out = context_cached_ffn(x, 10, ref_in, ref_out, *weights, rho=0.2)
    assert select_drifted_tokens(x[:10], ref_in, 0.2).tolist() == [2, 7]
    dense = dense_ffn(x, *weights)
    assert torch.allclose(out[[2, 7]], dense[[2, 7]], atol=1e-5) and torch.allclose(
        out[10:], dense[10:], atol=1e-5
    )
    unchanged = [i for i in range(10) if i not in (2, 7)]
    assert torch.equal(out[unchanged], ref_out[unchanged])
    # Undrifted tokens' FFN output equals the reference up to matmul rounding (other batch shapes).
    assert torch.allclose(out, dense, atol=1e-5)
    assert captured_change(x[:10], ref_in, ref_out, *weights, rho=0.2) == pytest.approx(1.0, abs=1e-6)


def test_action_cache_with_all_changed_neurons_equals_dense(weights) -> None:
    x_anchor, x = torch.randn(5, W), torch.randn(5, W)
    act_anchor = geglu_activations(x_anchor, weights[0], weights[1])
    out_anchor = dense_ffn(x_anchor, *weights)
    all_neurons = torch.arange(F)
    out = action_cached_ffn(x, all_neurons, act_anchor, out_anchor, *weights, rho=0.999)
    assert torch.allclose(out, dense_ffn(x, *weights), atol=1e-5)


def test_action_cache_error_shrinks_with_rho(weights) -> None:
    x_anchor = torch.randn(5, W)
    x = x_anchor + 0.1 * torch.randn(5, W)  # a later denoising step: close to the anchor
    act_anchor = geglu_activations(x_anchor, weights[0], weights[1])
    out_anchor, dense = dense_ffn(x_anchor, *weights), dense_ffn(x, *weights)
    scores = contribution_scores(geglu_activations(x, weights[0], weights[1]), act_anchor, weights[2])
    errors = []
    for rho in (0.25, 0.5, 0.75):
        out = action_cached_ffn(x, top_neurons(scores, rho), act_anchor, out_anchor, *weights, rho=rho)
        errors.append(((out - dense).norm() / dense.norm()).item())
    assert errors[0] > errors[1] > errors[2]
    assert 0.5 < kept_contribution(scores, 0.5) <= 1.0
    assert mask_overlap(top_neurons(scores, 0.5), top_neurons(scores, 0.5)) == 1.0


def test_the_reference_keeps_ceil_rho_of_the_rows_and_neurons_scored_as_documented(weights) -> None:
    """The PyTorch reference the kernels and probes are checked against: GeGLU with tanh-approximated
    GELU (Gemma's); ceil(ρ·N) drifted tokens and ceil(ρ·F) neurons; drift measured after the per-channel
    `scale`; a neuron's score its |Δa| times its down-projection column's norm. Found by a mutation
    review: each could change with the tests above passing."""
    import math

    w_gate, w_up, _ = weights
    x = torch.randn(6, W)
    g, u = x @ w_gate.t(), x @ w_up.t()
    tanh_gelu = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    assert torch.allclose(geglu_activations(x, w_gate, w_up), tanh_gelu * u, atol=1e-6)

    ref = torch.zeros(10, W)
    assert len(select_drifted_tokens(torch.randn(10, W), ref, 0.25)) == 3  # ceil(2.5)
    assert len(top_neurons(torch.rand(F), 0.25)) == 24 and len(top_neurons(torch.rand(10), 0.25)) == 3

    moved = torch.zeros(2, W)
    moved[0, 0], moved[1, 1] = 1.0, 2.0  # token 1 moved further, unless channel 0 weighs more
    assert select_drifted_tokens(moved, torch.zeros(2, W), 0.5).tolist() == [1]
    scale = torch.ones(W)
    scale[0] = 5.0
    assert select_drifted_tokens(moved, torch.zeros(2, W), 0.5, scale).tolist() == [0]

    act_anchor, act = torch.zeros(1, 2), torch.tensor([[1.0, -1.0]])  # equal |Δa|, both signs
    down = torch.tensor([[1.0, 3.0], [0.0, 4.0]])  # column norms 1 and 5
    assert contribution_scores(act, act_anchor, down).tolist() == [1.0, 5.0]
