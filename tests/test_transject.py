"Property tests of `transject_nb.transject`: the encoder's contract, its orthogonality, Theorem 2's bounds, on the readable and the fused layer (their equality is `test_cpu.py`'s), and the authors' input-dependent expert gate (`gate='input'`)."
import math
import re
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from transject_nb.core import BatchContext, build_config, config_fields, variant_spec
from transject_nb.bounds import layer_bounds, transject_bounds, residual_bounds, worst_ratio
from transject_nb.bounds import ENTROPIC_CASES
from transject_nb.transject import (KERNELS, GATES, TransJectConfig, TransJect, TransJectLayer, LayerWeights, orthogonal_attention,
                                    approx_sigma, random_sigma, mix_experts, orthogonal_ffn, transject_layer, token_distance_ratios,
                                    plot_distance_ratios, input_gate)
from transject_nb.cpu import (ORTH_MAPS, OrthogonalBank, CayleyOrthogonal, orthogonality_error, reorthogonalize_, block_inverse,
                              cayley_map, one_thread)
from transject_nb import transject as T
from transject_nb.models import VARIANTS

torch.set_num_threads(1)
VARIANTS4 = tuple(v for v in VARIANTS if variant_spec(v).family == 'transject')   # TransJect's variants, from the models table
FAST = settings(max_examples=30, deadline=None)
seeds = st.integers(0, 2**31 - 1)
layer_kernels = st.sampled_from(['readable', 'fused'])


def make(variant, seed=0, double=False, vocab_sz=40, n_classes=3, **kw):
    torch.manual_seed(seed)
    cfg = build_config(variant, vocab_sz, n_classes, **(dict(d_model=8, n_layers=2, n_experts=2, max_len=32) | kw))
    m = TransJect(cfg)
    return reorthogonalize_(m.double()) if double else m


def randomize_(m, seed, scale=1.0, alphas=None):
    "Random values for every parameter; `alphas`: the raw residual weights w_l (alpha_l = tanh(w_l))."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters(): p.copy_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
        if alphas is not None:
            for blk, a in zip(m.blocks, alphas): blk.alpha_raw.fill_(a)
    return m


def tokens(seed, B, n, vocab_sz=40, pad=0):
    "Random ids (B, n) with 0..n-1 trailing padding per row, plus `pad` extra padding columns."
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, vocab_sz, (B, n), generator=g)
    for b in range(B): x[b, int(torch.randint(1, n + 1, (1,), generator=g)):] = 0
    return torch.cat([x, x.new_zeros(B, pad)], 1)


# --- registry and config -------------------------------------------------------------------------------------
def test_variants_registered():
    fixed = {'transject': ('approx', 'plain'), 'entropic-transject': ('approx', 'entropic'),
             'random-transject': ('random', 'plain'), 'random-entropic-transject': ('random', 'entropic')}
    for v, (sg, res) in fixed.items():
        spec = variant_spec(v)
        assert spec.config_cls is TransJectConfig and spec.model_cls is TransJect and spec.doc
        assert spec.fixed == dict(sigma=sg, residual=res)
        cfg = build_config(v, 10, 2)
        assert (cfg.sigma, cfg.residual, cfg.orth_map, cfg.n_experts, cfg.sigma_eps, cfg.kernel) == (sg, res, 'cayley', 4, 1e-6, 'auto')
    assert 'eps' not in config_fields(TransJectConfig)       # the presets' optimiser `eps` must not land in the model config


def test_config_errors():
    with pytest.raises(ValueError, match='d_model must be a multiple of 4'): TransJectConfig(10, 2, d_model=6)
    with pytest.raises(ValueError, match="unknown sigma 'eigh'"): TransJectConfig(10, 2, sigma='eigh')
    with pytest.raises(ValueError, match="unknown residual 'x'"): TransJectConfig(10, 2, residual='x')
    with pytest.raises(ValueError, match="unknown orth_map 'qr'"): TransJectConfig(10, 2, orth_map='qr')
    with pytest.raises(ValueError, match='n_experts must be a positive int'): TransJectConfig(10, 2, n_experts=True)
    with pytest.raises(ValueError, match=re.escape('sigma_eps must lie in (0, 1)')): TransJectConfig(10, 2, sigma_eps=0)
    with pytest.raises(ValueError, match="valid kernels are: auto, readable, fused"): TransJectConfig(10, 2, kernel='gpu')
    with pytest.raises(ValueError, match='fixes'): build_config('random-transject', 10, 2, sigma='approx')


