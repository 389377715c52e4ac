"Tests of transject_nb.lab.analysis and lab.analysis_figures: every analysis on cases with known answers, and on every registered variant."
import math

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn
from hypothesis import given, strategies as st

from transject_nb.core import EncoderClassifier, EncoderConfig, build_config, unwrap, variant_spec
from transject_nb.models import BASELINES, VARIANTS
from transject_nb.training.data import TokenSplit
from transject_nb.training.tokenizers import ByteTokenizer
from transject_nb.lab.analysis import (
    PAPER_PAIRS, PAPER_SENTENCE, SAMPLE_LABELS, SAMPLE_TEXTS, batches, forward_layers, functional_J, hidden_states, inference,
    layer_measures, locate_word, oversmoothing_curve, plot_layer_curves, plot_token_pairs, residual_weights,
    set_residual_weight, token_ids, token_pair_stats, token_strings, tokenizer_of, word_tokenizer)
from transject_nb.lab.analysis_figures import (
    activation_bounds, attention_spectrum, expert_weights, gaussian_entropy, isomap_layers, layer_entropy, paper_entropy,
    plot_activation_bounds, plot_attention_spectrum, plot_expert_weights, plot_isomap, spacing_entropy, spectral_gap)

torch.set_num_threads(1)
SOFTMAX = BASELINES
TJ = tuple(v for v in VARIANTS if variant_spec(v).family == 'transject')
TOK = word_tokenizer(SAMPLE_TEXTS)


def make(name, L=2, d=16, alpha=0.8, seed=0, vocab_sz=None):
    torch.manual_seed(seed)
    m = variant_spec(name).model_cls(build_config(name, vocab_sz or TOK.vocab_sz, 2, d_model=d, n_layers=L, max_len=64))
    if residual_weights(m) is not None: set_residual_weight(m, alpha)
    return m.eval()


class Orth(EncoderClassifier):
    "Embedding, then every layer multiplies each token by a fixed random orthogonal matrix (no positions)."
    def __init__(self, vocab_sz=50, d=8, L=3):
        super().__init__(EncoderConfig(vocab_sz=vocab_sz, n_classes=2, d_model=d, n_layers=L, max_len=64))
        self.emb = nn.Embedding(vocab_sz, d)
        self.blocks = nn.ModuleList([OrthBlock(d) for _ in range(L)])
    def embed(self, x, mask): return self.emb(x)


class OrthBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.register_buffer('Q', torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0].float())
    def forward(self, h, mask, ctx): return h @ self.Q


class Same(Orth):
    def embed(self, x, mask): return self.emb.weight[1].expand(*x.shape, -1)


class FakeLearner:
    def __init__(self, model, tokenizer=None): self.model, self.dls, self.tokenizer = model, None, tokenizer


def distinct_ids(B=6, n=7, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab - 1, generator=g)[:n] + 1 for _ in range(B)])


# --- getting at models and inputs ----------------------------------------------------

def test_unwrap_and_restore():
    m = make('transformer')
    m.train()
    assert unwrap(FakeLearner(m, TOK)) is m and tokenizer_of(FakeLearner(m, TOK)) is TOK and tokenizer_of(m) is None
    hs, mask = hidden_states(m, SAMPLE_TEXTS[:3], TOK)
    assert m.training and len(hs) == 3 and hs[0].shape[:2] == mask.shape
    with inference(m) as dev:
        assert not m.training and not torch.is_grad_enabled() and dev.type == 'cpu'
    assert m.training
    with pytest.raises(TypeError, match='expected an EncoderClassifier'): unwrap(nn.Linear(2, 2))


def test_inputs_agree_across_forms():
    "Texts, ids, a TokenSplit and an iterable of (x, y) batches give the same measures."
    m = make('neutreno')
    ids = [TOK.encode(t) for t in SAMPLE_TEXTS]
    ref = layer_measures(m, SAMPLE_TEXTS, tokenizer=TOK, bs=5)
    split = TokenSplit.from_lists(ids, SAMPLE_LABELS)
    loader = [(split.batch(range(i, min(i + 4, len(split))))) for i in range(0, len(split), 4)]
    for data, kw in [(ids, {}), (split, {}), (loader, {}), (token_ids(SAMPLE_TEXTS, TOK), {}), (SAMPLE_TEXTS, dict(progress=True))]:
        pd.testing.assert_frame_equal(layer_measures(m, data, tokenizer=TOK, bs=3, **kw), ref, atol=1e-5, rtol=0)
    assert len(list(batches(split, bs=4))) == 4


