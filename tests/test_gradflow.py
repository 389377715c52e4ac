"Tests of transject_nb.gradflow: attention as a gradient step, the random walk of attention, over-smoothing and NeuTRENO."
import math

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from transject_nb.gradflow import (attention_flow, attention_kernel, attention_update, dobrushin, energy_grad, estimate_cosine, euler_step,
                                   grad_cosine, mean_pairwise_cosine, neutreno_fixed_point, nonlocal_energy, spread,
                                   stationary_distribution)

torch.set_num_threads(1)
SETTINGS = settings(max_examples=25, deadline=None)


def _draw(seed, n, D, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(n, D, generator=g, dtype=torch.float64)
    keys = scale * torch.randn(n, D, generator=g, dtype=torch.float64)
    queries = scale * torch.randn(n, D, generator=g, dtype=torch.float64)
    return u, keys, queries


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 24), D=st.integers(1, 12), scale=st.floats(0.1, 2.0))
def test_attention_is_an_autograd_gradient_step(seed, n, D, scale):
    u, keys, _ = _draw(seed, n, D, scale)
    K = attention_kernel(keys)
    sdpa = torch.softmax(keys @ keys.T / math.sqrt(D), -1) @ u
    torch.testing.assert_close(euler_step(u, K), sdpa, rtol=0, atol=1e-12)
    # autograd gradient equals the closed form (1/n^2) sum_j (u_i - u_j)(K_ij + K_ji)
    closed = ((u[:, None] - u[None]) * (K + K.T)[..., None]).sum(1) / n**2
    torch.testing.assert_close(energy_grad(u, K), closed, rtol=1e-12, atol=1e-12)


def test_energy_is_nonnegative_and_zero_on_constants():
    u, keys, _ = _draw(0, 8, 4)
    K = attention_kernel(keys)
    assert nonlocal_energy(u, K).item() > 0
    assert nonlocal_energy(torch.ones(8, 1, dtype=torch.float64) * u[:1], K).item() == pytest.approx(0, abs=1e-14)


def test_asymmetric_kernel_is_not_a_gradient_step():
    u, keys, queries = _draw(1, 12, 6)
    Ka = attention_kernel(queries, keys)
    assert (euler_step(u, Ka) - attention_update(u, Ka)).abs().max().item() > 1e-4
    cos = grad_cosine(u, Ka)
    assert cos.min().item() < 1 - 1e-6
    torch.testing.assert_close(grad_cosine(u, attention_kernel(keys)), torch.ones(12, dtype=torch.float64), rtol=0, atol=1e-12)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 20), D=st.integers(1, 8))
def test_lemma2_stationary_distribution(seed, n, D):
    u, keys, queries = _draw(seed, n, D, 0.5)
    K = attention_kernel(keys)
    P = K / K.sum(-1, keepdim=True)
    pi = stationary_distribution(P)
    torch.testing.assert_close(pi @ P, pi, rtol=0, atol=1e-10)
    torch.testing.assert_close(pi, K.sum(-1) / K.sum(), rtol=0, atol=1e-10)
    flows = pi[:, None] * P
    torch.testing.assert_close(flows, flows.T, rtol=0, atol=1e-12)


def test_lemma2_fails_for_asymmetric_kernel():
    _, keys, queries = _draw(3, 10, 4)
    Ka = attention_kernel(queries, keys)
    Pa = Ka / Ka.sum(-1, keepdim=True)
    pia = stationary_distribution(Pa)
    torch.testing.assert_close(pia @ Pa, pia, rtol=0, atol=1e-10)
    assert (pia - Ka.sum(-1) / Ka.sum()).abs().max().item() > 1e-3


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 16), D=st.integers(1, 8), scale=st.floats(0.1, 3.0))
def test_dobrushin_contraction(seed, n, D, scale):
    u, keys, queries = _draw(seed, n, D, scale)
    for K in (attention_kernel(keys), attention_kernel(queries, keys)):
        P = K / K.sum(-1, keepdim=True)
        assert (spread(P @ u) - dobrushin(P) * spread(u)).max().item() <= 1e-12
        assert 0 <= dobrushin(P).item() <= 1          # < 1 in exact arithmetic; sharp softmax rounds it to 1


