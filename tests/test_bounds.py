"Property tests of `transject_nb.bounds`: spectral norms, Jacobian norms, residual and encoder bounds."
import math
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from transject_nb.bounds import (power_iteration, row_stochastic, local_lipschitz, pair_ratios, worst_ratio,
                                 residual_bounds, layer_bounds, transject_bounds, entropic_gain_bound, plot_bounds)

torch.set_num_threads(1)
FAST = settings(max_examples=15, deadline=None)
seeds = st.integers(0, 2**31 - 1)


def _rand(seed, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _orth(seed, d):
    return torch.linalg.qr(_rand(seed, d, d))[0]


@FAST
@given(seed=seeds, batch=st.lists(st.integers(1, 3), max_size=2), m=st.integers(1, 7), k=st.integers(1, 7))
def test_power_iteration_matches_matrix_norm(seed, batch, m, k):
    A = _rand(seed, *batch, m, k)
    ref = torch.linalg.matrix_norm(A, ord=2)
    est = power_iteration(A, iters=2000, tol=0)
    assert est.shape == ref.shape
    assert (est <= ref * (1 + 1e-10) + 1e-12).all()              # a Rayleigh quotient never overshoots
    assert torch.allclose(est, ref, rtol=1e-4, atol=1e-10)
    assert torch.allclose(power_iteration(A), ref, rtol=1e-2)     # defaults: close, and from below


def test_power_iteration_errors_and_dtypes():
    A = _rand(0, 4, 3)
    assert power_iteration(A.float()).dtype == torch.float32
    assert power_iteration(torch.zeros(2, 2)).item() == 0
    with pytest.raises(ValueError, match='must be a matrix'): power_iteration(torch.ones(3))
    with pytest.raises(TypeError, match='floating-point'): power_iteration(torch.ones(2, 2, dtype=torch.long))


def test_row_stochastic():
    S = _rand(1, 5, 5)
    P = row_stochastic(S.exp())
    assert torch.allclose(P, S.softmax(-1))
    assert math.isclose(torch.linalg.matrix_norm(P, ord=float('inf')).item(), 1, rel_tol=1e-12)
    assert torch.linalg.matrix_norm(torch.tensor([[1., 0.], [1., 0.]]), ord=2).item() == pytest.approx(math.sqrt(2))
    with pytest.raises(ValueError, match='non-negative'): row_stochastic(S)
    with pytest.raises(ValueError, match='positive sum'): row_stochastic(torch.zeros(2, 2))


@FAST
@given(seed=seeds, n=st.integers(1, 6), m=st.integers(1, 6), f32=st.booleans())
def test_local_lipschitz_of_linear_map_is_spectral_norm(seed, n, m, f32):
    W = _rand(seed, m, n, dtype=torch.float32 if f32 else torch.float64)
    x = _rand(seed + 1, 3, n, dtype=W.dtype)                      # a batch: Jacobian is I_3 (x) W, same norm
    est = local_lipschitz(lambda v: v @ W.T, x)
    ref = torch.linalg.matrix_norm(W.double(), ord=2).item()
    assert est == pytest.approx(ref, rel=1e-3 if f32 else 1e-8, abs=1e-6)


def test_local_lipschitz_matches_jacobian_and_no_grad():
    net = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)).double()
    x = _rand(2, 4, 3)
    J = torch.autograd.functional.jacobian(net, x).reshape(8, 12)
    ref = torch.linalg.matrix_norm(J, ord=2).item()
    assert local_lipschitz(net, x) == pytest.approx(ref, rel=1e-8)
    with torch.no_grad(): assert local_lipschitz(net, x) == pytest.approx(ref, rel=1e-8)
    assert all(p.grad is None for p in net.parameters())
    with pytest.raises(TypeError, match='callable'): local_lipschitz(3, x)


@FAST
@given(seed=seeds, d=st.integers(1, 5), a=st.floats(-0.95, 0.95), s=st.floats(0.1, 1.0), f32=st.booleans())
def test_residual_worst_ratio_within_residual_bounds(seed, d, a, s, f32):
    dt = torch.float32 if f32 else torch.float64
    W = _rand(seed, d, d)
    W = (s * W / torch.linalg.matrix_norm(W, ord=2)).to(dt)      # Lip(tanh(W . + b)) <= ||W|| = s
    b = _rand(seed + 1, d, dtype=dt)
    g = lambda x: x + a * torch.tanh(x @ W.T + b)
    lo, hi = residual_bounds(a, lip=s)
    x = 2 * _rand(seed + 2, 4, d, dtype=dt)
    slack = 1e-4 if f32 else 1e-9
    r_max, xm, ym = worst_ratio(g, x, steps=40)
    r_min, _, _ = worst_ratio(g, x, steps=40, minimize=True)
    assert lo * (1 - slack) <= r_min <= r_max <= hi * (1 + slack)
    assert xm.shape == x.shape and xm.dtype == dt
    assert pair_ratios(g, xm, ym).max().item() == pytest.approx(r_max, rel=10 * slack)