def test_bad_input_errors_come_from_check_tokens():
    m = make('transject').eval()
    with pytest.raises(TypeError, match='integer token ids'): m(torch.ones(1, 3))
    with pytest.raises(ValueError, match='out of vocabulary'): m(torch.tensor([[1, 40]]))
    with pytest.raises(ValueError, match='exceeds max_len=32'): m(torch.ones(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match='all padding'): m(torch.tensor([[1, 2], [0, 0]]))
    with pytest.raises(ValueError, match='rank 2'): m.encode(torch.ones(3, dtype=torch.long))


# --- the contract ----------------------------------------------------------------------------------------------
@FAST
@given(variant=st.sampled_from(VARIANTS4), seed=seeds, B=st.integers(1, 3), n=st.integers(1, 10), pad=st.integers(1, 8),
       pooling=st.sampled_from(['mean', 'max']), E=st.integers(1, 3), kernel=layer_kernels)
def test_padding_does_not_change_logits(variant, seed, B, n, pad, pooling, E, kernel):
    m = randomize_(make(variant, seed, pooling=pooling, n_experts=E, kernel=kernel), seed, scale=0.5).eval()
    x = tokens(seed, B, n)
    with torch.no_grad():
        y, y_pad = m(x), m(torch.cat([x, x.new_zeros(B, pad)], 1))
        hs, hs_pad = m.encode(x), m.encode(torch.cat([x, x.new_zeros(B, pad)], 1))
    assert torch.allclose(y, y_pad, atol=1e-5, rtol=1e-5)
    for h, hp in zip(hs, hs_pad): assert torch.allclose(h, hp[:, :n], atol=1e-5, rtol=1e-5)


@FAST
@given(variant=st.sampled_from(VARIANTS4), seed=seeds, kernel=layer_kernels)
def test_eval_is_deterministic_and_entropic_eval_is_plain(variant, seed, kernel):
    m = randomize_(make(variant, seed, kernel=kernel), seed).eval()
    x = tokens(seed, 3, 9)
    with torch.no_grad(): assert torch.equal(m(x), m(x))
    plain = make(variant.replace('entropic-', ''), seed, kernel=kernel)
    plain.load_state_dict(m.state_dict()); plain.eval()
    with torch.no_grad(): assert torch.equal(plain(x), m(x))


def test_entropic_training_draws_cases():
    m = randomize_(make('entropic-transject', 0, n_experts=3), 0).train()
    x = tokens(0, 2, 8)
    hs, mask, ctx, _ = m.trace(x)
    assert [c.shape for c in ctx.entropic_cases] == [(3, 8)] * 2
    assert all(int(c.min()) >= 0 and int(c.max()) <= 3 for c in ctx.entropic_cases)
    torch.manual_seed(1); y1 = m(x)
    torch.manual_seed(2); y2 = m(x)
    assert not torch.equal(y1, y2)
    torch.manual_seed(1); assert torch.equal(m(x), y1)       # the draws follow torch's RNG
    # the four cases average to the plain residual
    h, A, lam = torch.randn(1, 4, 8, dtype=torch.float64), torch.randn(1, 4, 3, 8, dtype=torch.float64), torch.softmax(torch.randn(3, dtype=torch.float64), 0)
    avg = sum(mix_experts(h, A, lam, 0.3, torch.full((3, 8), c)) for c in range(4)) / 4
    assert torch.allclose(avg, mix_experts(h, A, lam, 0.3), atol=1e-12)
    assert len(ENTROPIC_CASES) == 4


def test_ctx_and_shapes():
    m = make('transject', n_layers=3, n_experts=2).eval()
    x = tokens(0, 2, 6)
    hs, mask, ctx, aux_loss = m.trace(x)
    assert len(hs) == 4 and all(h.shape == (2, 6, 8) for h in hs)
    assert ctx.sigma.shape == (2, 8) and torch.allclose(ctx.sigma.amax(-1), torch.ones(2))
    assert [w.shape for w in ctx.expert_weights] == [(2,)] * 3
    assert all(torch.allclose(w.sum(), torch.tensor(1.)) for w in ctx.expert_weights)
    assert ctx.entropic_cases == [None] * 3
    assert m.aux_loss.shape == () and 0 <= m.aux_loss.item() <= 1
    assert aux_loss is ctx.aux_loss and m.aux_loss is aux_loss                      # the trace's loss is the one left in the buffer
    assert m.alphas().shape == (3,)
    r = make('random-transject').eval(); r(x)
    assert r.aux_loss.item() == 0


@pytest.mark.parametrize('kernel', ['readable', 'fused'])
def test_rezero_identity_at_init_and_gradients_flow(kernel):
    for v in VARIANTS4:
        m = make(v, kernel=kernel).eval()
        x, y = tokens(1, 3, 8), torch.tensor([0, 1, 2])
        hs = m.encode(x)
        assert all(torch.equal(h, hs[0]) for h in hs)                 # alpha = 0: every layer is the identity (in eval)
        m.train()
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for step in range(2):
            opt.zero_grad()
            (F.cross_entropy(m(x), y) + m.aux_loss).backward()
            if step == 0: opt.step()
        dead = [k for k, p in m.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
        assert not dead, f"{v}: no gradient reaches {dead}"


@pytest.mark.parametrize('orth_map,d', [(om, 8) for om in ORTH_MAPS] + [('cayley', 64)])
def test_orthogonal_after_many_large_adam_steps(orth_map, d):
    m = make('entropic-transject', 0, d_model=d, orth_map=orth_map).train()
    assert orthogonality_error(m) < 1e-5
    x, y = tokens(2, 4, 8), torch.tensor([0, 1, 2, 0])
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    for _ in range(200):
        opt.zero_grad(); (F.cross_entropy(m(x), y) + m.aux_loss).backward(); opt.step()
    assert orthogonality_error(m) < 1e-5
    assert m.alphas().abs().max() < 1


def test_cayley_cpu_large_batched_does_not_hang():
    "oneMKL's batched LU fails or hangs for >= 2 matrices of size >= 256 with 2 threads; CayleyOrthogonal solves them one by one."
    prev = torch.get_num_threads(); torch.set_num_threads(2)
    try:
        b = OrthogonalBank(2, 256)
        with torch.no_grad(): b.parametrizations.weight.original.normal_()
        Q = b(); Q.sum().backward()
        assert orthogonality_error(b) < 1e-5
        assert b.parametrizations.weight.original.grad.abs().sum() > 0
    finally: torch.set_num_threads(prev)


def test_orthogonal_bank_assignment_and_autocast():
    Q = torch.linalg.qr(torch.randn(3, 6, 6))[0]
    for om in ORTH_MAPS:
        b = OrthogonalBank(3, 6, om); b.weight = Q
        assert torch.allclose(b(), Q, atol=1e-5)
        with torch.autocast('cpu', dtype=torch.bfloat16): assert b().dtype == torch.float32
    with pytest.raises(ValueError, match='orth_map must be one of'): OrthogonalBank(1, 4, 'svd')
    b = OrthogonalBank(2, 6).double()
    assert orthogonality_error(b) > 1e-12 and orthogonality_error(reorthogonalize_(b)) < 1e-13


@pytest.mark.parametrize('kernel,gate', [('readable', 'static'), ('fused', 'static'), ('readable', 'input')])   # the fused kernel takes no input gate
@pytest.mark.parametrize('variant', VARIANTS4)
def test_autocast_bf16_cpu(variant, kernel, gate):
    m = randomize_(make(variant, 3, d_model=16, kernel=kernel, gate=gate), 3, scale=0.5).train()
    x, y = tokens(3, 3, 10), torch.tensor([0, 1, 2])
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = m(x); loss = F.cross_entropy(out, y) + m.aux_loss
    loss.backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    m.eval()
    with torch.no_grad():
        with torch.autocast('cpu', dtype=torch.bfloat16): o16 = m(x)
        o32 = m(x)
    assert torch.allclose(o16.float(), o32, atol=0.1, rtol=0.05)


# --- Theorem 2 -------------------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(variant=st.sampled_from(VARIANTS4), seed=seeds, d=st.sampled_from([4, 8, 12]), L=st.integers(1, 4),
       E=st.integers(1, 3), data=st.data(), scale=st.sampled_from([0.1, 1., 10.]), B=st.integers(1, 3), n=st.integers(2, 12),
       kernel=layer_kernels)
def test_eval_distance_ratios_within_theorem2_bounds(variant, seed, d, L, E, data, scale, B, n, kernel):
    alphas = data.draw(st.lists(st.floats(-50, 50), min_size=L, max_size=L), label='w')
    m = randomize_(make(variant, seed, double=True, d_model=d, n_layers=L, n_experts=E, kernel=kernel), seed, scale=scale, alphas=alphas).eval()
    x = tokens(seed, B, n)
    x[0, :2] = torch.tensor([1, 1])                                      # at least one pair of real tokens (same id, two positions)
    with torch.no_grad(): lo, hi = token_distance_ratios(m.encode(x), x != 0)
    blo, bhi = layer_bounds(m.alphas(), L)
    tlo, thi = transject_bounds(L)
    assert (m.alphas().abs() <= 1).all()
    assert (lo >= blo * (1 - 1e-9)).all(), (lo, blo)
    assert (hi <= bhi * (1 + 1e-9)).all(), (hi, bhi)
    assert blo[-1] >= tlo * (1 - 1e-12) and bhi[-1] <= thi * (1 + 1e-12)


def test_entropic_training_can_leave_the_bounds():
    m = randomize_(make('entropic-transject', 0, double=True, d_model=16, n_layers=4, n_experts=1), 0, alphas=[0.3] * 4).train()
    x = tokens(0, 4, 20); x[:, :12] = torch.randint(1, 40, (4, 12))
    torch.manual_seed(0)
    with torch.no_grad(): worst = max(token_distance_ratios(m.encode(x), x != 0)[1][-1].item() for _ in range(20))
    assert worst > layer_bounds(m.alphas(), 4)[1][-1].item()


def test_token_distance_ratios_and_plot():
    hs = [torch.tensor([[[0., 0.], [1., 0.], [0., 0.]]]), torch.tensor([[[0., 0.], [2., 0.], [5., 5.]]])]
    lo, hi = token_distance_ratios(hs, torch.tensor([[True, True, False]]))
    assert lo.tolist() == [1., 2.] and hi.tolist() == [1., 2.] and lo.dtype == torch.float64
    with pytest.raises(ValueError, match='no pair of real tokens'): token_distance_ratios(hs, torch.tensor([[True, False, False]]))
    import matplotlib; matplotlib.use('Agg')
    ax = plot_distance_ratios(make('transject').eval(), tokens(0, 2, 6))
    assert ax.get_yscale() == 'log'


# --- the pieces ------------------------------------------------------------------------------------------------
@FAST
@given(seed=seeds, B=st.integers(1, 3), n=st.integers(1, 9), d=st.integers(1, 9))
def test_approx_sigma_matches_brute_force(seed, B, n, d):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, n, d, generator=g, dtype=torch.float64)
    mask = torch.rand(B, n, generator=g) < 0.7; mask[:, 0] = True
    U = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    sigma, s, recon = approx_sigma(x, mask, U)
    for b in range(B):
        X = x[b][mask[b]]; M = X.T @ X
        sb = torch.diagonal(U.T @ M @ U)
        assert torch.allclose(s[b], sb, atol=1e-10)
        assert torch.allclose(recon[b], (M - U @ torch.diag(sb) @ U.T).pow(2).sum() / M.pow(2).sum(), atol=1e-10)
    assert torch.allclose(sigma.amax(-1), torch.ones(B, dtype=torch.float64)) and (sigma >= 0).all()
    x2 = x.clone(); x2[~mask] = 1e3                                       # padding rows are ignored
    assert torch.allclose(approx_sigma(3 * x2, mask, U)[0], sigma, atol=1e-10)   # and the result is scale-free
    assert torch.allclose(approx_sigma(3 * x2, mask, U)[2], recon, atol=1e-10)