def test_iterated_attention_collapses():
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        u0 = torch.randn(16, 8, generator=g)
        Wq, Wk = (torch.randn(8, 8, generator=g) / math.sqrt(8) for _ in range(2))
        assert mean_pairwise_cosine(attention_flow(u0, Wq, Wk, 50)[-1]).item() > 0.999
        assert mean_pairwise_cosine(attention_flow(u0, Wq, None, 50)[-1]).item() > 0.999


def test_proposition1_symmetric_neutreno_does_not_collapse():
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        u0 = torch.randn(16, 8, generator=g)
        Wq = torch.randn(8, 8, generator=g) / math.sqrt(8)
        us = attention_flow(u0, Wq, None, 50, lam=0.6)
        assert torch.isfinite(us[-1]).all()
        assert mean_pairwise_cosine(us[-1]).item() < 0.9
        assert spread(us[-1]).min().item() > 1e-3


def test_proposition1_linear_fixed_point():
    u, keys, _ = _draw(0, 16, 8)
    K = attention_kernel(keys)
    P = K / K.sum(-1, keepdim=True)
    lam, U = 0.6, u.clone()
    for _ in range(300):
        U = P @ U + lam * (u - U)
    Ustar = neutreno_fixed_point(P, u, lam)
    torch.testing.assert_close(U, Ustar, rtol=0, atol=1e-10)
    assert spread(Ustar).min().item() > 1e-3               # not constant
    ev = torch.linalg.eigvals(P)
    assert ev.real.min().item() > -1e-10                   # PSD symmetric kernel: spectrum of P in [0, 1]


def test_mean_pairwise_cosine():
    X = torch.randn(2, 5, 3)
    Xn = torch.nn.functional.normalize(X, dim=-1)
    C = Xn @ Xn.transpose(-1, -2)
    ref = (C.sum((-2, -1)) - 5) / 20
    torch.testing.assert_close(mean_pairwise_cosine(X), ref, rtol=1e-5, atol=1e-6)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]).bool()
    torch.testing.assert_close(mean_pairwise_cosine(X, mask)[0], mean_pairwise_cosine(X[0, :3]), rtol=1e-5, atol=1e-6)
    assert mean_pairwise_cosine(torch.ones(4, 3)).item() == pytest.approx(1.0)
    assert mean_pairwise_cosine(torch.randn(1, 3)).item() == 1.0        # a single token
    assert torch.isnan(mean_pairwise_cosine(torch.full((4, 3), float('nan')))).item()   # NaN propagates


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 16), D=st.integers(1, 8), scale=st.floats(0.1, 2.0))
@example(seed=1, n=2, D=6, scale=2.0)   # a weight of e^-600: u_i - (PU)_i underflowed to 0 before the j = i term was left out
def test_estimate_cosine_is_table4(seed, n, D, scale):
    "NeuTRENO's Table 4: cosine of sum_j (u_i - u_j) exp(k_i.k_j) and sum_j (u_i - u_j) exp(q_i.k_j), per token."
    u, keys, queries = _draw(seed, n, D, scale)
    g_sym = ((u[:, None] - u[None]) * attention_kernel(keys)[..., None]).sum(1)
    g_asym = ((u[:, None] - u[None]) * attention_kernel(queries, keys)[..., None]).sum(1)
    want = torch.nn.functional.cosine_similarity(g_sym, g_asym, dim=-1)
    ok = (g_sym.norm(dim=-1) > 1e-9) & (g_asym.norm(dim=-1) > 1e-9)
    torch.testing.assert_close(estimate_cosine(u, queries, keys)[ok], want[ok], rtol=1e-9, atol=1e-9)
    ok_s = g_sym.norm(dim=-1) > 1e-9
    torch.testing.assert_close(estimate_cosine(u, keys, keys)[ok_s], torch.ones(int(ok_s.sum()), dtype=torch.float64), rtol=0, atol=1e-9)


def test_estimate_cosine_masks_padding_and_checks_shapes():
    u, keys, queries = _draw(0, 10, 4)
    mask = torch.arange(10) < 7
    torch.testing.assert_close(estimate_cosine(u, queries, keys, mask)[:7], estimate_cosine(u[:7], queries[:7], keys[:7]))
    with pytest.raises(ValueError, match='same shape'): estimate_cosine(u, queries, keys[:, :2])
