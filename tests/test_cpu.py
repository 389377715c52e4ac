"Tests of `transject_nb.cpu`'s fused CPU kernel: it equals the readable layer (`transject.transject_layer`), values and every gradient, in float64."
import pytest
import torch
from hypothesis import given, settings, strategies as st

from transject_nb.transject import LayerWeights, TransJect, transject_layer, random_sigma
from transject_nb.core import masked_pool, variant_spec
from transject_nb.models import VARIANTS, create_model
from transject_nb.cpu import (KernelInputs, Plan, fused_layer, kernel_inputs, mix_weights, fold_experts, layer_path, threads, n_threads,
                              reorthogonalize_)

torch.set_num_threads(1)
VARIANTS4 = tuple(v for v in VARIANTS if variant_spec(v).family == 'transject')   # TransJect's variants, from the models table
FAST = settings(max_examples=30, deadline=None)
seeds = st.integers(0, 2**31 - 1)


def random_layer(seed, B, n, d, E, shared=False, entropic=False):
    "Tokens, Σ and weights of a random layer in float64, from leaves with gradients: `(h, sigma, p, leaves)`."
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    h, Q, logits, w_raw, b1, b2, s = r(B, n, d), torch.linalg.qr(r(2 * E + 2, d, d))[0], r(E), r(()), r(d), r(d), r(d) if shared else r(B, d)
    leaves = [t.requires_grad_() for t in (h, Q, logits, w_raw, b1, b2, s)]
    sigma = random_sigma(s).expand(B, d) if shared else torch.sigmoid(s)
    cases = torch.randint(0, 4, (E, d), generator=g) if entropic else None
    p = LayerWeights(Q[:E], Q[E:2 * E], torch.softmax(logits, 0), torch.tanh(w_raw), Q[2 * E], b1, Q[2 * E + 1], b2, cases)
    return h, sigma, p, leaves


# --- the check: fused equals readable -------------------------------------------------------------------------
@FAST
@given(seed=seeds, B=st.integers(1, 3), n=st.integers(1, 9), d=st.sampled_from([2, 4, 8]), E=st.integers(1, 3),
       shared=st.booleans(), entropic=st.booleans(), path=st.sampled_from(['auto', 'fold', 'direct']),
       chunk_rows=st.sampled_from([None, 1, 2, 5]), workers=st.sampled_from([1, 2]))