@FAST
@given(seed=seeds, d=st.sampled_from([2, 4, 8]), E=st.integers(1, 3))
def test_pieces_are_one_lipschitz(seed, d, E):
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(2 * E + 2, d, d, generator=g, dtype=torch.float64))[0]
    sigma = random_sigma(3 * torch.randn(d, generator=g, dtype=torch.float64))[None]
    lam = torch.softmax(torch.randn(E, generator=g, dtype=torch.float64), 0)
    b1, b2 = 3 * torch.randn(2, d, generator=g, dtype=torch.float64)
    x, y = 3 * torch.randn(2, 1, 16, d, generator=g, dtype=torch.float64)
    dist = lambda f: (f(x) - f(y)).norm(dim=-1) / (x - y).norm(dim=-1)
    attn = lambda t: mix_experts(torch.zeros_like(t), orthogonal_attention(t, sigma, Q[:E], Q[E:2 * E]), lam, 1.)
    assert (dist(attn) <= 1 + 1e-12).all()
    assert (dist(lambda t: orthogonal_ffn(t, Q[-2], b1, Q[-1], b2)) <= 1 + 1e-12).all()
    a = 0.7
    r = dist(lambda t: mix_experts(t, orthogonal_attention(t, sigma, Q[:E], Q[E:2 * E]), lam, a))
    assert (r >= 1 - a - 1e-12).all() and (r <= 1 + a + 1e-12).all()