def test_bad_inputs():
    m = make('transformer')
    with pytest.raises(ValueError, match='needs a tokenizer'): token_ids('a text')
    with pytest.raises(TypeError, match='must be integers'): token_ids(torch.randn(2, 3))
    with pytest.raises(ValueError, match='bs must be a positive int'): list(batches(SAMPLE_TEXTS, bs=0, tokenizer=TOK))
    with pytest.raises(ValueError, match="does not occur"): locate_word(PAPER_SENTENCE, 'popcorn', TOK)
    with pytest.raises(ValueError, match='distinct positions'): token_pair_stats(m, PAPER_SENTENCE, [('script', 'script')], TOK)
    with pytest.raises(ValueError, match="kernel must be"): functional_J(m, SAMPLE_TEXTS, kernel='gauss', tokenizer=TOK)


def test_locate_word_and_strings():
    i = locate_word(PAPER_SENTENCE, 'script', TOK)
    assert token_strings(token_ids(PAPER_SENTENCE, TOK)[0], TOK)[i] == 'script'
    bt = ByteTokenizer()
    assert locate_word(PAPER_SENTENCE, 'script', bt) == PAPER_SENTENCE.index('script')
    assert word_tokenizer(SAMPLE_TEXTS).encode(PAPER_SENTENCE) == TOK.encode(PAPER_SENTENCE)   # deterministic


# --- known answers -------------------------------------------------------------------

def test_identical_tokens_cosine_one():
    torch.manual_seed(0)
    ms = layer_measures(Same(), distinct_ids())
    np.testing.assert_allclose(ms.cosine, 1, atol=1e-6)
    np.testing.assert_allclose(ms.diversity, 0, atol=1e-6)
    st_ = token_pair_stats(Orth(), torch.tensor([3, 7, 3]), pairs=[(0, 2), (0, 1)])
    np.testing.assert_allclose(st_[st_.pair == '0–2'].cosine, 1, atol=1e-6)
    assert st_[st_.pair == '0–2'].ratio.isna().all()                                   # distance 0 at layer 0


def test_orthogonal_map_keeps_ratios():
    torch.manual_seed(1)
    m = Orth()
    b = activation_bounds(m, distinct_ids())
    np.testing.assert_allclose(b[['lo', 'hi']].values, 1, atol=1e-5)
    assert b.bound_lo.isna().all()
    st_ = token_pair_stats(m, torch.tensor([3, 7, 9, 12]), pairs=[(0, 1), (2, 3)])
    np.testing.assert_allclose(st_.ratio, 1, atol=1e-5)
    oc = oversmoothing_curve(m, distinct_ids())
    np.testing.assert_allclose(oc, oc[0], atol=1e-5)                                      # angles kept too


@given(st.floats(0.1, 10.), st.floats(-5., 5.))
def test_gaussian_entropy_closed_form(sigma, mu):
    g = torch.Generator().manual_seed(0)
    x = mu + sigma * torch.randn(20_000, 2, generator=g, dtype=torch.float64)
    h = 0.5 * math.log(2 * math.pi * math.e * sigma ** 2)
    np.testing.assert_allclose(gaussian_entropy(x), h, atol=0.03)
    np.testing.assert_allclose(spacing_entropy(x), h, atol=0.05)


def test_paper_entropy_is_not_an_entropy():
    g = torch.Generator().manual_seed(0)
    u = torch.rand(20_000, generator=g, dtype=torch.float64)
    assert abs(paper_entropy(u).item() - 1) < 0.02 and abs(spacing_entropy(u).item()) < 0.02   # U(0,1): h = 0, Eq. 8 = 1
    ln = torch.randn(20_000, generator=g, dtype=torch.float64).exp()
    assert math.isclose((paper_entropy(3 * ln) - paper_entropy(ln)).item(), -math.log(3), abs_tol=1e-9)
    assert math.isclose((spacing_entropy(3 * ln) - spacing_entropy(ln)).item(), math.log(3), abs_tol=1e-9)
    assert paper_entropy(torch.randn(100, 3)).isnan().all()
    with pytest.raises(ValueError, match='N >= 2'): gaussian_entropy(torch.ones(1, 3))


