"Tests of transject_nb.baselines (the softmax-attention encoders) and transject_nb.similarity (the measures and the fix)."
import math
import re

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from transject_nb.baselines import (NeuTRENOEncoder, SoftmaxConfig, SoftmaxEncoder, attention_maps,
                                    attention_probs, layer_measure)
from transject_nb.core import BatchContext, EncoderConfig, build_config, variant_spec
from transject_nb.models import BASELINES
from transject_nb.gradflow import stationary_distribution
from transject_nb.similarity import remove_similarity, token_diversity, token_similarity

torch.set_num_threads(1)
X_PAD = torch.tensor([[5, 3, 9, 2, 0, 0, 0], [7, 1, 4, 4, 8, 6, 2]])


def make(name, vocab_sz=100, n_classes=3, **cfg):
    return variant_spec(name).model_cls(build_config(name, vocab_sz, n_classes, **cfg))


# --- config and registry ---------------------------------------------------------------

@pytest.mark.parametrize('kw,msg', [
    (dict(n_heads=5), 'must be divisible by n_heads=5'),
    (dict(tau=1.5), 'tau (similarity removal τ) must lie in [0, 1]'),
    (dict(lam=-1.), 'SoftmaxConfig.lam must be >= 0'),
    (dict(lam=float('nan')), 'SoftmaxConfig.lam must be a finite number'),
    (dict(norm='sandwich'), "unknown norm 'sandwich'; valid norms are: post, pre, none"),
    (dict(sym='yes'), 'sym must be a bool'),
    (dict(dropout=1.0), 'dropout must lie in [0, 1)'),
    (dict(d_ff=0), 'd_ff must be a positive int'),
    (dict(d_model=9, n_heads=3), 'd_model must be even'),
])
def test_config_validation(kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        SoftmaxConfig(100, 3, **kw)


def test_registry():
    for name in BASELINES:
        spec = variant_spec(name)
        assert spec.config_cls is SoftmaxConfig and issubclass(spec.model_cls, SoftmaxEncoder)
    assert variant_spec('transformer').fixed == dict(norm='post', rezero=False, lam=0.0, tau=0.0)
    assert variant_spec('transformer-prenorm').fixed == dict(norm='pre', rezero=False, lam=0.0, tau=0.0)
    assert variant_spec('transformer-rezero').fixed == dict(norm='none', rezero=True, lam=0.0, tau=0.0)
    assert 'lam' not in variant_spec('neutreno').fixed and 'tau' not in variant_spec('similarity-removal').fixed
    assert make('neutreno').cfg.lam == 0.6 and make('similarity-removal').cfg.tau == 1.0
    with pytest.raises(ValueError, match="variant 'transformer' fixes"):
        make('transformer', lam=0.5)
    with pytest.raises(TypeError, match='valid fields are'):
        make('neutreno', lamda=0.5)
    with pytest.raises(TypeError, match='needs a SoftmaxConfig'):
        SoftmaxEncoder(EncoderConfig(100, 3))


# --- every variant ---------------------------------------------------------------------

@pytest.mark.parametrize('sym', [False, True])
@pytest.mark.parametrize('name', BASELINES)
def test_variant_contract(name, sym):
    torch.manual_seed(0)
    m = make(name, dropout=0.1, sym=sym).eval()
    logits = m(X_PAD)
    assert logits.shape == (2, 3)
    torch.testing.assert_close(logits[:1], m(X_PAD[:1, :4]), rtol=1e-5, atol=1e-5)   # padding invariance
    hs = m.encode(X_PAD)
    assert len(hs) == 3 and all(torch.isfinite(h).all() for h in hs)                  # padded rows finite too
    assert torch.equal(m(X_PAD), m(X_PAD))                                             # eval determinism
    m.train()
    assert not torch.equal(m(X_PAD), m(X_PAD))
    m.eval()
    with pytest.raises(TypeError, match='integer token ids'):
        m(X_PAD.float())
    with pytest.raises(ValueError, match='out of vocabulary'):
        m(torch.tensor([[5, 100]]))
    with pytest.raises(ValueError, match='exceeds max_len'):
        m(torch.ones(1, 513, dtype=torch.long))
    with pytest.raises(ValueError, match='all padding'):
        m(torch.tensor([[0, 0], [1, 2]]))
    with pytest.raises(ValueError, match='rank 2'):
        m(X_PAD[0])
    with torch.autocast('cpu', dtype=torch.bfloat16):
        lo = m(X_PAD)
    assert torch.isfinite(lo).all()
    torch.testing.assert_close(lo.float(), logits, rtol=0.1, atol=0.1)


@settings(max_examples=10, deadline=None)
@given(n_real=st.integers(1, 6), n_pad=st.integers(1, 5), seed=st.integers(0, 1000))
def test_padding_never_changes_logits(n_real, n_pad, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 50, (1, n_real), generator=g)
    xp = torch.cat([x, torch.zeros(1, n_pad, dtype=torch.long)], 1)
    for name in ('neutreno', 'similarity-removal'):
        torch.manual_seed(0)
        m = make(name, vocab_sz=50).eval()
        torch.testing.assert_close(m(x), m(xp), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('sym', [False, True])
def test_lambda_and_tau_zero_are_the_transformer(sym):
    torch.manual_seed(0)
    x = torch.randint(1, 100, (3, 9))
    x[0, 6:] = 0
    tf = make('transformer', n_layers=3, sym=sym).eval()
    for name, knob in (('neutreno', dict(lam=0.)), ('similarity-removal', dict(tau=0.))):
        m = make(name, n_layers=3, sym=sym, **knob).eval()
        m.load_state_dict(tf.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(m.encode(x), tf.encode(x)))
        assert torch.equal(m(x), tf(x))
        m.cfg.lam, m.cfg.tau = 0.6, 1.0
        assert not torch.equal(m(x), tf(x))


def test_neutreno_v0_in_graph_and_layer0_plain():
    torch.manual_seed(0)
    x = torch.randint(1, 100, (2, 7))
    neu = make('neutreno', n_layers=3).eval()
    tf = make('transformer', n_layers=3).eval()
    tf.load_state_dict(neu.state_dict())
    hs, _, ctx, _ = neu.trace(x)
    assert ctx.v0.shape == (2, 4, 7, 16) and ctx.v0.requires_grad
    assert torch.equal(hs[1], tf.encode(x)[1]) and not torch.equal(hs[2], tf.encode(x)[2])
    # dL/d(layer-0 value projection) picks up the λ V0 path: it differs from the λ=0 model's gradient
    neu(x).sum().backward()
    g_neu = neu.blocks[0].qkv.weight.grad[128:].clone()
    tf(x).sum().backward()
    assert (g_neu - tf.blocks[0].qkv.weight.grad[128:]).abs().max().item() > 1e-6


def test_neutreno_block_needs_v0():
    blk = NeuTRENOEncoder(build_config('neutreno', 100, 3, n_layers=2)).blocks[1]
    with pytest.raises(ValueError, match=r"needs ctx\.v0"):
        blk(torch.randn(1, 3, 64), torch.ones(1, 3, dtype=torch.bool), BatchContext())


def test_rezero_identity_at_init_and_no_layernorm():
    rz = make('transformer-rezero', n_layers=3).eval()
    hs = rz.encode(X_PAD)
    assert all(torch.equal(h, hs[0]) for h in hs)
    assert not any(isinstance(mod, nn.LayerNorm) for mod in rz.modules())
    assert sum(1 for n, _ in rz.named_parameters() if n.endswith('alpha')) == 3


def test_pre_norm_option():
    torch.manual_seed(0)
    m = NeuTRENOEncoder(SoftmaxConfig(100, 3, norm='pre', tau=0.)).eval()
    torch.testing.assert_close(m(X_PAD)[:1], m(X_PAD[:1, :4]), rtol=1e-5, atol=1e-5)


def test_attention_maps_and_symmetry():
    torch.manual_seed(0)
    m = make('similarity-removal').eval()
    maps = attention_maps(m, X_PAD)
    assert len(maps) == 2 and maps[0].shape == (2, 4, 7, 7) and m.keep_attn is False
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(2, 4, 7))
    assert maps[0][0, :, :, 4:].abs().max().item() == 0
    x = torch.randint(1, 100, (1, 10))
    for sym, reversible in ((True, True), (False, False)):
        P = attention_maps(make('transformer', sym=sym).eval(), x)[1][0, 0].double()
        flows = stationary_distribution(P)[:, None] * P
        assert ((flows - flows.T).abs().max().item() < 1e-6) == reversible


def test_sdpa_matches_explicit_softmax():
    torch.manual_seed(0)
    blk = make('transformer', d_model=16, n_heads=2).blocks[0].eval()
    h = torch.randn(2, 5, 16)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]).bool()
    q, k, v = blk.project(h)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    torch.testing.assert_close(o, attention_probs(q, k, mask) @ v, rtol=1e-5, atol=1e-6)