@FAST
@given(seed=seeds, d=st.sampled_from([2, 4, 8]), E=st.integers(1, 3), a=st.floats(-0.99, 0.99), entropic_eval=st.booleans())
def test_layer_is_bi_lipschitz_with_the_sublayers_constants(seed, d, E, a, entropic_eval):
    "`transject_layer` on the token pairs of one sequence: ratios within (1 -+ |a|)^2, Theorem 2's factor per layer; a = 0 is the identity."
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    Q = torch.linalg.qr(r(2 * E + 2, d, d))[0]
    p = LayerWeights(Q[:E], Q[E:2 * E], torch.softmax(r(E), 0), torch.tensor(a, dtype=torch.float64), Q[2 * E], 3 * r(d), Q[2 * E + 1], 3 * r(d))
    sigma = random_sigma(3 * r(d))[None]                                   # (1, d) one sequence
    x, y = 3 * r(2, 1, 16, d)
    ratio = (transject_layer(x, sigma, p) - transject_layer(y, sigma, p)).norm(dim=-1) / (x - y).norm(dim=-1)
    lo, hi = residual_bounds(a)
    assert (ratio >= lo ** 2 - 1e-12).all() and (ratio <= hi ** 2 + 1e-12).all()
    assert torch.equal(transject_layer(x, sigma, p._replace(a=torch.tensor(0., dtype=torch.float64))), x)


def test_layer_kernel_choice():
    "'auto' runs the fused kernel on the CPU and the readable layer elsewhere; 'readable' and 'fused' hold on every device."
    for kernel, cpu, cuda in (('auto', True, False), ('readable', False, False), ('fused', True, True)):
        layer = make('transject', kernel=kernel).blocks[0]
        assert (layer.uses_fused('cpu'), layer.uses_fused(torch.device('cuda'))) == (cpu, cuda)
    assert KERNELS == ('auto', 'readable', 'fused')


def test_random_variant_has_no_token_mixing():
    m = randomize_(make('random-transject', 0), 0).eval()
    x = tokens(0, 1, 8); x[0] = torch.randint(1, 40, (8,))
    x2 = x.clone(); x2[0, 3] = (x[0, 3] % 39) + 1
    with torch.no_grad(): h, h2 = m.encode(x)[-1], m.encode(x2)[-1]
    keep = torch.arange(8) != 3
    assert torch.equal(h[0, keep], h2[0, keep]) and not torch.equal(h[0, 3], h2[0, 3])
    a = randomize_(make('transject', 0), 0).eval()                       # approx: the context enters through Sigma
    with torch.no_grad(): assert not torch.equal(a.encode(x)[-1][0, keep], a.encode(x2)[-1][0, keep])