def test_spectral_gap_known():
    a = 0.2
    assert spectral_gap(torch.full((4, 4), 0.25)).item() == pytest.approx(1)
    assert spectral_gap(torch.eye(3)).item() == pytest.approx(0, abs=1e-12)
    assert spectral_gap(torch.tensor([[1 - a, a], [a, 1 - a]])).item() == pytest.approx(2 * a)
    assert spectral_gap(torch.stack([torch.eye(2), torch.full((2, 2), .5)])).shape == (2,)
    with pytest.raises(ValueError, match='square'): spectral_gap(torch.ones(2, 3))


def test_functional_J_uniform_is_diversity():
    m = make('transformer', L=3)
    J = functional_J(m, SAMPLE_TEXTS, tokenizer=TOK, bs=5)
    np.testing.assert_allclose(J.values, layer_measures(m, SAMPLE_TEXTS, tokenizer=TOK).diversity.values, atol=1e-6)
    np.testing.assert_allclose(functional_J(Same(), distinct_ids()).values, 0, atol=1e-10)
    Ja = functional_J(m, SAMPLE_TEXTS, kernel='attention', tokenizer=TOK)
    assert list(Ja.index) == [1, 2, 3] and np.isfinite(Ja).all() and (Ja > 0).all()


def test_functional_J_at_output_is_the_same_kernel_after_the_block():
    m0 = make('transformer-rezero', L=2, alpha=0.)                  # alpha = 0: every block is the identity
    np.testing.assert_allclose(functional_J(m0, SAMPLE_TEXTS, kernel='attention', at='output', tokenizer=TOK).values,
                               functional_J(m0, SAMPLE_TEXTS, kernel='attention', tokenizer=TOK).values, rtol=1e-10)
    m = make('transformer', L=2)
    Jo, Ji = (functional_J(m, SAMPLE_TEXTS, kernel='attention', at=a, tokenizer=TOK) for a in ('output', 'input'))
    assert list(Jo.index) == [1, 2] and not np.allclose(Jo.values, Ji.values)
    with pytest.raises(ValueError, match="at must be 'input' or 'output'"): functional_J(m, SAMPLE_TEXTS, kernel='attention', at='mid', tokenizer=TOK)


def test_expert_weights_and_bounds_of_transject():
    m = make('transject', L=3)
    ew = expert_weights(m, SAMPLE_TEXTS[:4], tokenizer=TOK)
    np.testing.assert_allclose(ew.filter(like='expert').sum(axis=1), 1, atol=1e-6)
    np.testing.assert_allclose(ew.balance, 1, atol=1e-9)                                   # uniform at initialisation
    with torch.no_grad():
        for b in m.blocks: b.gate_logits.copy_(torch.tensor([4., 0., 0., 0.]))
    assert (expert_weights(m, SAMPLE_TEXTS[:4], tokenizer=TOK).balance < 0.5).all()
    b = activation_bounds(m, SAMPLE_TEXTS, tokenizer=TOK)
    assert (b.lo >= b.bound_lo - 1e-6).all() and (b.hi <= b.bound_hi + 1e-6).all()
    with pytest.raises(TypeError, match='only the TransJect variants'): expert_weights(make('transformer'), SAMPLE_TEXTS[:2], tokenizer=TOK)


def test_residual_weights():
    m = make('transject', L=3, alpha=0.3)
    np.testing.assert_allclose(residual_weights(m), 0.3, atol=1e-6)
    r = set_residual_weight(make('transformer-rezero'), -0.5)
    np.testing.assert_allclose(residual_weights(r), -0.5)
    assert residual_weights(make('neutreno')) is None
    with pytest.raises(TypeError, match='no residual weight'): set_residual_weight(make('transformer'), 0.1)
    with pytest.raises(ValueError, match=r'lies in \(-1, 1\)'): set_residual_weight(m, 1.0)


# --- every variant -------------------------------------------------------------------