def test_fused_layer_equals_readable_layer(seed, B, n, d, E, shared, entropic, path, chunk_rows, workers):
    h, sigma, p, leaves = random_layer(seed, B, n, d, E, shared, entropic)
    with threads(workers): y = fused_layer(h, sigma, p, path, chunk_rows)
    y_ref = transject_layer(h, sigma, p)
    assert torch.allclose(y, y_ref, atol=1e-12)
    gy = torch.randn(B, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    with threads(workers): g = torch.autograd.grad(y, leaves, gy, retain_graph=True)
    for a, b in zip(g, torch.autograd.grad(y_ref, leaves, gy)): assert torch.allclose(a, b, atol=1e-11)
    with torch.no_grad(): assert torch.allclose(fused_layer(h, sigma, p, path, chunk_rows), y_ref, atol=1e-12)
    with torch.inference_mode(): assert torch.allclose(fused_layer(h, sigma, p, path, chunk_rows), y_ref.detach(), atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(variant=st.sampled_from(VARIANTS4), seed=seeds, training=st.booleans(), pooling=st.sampled_from(['mean', 'max']),
       d=st.sampled_from([4, 8]), L=st.integers(1, 3), E=st.integers(1, 3), B=st.integers(1, 3), n=st.integers(1, 12))
def test_fused_model_equals_readable_model(variant, seed, training, pooling, d, L, E, B, n):
    "The same weights with kernel='fused' and kernel='readable': logits, reconstruction loss and every parameter's gradient."
    cfg = dict(d_model=d, n_layers=L, n_experts=E, pooling=pooling, max_len=16)
    torch.manual_seed(seed)
    a = reorthogonalize_(create_model(variant, 40, 3, kernel='fused', **cfg).double())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in a.parameters(): t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    b = create_model(variant, 40, 3, kernel='readable', **cfg).double(); b.load_state_dict(a.state_dict())
    x = torch.randint(1, 40, (B, n), generator=g); x[0, max(1, n // 2):] = 0
    def run(m):
        torch.manual_seed(seed + 1); m.train(training)                  # the same entropic cases in both
        logits = m(x)
        return [logits, m.aux_loss, *torch.autograd.grad((logits * cot).sum() + m.aux_loss, list(m.parameters()), allow_unused=True)]
    cot = torch.randn(B, 3, dtype=torch.float64, generator=g)
    for u, v in zip(run(a), run(b)):
        assert (u is None) == (v is None) and (u is None or torch.allclose(u, v, atol=1e-10, rtol=1e-10))


@pytest.mark.parametrize('path', ['fold', 'direct'])
@pytest.mark.parametrize('entropic', [False, True])
def test_fused_layer_gradcheck(path, entropic):
    "Finite differences through every tensor of `LayerWeights`, the tokens and Σ, with blocks that split sequences."
    torch.manual_seed(0)
    B, n, d, E = 2, 5, 3, 2
    ins = [torch.randn(B, n, d), torch.rand(B, d), torch.randn(E, d, d), torch.randn(E, d, d), torch.rand(E), torch.tensor(0.4),
           torch.randn(d, d), torch.randn(d), torch.randn(d, d), torch.randn(d)]
    ins = [t.double().requires_grad_() for t in ins]
    cases = torch.randint(0, 4, (E, d)) if entropic else None
    f = lambda h, s, U, V, lam, a, W1, b1, W2, b2: fused_layer(h, s, LayerWeights(U, V, lam, a, W1, b1, W2, b2, cases), path, chunk_rows=2)
    assert torch.autograd.gradcheck(f, ins)


def test_autocast_bf16():
    h, sigma, p, leaves = random_layer(0, 2, 40, 16, 3, entropic=True)
    h32, s32 = h.detach().float().requires_grad_(), sigma.detach().float()
    p32 = LayerWeights(*(t if t is None or t.dtype == torch.long else t.detach().float().requires_grad_() for t in p))
    with torch.autocast('cpu', dtype=torch.bfloat16): y16 = fused_layer(h32, s32, p32)
    y16.sum().backward()
    y32 = transject_layer(h32, s32, p32)
    assert y16.dtype == torch.float32 and (y16 - y32).abs().max() / y32.abs().max() < 0.02
    assert all(torch.isfinite(t.grad).all() for t in (h32, *p32) if t is not None and t.dtype != torch.long)


# --- worker threads ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize('workers', [2, 3])
@pytest.mark.parametrize('B', [1, 4])
def test_worker_threads_give_the_same_results(workers, B):
    "Bit for bit in the forward pass, to rounding in the gradients, whatever the number of workers (set by torch's threads or by `threads`)."
    h, sigma, p, leaves = random_layer(0, B, 30, 8, 2, entropic=True)
    out, prev = {}, torch.get_num_threads()
    try:
        for how in ('one', 'torch', 'ctx'):
            torch.set_num_threads(workers if how == 'torch' else 1)
            with threads(workers if how == 'ctx' else None):
                for path in ('fold', 'direct'):
                    y = fused_layer(h, sigma, p, path, chunk_rows=4)
                    with torch.inference_mode(): yi = fused_layer(h, sigma, p, path, chunk_rows=4)
                    out[how, path] = (y, torch.autograd.grad(y, leaves, torch.ones_like(y), retain_graph=True), yi)
    finally: torch.set_num_threads(prev)
    for how in ('torch', 'ctx'):
        for path in ('fold', 'direct'):
            (y1, g1, i1), (y2, g2, i2) = out['one', path], out[how, path]
            assert torch.equal(y1, y2) and torch.equal(i1, i2)
            for a, b in zip(g1, g2): assert torch.allclose(a, b, atol=1e-12)
    assert torch.get_num_threads() == prev


def test_whole_model_with_worker_threads_matches_one_thread():
    m = create_model('entropic-transject', 40, 3, d_model=8, n_layers=2, n_experts=2, kernel='fused')
    m = reorthogonalize_(m.double())
    with torch.no_grad():
        for t in m.parameters(): t.add_(0.5 * torch.randn_like(t))
    x = torch.randint(1, 40, (3, 20))
    def run():
        m.zero_grad(); m.eval()
        with torch.no_grad(): y = m(x)
        m.train(); torch.manual_seed(3); (m(x).sum() + m.aux_loss).backward()
        return y, [t.grad.clone() for t in m.parameters()]
    with threads(2): y2, g2 = run()
    with threads(1): y1, g1 = run()
    assert torch.equal(y1, y2)
    for a, b in zip(g1, g2): assert torch.allclose(a, b, atol=1e-12)


def test_threads_context():
    assert n_threads('cpu') == torch.get_num_threads() and n_threads('cuda') == 1
    with threads(3):
        assert n_threads('cpu') == 3
        with threads(None): assert n_threads('cpu') == torch.get_num_threads()
        assert n_threads('cpu') == 3
    assert n_threads('cpu') == torch.get_num_threads()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match='threads: expected a positive int or None'):
            with threads(bad): pass


# --- the pieces --------------------------------------------------------------------------------------------------
def test_layer_path_fold_and_mix_weights():
    assert layer_path(1024, 256) == 'fold' and layer_path(256, 256) == 'direct'
    torch.manual_seed(0)
    U, V, s = torch.randn(3, 4, 4), torch.randn(3, 4, 4), torch.rand(2, 4)
    M = fold_experts(U, V, s)
    assert M.shape == (2, 4, 12)
    assert torch.allclose(M[1, :, 4:8], U[1] @ torch.diag(s[1]) @ V[1], atol=1e-6)
    lam, a = torch.softmax(torch.randn(3), 0), torch.tensor(0.3)
    w, cx = mix_weights(LayerWeights(U, V, lam, a, *[None] * 4), 4)
    assert cx is None and torch.allclose(w, (a * lam)[:, None].expand(3, 4))
    w, cx = mix_weights(LayerWeights(U, V, lam, a, *[None] * 4, cases=torch.full((3, 4), 2)), 4)      # case 2: 4F, no identity
    assert torch.allclose(w, 4 * a * lam[:, None].expand(3, 4)) and torch.equal(cx, torch.zeros(4))


def test_kernel_inputs_and_errors():
    h, sigma, p, _ = random_layer(0, 2, 3, 4, 1)
    k, plan = kernel_inputs(h, sigma, p)
    assert isinstance(k, KernelInputs) and isinstance(plan, Plan) and plan.E == 1 and plan.cd == torch.float64
    assert k.M is None and k.Ucat.shape == (4, 4)                        # n = 3 < d = 4: the direct path
    with pytest.raises(ValueError, match=r'sigma must have shape \(2, 4\) or \(1, 4\)'): fused_layer(h, sigma[:, :3], p)
    with pytest.raises(ValueError, match="path must be 'auto', 'fold' or 'direct'"): fused_layer(h, sigma, p, path='fused')
    with pytest.raises(ValueError, match='expected U, V of shape'): fused_layer(h, sigma, p._replace(V=p.V[:, :3]))


def test_no_gradient_keeps_nothing():
    "Without gradients the block loop runs directly: no autograd function, nothing saved."
    h, sigma, p, _ = random_layer(0, 2, 6, 4, 2)
    with torch.no_grad(): y = fused_layer(h, sigma, p)
    assert y.grad_fn is None and not y.requires_grad
    assert fused_layer(h, sigma, p).grad_fn is not None