def test_deep_stack_fixes_stay_below_transformer():
    for seed in range(2):
        torch.manual_seed(seed)
        x = torch.randint(1, 1000, (4, 48))
        x[0, 24:] = 0
        final = {}
        for name in ('transformer', 'neutreno', 'similarity-removal'):
            torch.manual_seed(seed)
            final[name] = layer_measure(make(name, vocab_sz=1000, n_layers=12).eval(), x)[-1].item()
        assert final['neutreno'] < final['transformer'] and final['similarity-removal'] < final['transformer']


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('name', BASELINES)
def test_cuda_autocast(name):
    torch.manual_seed(0)
    m = make(name).eval()
    ref = m(X_PAD)
    m = m.cuda()
    with torch.autocast('cuda', dtype=torch.bfloat16):
        out = m(X_PAD.cuda())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), ref, rtol=0.1, atol=0.1)


# --- similarity measures and the fix (transject_nb.similarity) ---------------------------

@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 3), n=st.integers(2, 10), d=st.integers(1, 6))
def test_token_similarity_properties(seed, B, n, d):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, n, d, generator=g, dtype=torch.float64)
    Pi = torch.full((n, n), 1 / n, dtype=torch.float64)
    ts = token_similarity(X)
    assert ts.shape == (B,)
    torch.testing.assert_close(ts, (Pi @ X).pow(2).sum((-2, -1)) / X.pow(2).sum((-2, -1)), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ts + token_diversity(X), torch.ones(B, dtype=torch.float64), rtol=0, atol=1e-12)
    assert ((ts >= -1e-12) & (ts <= 1 + 1e-12)).all()
    torch.testing.assert_close(token_similarity(2.5 * X[:, torch.randperm(n, generator=g)]), ts, rtol=1e-10, atol=1e-12)
    # padding-aware: appended junk rows marked as padding do not count
    Xp = torch.cat([X, 50 * torch.randn(B, 3, d, generator=g, dtype=torch.float64)], 1)
    mask = torch.cat([torch.ones(B, n), torch.zeros(B, 3)], 1).bool()
    torch.testing.assert_close(token_similarity(Xp, mask), ts, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(token_diversity(Xp, mask), 1 - ts, rtol=1e-9, atol=1e-10)


def test_remove_similarity():
    Y = torch.randn(2, 6, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]).bool()
    Z = remove_similarity(Y, mask)
    torch.testing.assert_close(token_similarity(Z, mask), torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(remove_similarity(Y, mask, tau=0.), Y)
    I, Pi = torch.eye(6, dtype=torch.float64), torch.full((6, 6), 1 / 6, dtype=torch.float64)
    torch.testing.assert_close(remove_similarity(Y, tau=0.4), (I - 0.4 * Pi) @ Y)
    Yp = Y.clone()
    Yp[0, 4:] = 1e3
    torch.testing.assert_close(remove_similarity(Yp, mask)[0, :4], Z[0, :4])
    assert remove_similarity(Y.to(torch.bfloat16), mask).dtype == torch.bfloat16