# --- the orthogonal maps: block inverse, Cayley map, caches ---------------------------------------------------
@FAST
@given(seed=seeds, d=st.integers(1, 150), scale=st.sampled_from([0.01, 1., 30.]))
def test_block_inverse_matches_lapack(seed, d, scale):
    g = torch.Generator().manual_seed(seed)
    A = scale * torch.randn(2, d, d, generator=g, dtype=torch.float64); A = A - A.mT
    K = torch.eye(d, dtype=torch.float64) - A / 2
    with one_thread(): Kinv = torch.linalg.inv(K)
    assert torch.allclose(block_inverse(K, leaf=8), Kinv, atol=1e-9 * (1 + scale ** 2))
    C = cayley_map(A)
    assert (C.mT @ C - torch.eye(d, dtype=torch.float64)).abs().max() < 1e-9


def test_cayley_map_gradcheck_and_base():
    torch.manual_seed(0)
    W = torch.randn(3, 5, 5, dtype=torch.float64, requires_grad=True)
    base = torch.linalg.qr(torch.randn(3, 5, 5, dtype=torch.float64))[0]
    assert torch.autograd.gradcheck(lambda w: cayley_map(w.tril() - w.tril().mT, base), (W,))
    A = (W.tril() - W.tril().mT).detach()
    I = torch.eye(5, dtype=torch.float64)
    assert torch.allclose(cayley_map(A, base), base @ torch.linalg.solve(I - A / 2, I + A / 2), atol=1e-12)


def test_block_inverse_needs_a_positive_definite_symmetric_part():
    with pytest.raises(RuntimeError, match='singular'): block_inverse(torch.tensor([[0., 1.], [1., 0.]]), leaf=1)


def test_bank_caches_without_gradients_and_recomputes_after_a_change():
    b = OrthogonalBank(2, 6)
    with torch.no_grad():
        q1 = b(); q2 = b()
        assert q1 is q2                                                      # cached
        b.parametrizations.weight.original.add_(0.1)                         # a parameter changes: recomputed
        q3 = b()
    assert q3 is not q1 and not torch.equal(q3, q1)
    assert b().requires_grad and b() is not q3                               # with gradients: always computed
    b.weight = torch.linalg.qr(torch.randn(2, 6, 6))[0]                      # a new base
    with torch.no_grad(): assert orthogonality_error(b) < 1e-5 and not torch.equal(b(), q3)
    m = make('transject', 0).eval()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    x = tokens(0, 2, 6)
    with torch.no_grad(): y0 = m(x)
    m.train(); (m(x).sum() + m.aux_loss).backward(); opt.step(); m.eval()
    with torch.no_grad(): y1 = m(x)
    assert not torch.equal(y0, y1)                                           # the optimiser's step invalidates the cache


def test_paper_size_model_builds_with_two_threads():
    "The paper's size with 2 threads: the batched QR and LU of the orthogonal banks must not reach oneMKL's batched-LU bug (it hangs)."
    prev = torch.get_num_threads(); torch.set_num_threads(2)
    try: m = TransJect(TransJectConfig(100, 2, d_model=512, n_layers=6, n_experts=4))
    finally: torch.set_num_threads(prev)
    assert orthogonality_error(m) < 1e-5                                     # timings are the benchmark's business, not a test's


def test_token_distance_ratios_skips_pairs_equal_at_layer_0():
    from transject_nb.transject import token_distance_ratios
    h0 = torch.tensor([[[0., 0.], [0., 0.], [3., 4.]]])                  # tokens 0 and 1 coincide
    h1 = 2 * h0
    lo, hi = token_distance_ratios([h0, h1], torch.ones(1, 3, dtype=torch.bool))
    assert torch.isfinite(lo).all() and torch.isfinite(hi).all()
    assert torch.allclose(lo, torch.tensor([1., 2.], dtype=torch.float64)) and torch.allclose(hi, lo)
    with pytest.raises(ValueError, match='equal at layer 0'):
        token_distance_ratios([torch.zeros(1, 3, 2)] * 2, torch.ones(1, 3, dtype=torch.bool))


# --- the input-dependent expert gate (gate='input') -----------------------------------------------------------
def gated(variant='transject', seed=0, gate_scale=1., **kw):
    "A float64 model with the input gate and random parameters, in eval mode; `gate_scale` steepens the gate."
    m = randomize_(make(variant, seed, double=True, gate='input', **kw), seed).eval()
    with torch.no_grad():
        for blk in m.blocks: blk.gate_w.mul_(gate_scale)
    return m


def test_gate_config_and_errors():
    assert GATES == ('static', 'input') and TransJectConfig(10, 2).gate == 'static'
    assert 'gate' in config_fields(TransJectConfig)
    for v in VARIANTS4: assert build_config(v, 10, 2).gate == 'static' and build_config(v, 10, 2, gate='input').gate == 'input'
    with pytest.raises(ValueError, match="unknown gate 'moe'; valid gates are: static, input"): TransJectConfig(10, 2, gate='moe')
    with pytest.raises(ValueError, match="gate='input' runs on the readable layer only"): TransJectConfig(10, 2, gate='input', kernel='fused')
    with pytest.raises(TypeError, match="gate='input': λ depends on the input"): make('transject', gate='input').blocks[0].expert_weights()