def test_worst_ratio_approaches_lipschitz_constant_from_below():
    W = _rand(3, 4, 4)
    s = torch.linalg.matrix_norm(W, ord=2).item()
    with torch.no_grad(): r, _, _ = worst_ratio(lambda x: torch.tanh(x @ W.T), _rand(4, 8, 4))
    assert 0.97 * s <= r <= s
    r_min, _, _ = worst_ratio(lambda x: x @ W.T, _rand(5, 4), minimize=True)
    assert r_min == pytest.approx(torch.linalg.svdvals(W)[-1].item(), rel=1e-2)


def test_worst_ratio_finds_collapse_and_rejects_bad_input():
    r, _, _ = worst_ratio(lambda x: x - 1.5 * F.elu(x), torch.tensor([[-1.], [0.5]], dtype=torch.float64), minimize=True)
    assert r < 1e-3                                               # |a| Lip(F) = 1.5 > 1: not injective
    x = _rand(0, 3, 2)
    with pytest.raises(ValueError, match='coincide'): worst_ratio(torch.tanh, x, x)
    with pytest.raises(ValueError, match='same leading shape'): worst_ratio(lambda v: v.sum(-1), x)
    with pytest.raises(ValueError, match='same shape'): worst_ratio(torch.tanh, x, x[:2])


def test_residual_bounds():
    assert residual_bounds(0.5) == (0.5, 1.5)
    assert residual_bounds(torch.tensor(-0.25), lip=2.0) == (0.5, 1.5)
    with pytest.raises(ValueError, match=r'\|a\|\*Lip\(F\) < 1'): residual_bounds(-1.0)
    with pytest.raises(ValueError): residual_bounds(0.5, lip=-1)


@FAST
@given(alphas=st.lists(st.floats(-1, 1), min_size=0, max_size=8), extra=st.integers(0, 3))
def test_layer_bounds_monotone_and_within_transject_bounds(alphas, extra):
    L = max(1, len(alphas)) + extra
    lo, hi = layer_bounds(alphas, L)
    assert lo.shape == hi.shape == (len(alphas) + 1,) and lo[0] == hi[0] == 1
    assert (lo.diff() <= 0).all() and (hi.diff() >= 0).all()
    assert (lo >= 0).all() and (lo <= hi).all()
    env_lo, env_hi = layer_bounds([1.0] * len(alphas), L)           # alpha-free envelope (1 -+ 1/L)^(2l)
    assert (lo >= env_lo - 1e-15).all() and (hi <= env_hi + 1e-15).all()
    if len(alphas) == L:
        tl, th = transject_bounds(L)
        assert lo[-1] >= tl - 1e-15 and hi[-1] <= th + 1e-12


def test_transject_bounds_limits():
    for L in range(1, 65):
        lo, hi = transject_bounds(L)
        assert hi <= math.e ** 2 and lo < math.exp(-2) and lo < 0.25
    assert transject_bounds(2) == (0.0625, 5.0625)
    assert transject_bounds(10 ** 6) == pytest.approx((math.exp(-2), math.exp(2)), rel=1e-4)
    with pytest.raises(ValueError): transject_bounds(0)
    with pytest.raises(ValueError): layer_bounds([0.5, 1.5])
    with pytest.raises(ValueError): layer_bounds([0.5, 0.5], L=1)


@FAST
@given(seed=seeds, d=st.integers(1, 16))
def test_entropic_expectation_is_plain_residual(seed, d):
    x, f = _rand(seed, d), _rand(seed + 1, d)
    cases = torch.stack([1.5 * x + f, 1.5 * x - f, 4 * f, x])     # each with probability 1/4
    assert torch.allclose(cases.mean(0), x + f, atol=1e-12)


def test_entropic_gain_bound():
    g = [entropic_gain_bound(L) / 1.5 ** L for L in range(1, 65)]
    assert all(a < b for a, b in zip(g, g[1:])) and g[-1] < math.exp(11 / 3)
    assert entropic_gain_bound(1) == 11.0  # (1.5 + 4)(1 + 1): a case per channel
    assert entropic_gain_bound(10 ** 5) == math.inf
    with pytest.raises(ValueError): entropic_gain_bound(0)


def test_plot_bounds():
    import matplotlib
    matplotlib.use('Agg')
    ax = plot_bounds(range(1, 6))
    assert ax.get_yscale() == 'log' and len(ax.lines) == 5


# --- the prose's formulas are the code's ----------------------------------------------------------------------------
# A formula tied to a bound function in a notebook's prose, written `$TEX$ (`name`)` or `` `name(L)` $=TEX$ ``, is
# translated to Python and evaluated at L = 1..12 against the function: the prose cannot drift from the code.
import json, re
from pathlib import Path
import sympy
from sympy.parsing.sympy_parser import parse_expr, standard_transformations, implicit_multiplication_application