@pytest.mark.parametrize('variant', VARIANTS)
def test_every_analysis_on_every_variant(variant):
    m = make(variant, L=2)
    learn = FakeLearner(m, TOK)
    L = 2
    ps = token_pair_stats(learn, PAPER_SENTENCE, PAPER_PAIRS)
    assert ps.shape == (4 * (L + 1), 7) and np.isfinite(ps[['distance', 'cosine', 'ratio']].values).all()
    np.testing.assert_allclose(ps[ps.layer == 0].ratio, 1)
    ms = layer_measures(learn, SAMPLE_TEXTS, bs=6)
    assert ms.shape == (L + 1, 3) and np.isfinite(ms.values).all()
    np.testing.assert_allclose(ms.similarity + ms.diversity, 1, atol=1e-6)
    assert ((ms.cosine >= -1) & (ms.cosine <= 1)).all()
    J = functional_J(learn, SAMPLE_TEXTS)
    assert J.shape == (L + 1,) and np.isfinite(J).all()
    ent = layer_entropy(learn, SAMPLE_TEXTS, max_tokens=500)
    assert ent.shape == (L + 1, 5) and np.isfinite(ent.gaussian).all() and np.isfinite(ent.spacing.iloc[1:]).all()
    b = activation_bounds(learn, SAMPLE_TEXTS)
    assert b.shape == (L + 1, 4) and np.isfinite(b[['lo', 'hi']].values).all() and (b.lo <= b.hi).all()
    assert b.bound_lo.notna().all() == (variant in TJ)
    iso = isomap_layers(learn, PAPER_SENTENCE)
    n = len(TOK.encode(PAPER_SENTENCE))
    assert [Y.shape for Y in iso['coords']] == [(n, 2)] * (L + 1) and all(np.isfinite(Y).all() for Y in iso['coords'])
    assert len(iso['tokens']) == n
    if variant in SOFTMAX:
        spec = attention_spectrum(learn, SAMPLE_TEXTS, bs=7)
        t = spec['table']
        assert t.shape == (L, 3) and ((t.gap > 0) & (t.gap <= 1 + 1e-9)).all()
        assert len(spec['eigvals']) == L and spec['eigvals'][0].shape == (m.cfg.n_heads, n)      # first sequence: the paper's
        plt.close(plot_attention_spectrum(spec).figure)
        Ja = functional_J(learn, SAMPLE_TEXTS, kernel='attention')
        assert Ja.shape == (L,) and np.isfinite(Ja).all()
    else:
        with pytest.raises(TypeError, match='no softmax attention'): attention_spectrum(learn, SAMPLE_TEXTS)
    if variant in TJ:
        ew = expert_weights(learn, SAMPLE_TEXTS)
        assert ew.shape == (L, m.cfg.n_experts + 2)
        plt.close(plot_expert_weights(ew).figure)


def test_plots_return_figures():
    m = make('transject', L=2)
    fig = plot_token_pairs({'a': token_pair_stats(m, PAPER_SENTENCE, tokenizer=TOK)})
    assert len(fig.axes) == 2
    ax = plot_layer_curves({'x': pd.Series([1., 2., 3.])}, 'y')
    ax2 = plot_activation_bounds(activation_bounds(m, SAMPLE_TEXTS, tokenizer=TOK))
    fig2 = plot_isomap(isomap_layers(m, PAPER_SENTENCE, TOK, layers=[0, 2]))
    assert len([a for a in fig2.axes if a.has_data()]) == 2
    plt.close('all')


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_cuda_matches_cpu():
    m = make('neutreno', L=2)
    ref = layer_measures(m, SAMPLE_TEXTS, tokenizer=TOK)
    got = layer_measures(m, SAMPLE_TEXTS, tokenizer=TOK, device='cuda')
    pd.testing.assert_frame_equal(got, ref, atol=1e-4, rtol=0)
    assert next(m.parameters()).device.type == 'cpu'                                       # the model went back
    tj = make('transject', L=2).cuda()
    b = activation_bounds(tj, SAMPLE_TEXTS, tokenizer=TOK)
    assert (b.lo >= b.bound_lo - 1e-5).all() and next(tj.parameters()).is_cuda