def test_static_gate_takes_the_old_path():
    "The default keeps the old parameters and computes exactly the old expressions: λ = softmax(logits), h + a Σ λ_e A_e."
    m = randomize_(make('transject', 3, n_experts=3, kernel='readable'), 3).eval()
    blk = m.blocks[0]
    assert [k for k, _ in blk.named_parameters() if not k.startswith('bank')] == ['alpha_raw', 'gate_logits', 'b1', 'b2']
    assert not hasattr(blk, 'gate_w') and blk.gate == 'static'
    p = blk.weights()
    assert torch.equal(p.lam, torch.softmax(blk.gate_logits, 0))
    g = torch.Generator().manual_seed(0)
    h, A = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 3, 8, generator=g)
    lam, a, cases = p.lam.detach(), 0.3, torch.randint(0, 4, (3, 8), generator=g)
    assert torch.equal(mix_experts(h, A, lam, a), h + a * (lam[:, None] * A).sum(-2))            # the old plain expression, bit for bit
    coef = torch.tensor(ENTROPIC_CASES)[cases]
    cx, cf = lam[:, None] * coef[..., 0], lam[:, None] * coef[..., 1]
    assert torch.equal(mix_experts(h, A, lam, a, cases), h * cx.sum(0) + a * (cf * A).sum(-2))  # the old entropic one
    x = tokens(1, 2, 7)
    with torch.no_grad():                                                  # the layer's forward is transject_layer on these weights
        h0 = m.embed(x, None); ctx = m.begin(h0, x != 0)
        assert torch.equal(blk(h0, x != 0, ctx), transject_layer(h0, ctx.sigma, blk.weights()))
    for kernel, fused in (('auto', True), ('readable', False), ('fused', True)):
        assert make('transject', kernel=kernel).blocks[0].uses_fused('cpu') == fused


@pytest.mark.parametrize('variant', VARIANTS4)
def test_input_gate_rows_sum_to_one_and_depend_on_the_input(variant):
    m = gated(variant, 1, n_experts=3, n_layers=2)
    x = tokens(1, 4, 9); x[:, 0] = torch.arange(1, 5)                    # four different sequences
    with torch.no_grad(): ctx = m.trace(x).ctx
    lams = ctx.expert_weights
    assert [w.shape for w in lams] == [(4, 3)] * 2 and all(w.dtype == torch.float64 for w in lams)
    for w in lams:
        assert torch.allclose(w.sum(-1), torch.ones(4, dtype=torch.float64), atol=1e-12) and (w > 0).all()
        assert (w[0] - w[1:]).abs().amax(-1).min() > 1e-6                  # every sequence has its own λ
    x2 = x.clone(); x2[2, 0] = 7                                           # change sequence 2 only
    with torch.no_grad(): lams2 = m.trace(x2).ctx.expert_weights
    for w, w2 in zip(lams, lams2):
        assert not torch.equal(w[2], w2[2])                                # its λ moves ...
        assert torch.equal(w[[0, 1, 3]], w2[[0, 1, 3]])                    # ... the other sequences' do not


def test_input_gate_formula_and_mask():
    "λ_b = softmax_e(w · max over the real tokens of each expert's residual output), written out with a one-hot mixture; padding never wins the max."
    g = torch.Generator().manual_seed(0)
    B, n, E, d = 3, 6, 3, 8
    h, A, w = torch.randn(B, n, d, generator=g, dtype=torch.float64), torch.randn(B, n, E, d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)
    mask = torch.ones(B, n, dtype=torch.bool); mask[0, 4:] = False; mask[2, 1] = False
    for cases in (None, torch.randint(0, 4, (E, d), generator=g)):
        lam = input_gate(h, A, 0.4, w, mask, cases)
        for b in range(B):
            hb, Ab = h[b][mask[b]][None], A[b][mask[b]][None]
            R = torch.stack([mix_experts(hb, Ab, torch.eye(E, dtype=h.dtype)[e], 0.4, cases)[0] for e in range(E)])   # (E, n_b, d)
            assert torch.allclose(lam[b], torch.softmax(R.amax(1) @ w, 0), atol=1e-12)
        hp, Ap = h.clone(), A.clone(); hp[~mask], Ap[~mask] = 1e6, 1e6      # huge values where the mask is False
        assert torch.equal(input_gate(hp, Ap, 0.4, w, mask, cases), lam)
        assert not torch.allclose(input_gate(hp, Ap, 0.4, w, None, cases), lam)   # without the mask they would win
    with pytest.raises(ValueError, match=r'lam must have shape \(3,\) or \(3, 3\)'): mix_experts(h, A, lam[:2], 0.4)


@FAST
@given(variant=st.sampled_from(VARIANTS4), seed=seeds, B=st.integers(1, 3), n=st.integers(1, 10), pad=st.integers(1, 8),
       pooling=st.sampled_from(['mean', 'max']), E=st.integers(1, 3))