BOUND_FNS = {'entropic_gain_bound': entropic_gain_bound, 'transject_bounds': transject_bounds}
_NAMES = '|'.join(BOUND_FNS)
_TIED = [re.compile(r'\$(?P<tex>[^$]+)\$\s*\(`(?P<name>' + _NAMES + r')(?:\(L\))?`\)'),       # $TEX$ (`name`)
         re.compile(r'`(?P<name>' + _NAMES + r')(?:\(L\))?`\s*\$=(?P<tex>[^$]+)\$')]          # `name(L)` $=TEX$


def _braced(s, i):
    "The content of the {...} group (or the single token) starting at s[i], and the index after it."
    if s[i] != '{': return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {'{': 1, '}': -1}.get(s[j], 0)
        if depth == 0: return s[i + 1:j], j + 1
    raise ValueError(f"unbalanced braces in {s!r}")


def tex_to_python(tex:str)->str:
    "The arithmetic of a TeX formula (\\frac, powers, \\bigl( brackets, [a, b] pairs) as a Python expression in L."
    s = re.sub(r'\\(?:[bB]igg?[lr]?|left|right)(?=[(\[)\]])|\\[,;! ]', '', tex).replace(' ', '')
    while '\\frac' in s:
        i = s.index('\\frac'); a, j = _braced(s, i + 5); b, k = _braced(s, j)
        s = s[:i] + f'(({a})/({b}))' + s[k:]
    s = re.sub(r'\^\{([^{}]*)\}', r'**(\1)', s)
    s = re.sub(r'\^(\w)', r'**\1', s)
    if '\\' in s: raise ValueError(f"cannot translate {tex!r}: {s!r}")
    return s.replace('[', '(').replace(']', ')')


def prose_formulas(nbs:Path=Path(__file__).resolve().parents[1]/'nbs')->list:
    "`(notebook, cell, name, tex)` for every formula tied to a bound function in the markdown of every notebook."
    rows = []
    for nb in sorted(nbs.glob('*.ipynb')):
        for i, c in enumerate(json.loads(nb.read_text())['cells']):
            if c['cell_type'] != 'markdown': continue
            src = ''.join(c['source'])
            rows += [(nb.name, i, m['name'], m['tex']) for pat in _TIED for m in pat.finditer(src)]
    return rows


def prose_mismatch(name:str, tex:str):
    "None if the formula equals `name`'s value for L = 1..12, else the first L where it does not."
    L = sympy.Symbol('L')
    expr = parse_expr(tex_to_python(tex), {'L': L}, transformations=standard_transformations + (implicit_multiplication_application,))
    for Lv in range(1, 13):
        want = BOUND_FNS[name](Lv)
        got = [float(e.subs(L, Lv)) for e in expr] if isinstance(want, tuple) else float(expr.subs(L, Lv))
        if not (got == pytest.approx(list(want), rel=1e-12) if isinstance(want, tuple) else got == pytest.approx(want, rel=1e-12)): return Lv
    return None


def test_tex_to_python():
    assert tex_to_python(r'\bigl((1.5+\frac4L)(1+\frac{1}{L})\bigr)^L') == '((1.5+((4)/(L)))(1+((1)/(L))))**L'
    assert tex_to_python(r'[(1-\frac1L)^{2L},(1+\frac1L)^{2L}]') == '((1-((1)/(L)))**(2L),(1+((1)/(L)))**(2L))'
    assert prose_mismatch('entropic_gain_bound', r'\bigl((1.5+\frac4L)(1+\frac1L)\bigr)^L') is None
    assert prose_mismatch('entropic_gain_bound', r'((1.5+\frac1L)(1+\frac1L))^L') == 1      # the stale formula is caught
    assert prose_mismatch('transject_bounds', r'[(1-\frac1L)^{2L},(1+\frac1L)^{2L}]') is None
    assert prose_mismatch('transject_bounds', r'[(1-\frac1L)^{L},(1+\frac1L)^{2L}]') == 2


def test_prose_formulas_are_the_code():
    rows = prose_formulas()
    assert {name for _, _, name, _ in rows} == set(BOUND_FNS), f"expected formulas tied to {sorted(BOUND_FNS)}, found {rows}"
    bad = [f"{nb} cell {i}: `{name}` written as ${tex}$, differs at L={Lv}" for nb, i, name, tex in rows if (Lv := prose_mismatch(name, tex))]
    assert not bad, '\n'.join(bad)


def test_docments_formulas_are_the_code():
    "The formula in each bound function's return docment (what `show_doc` renders) is the function's value."
    from fastcore.docments import docments
    for name, fn in BOUND_FNS.items():
        doc = docments(fn, full=True)['return']['docment']
        tex = re.search(r'\$=?([^$]+)\$', doc)                                   # the first $...$, a leading '=' dropped
        assert tex, f"{name}'s return docment has no $formula$: {doc!r}"
        assert prose_mismatch(name, tex.group(1)) is None, f"{name}'s docment formula ${tex.group(1)}$ is not its value"