def test_input_gate_padding_changes_nothing(variant, seed, B, n, pad, pooling, E):
    m = randomize_(make(variant, seed, pooling=pooling, n_experts=E, gate='input'), seed, scale=0.5).eval()
    x = tokens(seed, B, n)
    xp = torch.cat([x, x.new_zeros(B, pad)], 1)
    with torch.no_grad(): (hs, _, ctx, _), (hsp, _, ctxp, _) = m.trace(x), m.trace(xp)
    for w, wp in zip(ctx.expert_weights, ctxp.expert_weights): assert torch.allclose(w, wp, atol=1e-6)   # the gate ignores padding
    for h, hp in zip(hs, hsp): assert torch.allclose(h, hp[:, :n], atol=1e-5, rtol=1e-5)
    with torch.no_grad(): assert torch.allclose(m(x), m(xp), atol=1e-5, rtol=1e-5)


def test_input_gate_gradients_flow():
    g = torch.Generator().manual_seed(0)
    h, A, w = torch.randn(2, 4, 6, generator=g, dtype=torch.float64), torch.randn(2, 4, 3, 6, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    ps = [t.clone().requires_grad_() for t in (h, A, w)]
    assert torch.autograd.gradcheck(lambda h_, A_, w_: input_gate(h_, A_, 0.3, w_, mask), ps)
    m = make('transject', gate='input', n_experts=3).train()               # α = 0: every expert's output is h, λ uniform, no gradient to the gate yet
    x, y = tokens(1, 3, 8), torch.tensor([0, 1, 2])
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for step in range(2):
        opt.zero_grad(); (F.cross_entropy(m(x), y) + m.aux_loss).backward()
        gate_grads = [blk.gate_w.grad.abs().sum().item() for blk in m.blocks]
        if step == 0: assert gate_grads == [0., 0.]; opt.step()
    assert min(gate_grads) > 0                                             # after one step the gate learns
    dead = [k for k, p in m.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not dead, dead


def test_input_gate_runs_the_readable_layer():
    from transject_nb.cpu import fused_layer
    for kernel in ('auto', 'readable'):
        blk = make('transject', gate='input', kernel=kernel).blocks[0]
        assert not blk.uses_fused('cpu') and not blk.uses_fused(torch.device('cuda'))
    a, r = gated('transject', 2, kernel='auto'), gated('transject', 2, kernel='readable')
    x = tokens(2, 3, 7)
    with torch.no_grad(): assert torch.equal(a(x), r(x))
    blk = r.blocks[0]
    p = blk.weights()._replace(lam=torch.full((3, 2), 0.5, dtype=torch.float64))   # a (B, E) λ: the fused kernel refuses it
    with pytest.raises(ValueError, match='lam of shape'): fused_layer(torch.randn(3, 7, 8, dtype=torch.float64), torch.ones(3, 8, dtype=torch.float64), p)


@pytest.mark.parametrize('variant', VARIANTS4)
def test_input_gate_is_a_static_gate_within_each_sequence(variant):
    "Each sequence runs through the static model whose logits are log λ(sequence): the token-pair argument of Theorem 2 applies to it."
    m = gated(variant, 4, gate_scale=10., n_experts=3, n_layers=3)
    m.train(False)
    x = tokens(4, 3, 9); x[:, :2] = torch.tensor([3, 5])
    with torch.no_grad(): hs, mask, ctx, _ = m.trace(x)
    for b in range(3):
        s = make(variant, 4, double=True, n_experts=3, n_layers=3)
        sd = {k: v for k, v in m.state_dict().items() if 'gate_w' not in k}
        s.load_state_dict(sd | {f'blocks.{l}.gate_logits': w[b].log() for l, w in enumerate(ctx.expert_weights)})
        with torch.no_grad(): hs_s = s.eval().encode(x[b:b + 1])
        for h, hsb in zip(hs, hs_s): assert torch.allclose(h[b][mask[b]], hsb[0][mask[b]], atol=1e-12)


@FAST
@given(variant=st.sampled_from(VARIANTS4), seed=seeds, L=st.integers(1, 4), E=st.integers(1, 3), data=st.data(),
       gate_scale=st.sampled_from([1., 30.]), B=st.integers(1, 3), n=st.integers(2, 12))
def test_input_gate_keeps_theorem2_on_pairs_of_one_sequence(variant, seed, L, E, data, gate_scale, B, n):
    alphas = data.draw(st.lists(st.floats(-50, 50), min_size=L, max_size=L), label='w')
    m = randomize_(make(variant, seed, double=True, n_layers=L, n_experts=E, gate='input'), seed, alphas=alphas).eval()
    with torch.no_grad():
        for blk in m.blocks: blk.gate_w.mul_(gate_scale)
    x = tokens(seed, B, n); x[0, :2] = torch.tensor([1, 1])
    with torch.no_grad(): lo, hi = token_distance_ratios(m.encode(x), x != 0)
    blo, bhi = layer_bounds(m.alphas(), L)
    assert (lo >= blo * (1 - 1e-9)).all() and (hi <= bhi * (1 + 1e-9)).all()


def test_input_gate_breaks_the_bound_between_sequences():
    "With random Σ, one-token sequences: the static model is one map and stays within Theorem 2's bounds; a steep input gate leaves both."
    found = {}
    for gate, scale in (('static', 1.), ('input', 20.)):
        m = randomize_(make('random-transject', 0, double=True, d_model=16, n_layers=3, n_experts=3, gate=gate), 0).eval()
        with torch.no_grad():
            for i, blk in enumerate(m.blocks):
                blk.alpha_raw.fill_(50. if i % 2 == 0 else -50.)          # |α| = 1: the widest bounds
                if gate == 'input': blk.gate_w.mul_(scale)
        sig = T.random_sigma(m.sigma_param, m.cfg.sigma_eps)
        def f(t):                                                          # (N, d): N one-token sequences
            h, ctx = t[:, None], BatchContext(sigma=sig.expand(len(t), -1))
            for blk in m.blocks: h = blk(h, None, ctx)
            return h[:, 0]
        t0 = m.embed(tokens(0, 4, 8, vocab_sz=40), None).detach().reshape(-1, 16)[:24]
        found[gate] = (worst_ratio(f, t0, minimize=True, steps=100)[0], worst_ratio(f, t0, steps=100)[0])
        blo, bhi = layer_bounds(m.alphas(), 3)
        lo_b, hi_b = blo[-1].item(), bhi[-1].item()
    assert found['static'][0] >= lo_b * (1 - 1e-9) and found['static'][1] <= hi_b * (1 + 1e-9)
    assert found['input'][1] > hi_b and found['input'][0] < lo_b, (found, lo_b, hi_b)


def test_input_gate_without_mixing_is_bag_of_tokens_only_for_static():
    "random Σ + static gate: no token reaches another before pooling; the input gate mixes through its max over the tokens."
    x = tokens(0, 1, 8); x[0] = torch.randint(1, 40, (8,), generator=torch.Generator().manual_seed(0))
    x2 = x.clone(); x2[0, 3] = (x[0, 3] % 39) + 1
    keep = torch.arange(8) != 3
    for gate, mixes in (('static', False), ('input', True)):
        m = randomize_(make('random-transject', 0, gate=gate), 0).eval()
        with torch.no_grad(): h, h2 = m.encode(x)[-1], m.encode(x2)[-1]
        assert torch.equal(h[0, keep], h2[0, keep]) != mixes


def test_expert_weight_records_for_both_gates():
    "`analysis_figures.expert_weights` and `figures.expert_weight_data`: static λ as before (no spread); the input gate's mean over the inputs, with its spread."
    from transject_nb.lab.analysis_figures import expert_weights
    from transject_nb.lab.figures import expert_weight_data
    x = tokens(5, 6, 9); x[:, 0] = torch.arange(1, 7)
    s = randomize_(make('transject', 5, n_experts=3), 5).eval()
    i = randomize_(make('transject', 5, n_experts=3, gate='input'), 5).eval()
    ws, wi = expert_weights(s, x, bs=4, progress=False), expert_weights(i, x, bs=4, progress=False)
    cols = ['expert 1', 'expert 2', 'expert 3']
    for l, blk in enumerate(s.blocks):
        assert torch.allclose(torch.tensor(ws.loc[l + 1, cols].values.astype(float)), torch.softmax(blk.gate_logits.detach().double(), 0), atol=1e-6)
    assert (ws.spread < 1e-12).all()
    with torch.no_grad(): lam = torch.stack([w.double() for w in i.trace(x).ctx.expert_weights])   # (L, B, E)
    assert torch.allclose(torch.tensor(wi[cols].values.astype(float)), lam.mean(1), atol=1e-6)        # the mean over the inputs
    assert torch.allclose(torch.tensor(wi.spread.values.astype(float)), lam.std(1, unbiased=False).mean(-1), atol=1e-6)
    assert (wi.spread > 1e-6).all() and torch.allclose(torch.tensor(wi[cols].values.astype(float)).sum(-1), torch.ones(2, dtype=torch.float64))
    df = expert_weight_data({'static': s, 'input': i}, x)
    assert list(df.variant.unique()) == ['static', 'input'] and len(df) == 4


def test_gate_is_a_run_override(tmp_path):
    "`get_learner(task, 'transject', gate='input')` and the CLI's `--gate input` reach the model without special code."
    from transject_nb.training.cli_parsers import parse_overrides
    from transject_nb.training.config import resolve_config, valid_fields
    from transject_nb.training.learner import get_learner
    from transject_nb.training.tasks import load_task
    assert 'gate' in valid_fields('transject')['model']
    assert parse_overrides(['--gate', 'input'], ['transject']) == {'gate': 'input'}
    assert parse_overrides(['--gate=static'], ['random-transject']) == {'gate': 'static'}
    assert resolve_config('listops', 'transject', preset='cpu', gate='input')['model']['gate'] == 'input'
    data = load_task('listops', max_len=32, n_train=32, n_valid=16, n_test=16, cache_dir=False, progress=False,
                     min_length=4, max_length=32, max_depth=2, max_args=3)
    learn = get_learner('listops', 'transject', preset='cpu', data=data, path=tmp_path/'run', device='cpu', d_model=16, n_layers=1, max_len=32, gate='input')
    assert learn.model.cfg.gate == 'input' and hasattr(learn.model.blocks[0], 'gate_w')
    xb, yb = learn.dls.one_batch()
    with torch.no_grad(): assert learn.model(xb).shape == (len(yb), 10)
    with pytest.raises(ValueError, match='unknown gate'):
        get_learner('listops', 'transject', preset='cpu', data=data, path=tmp_path/'bad', device='cpu', gate='moe')
