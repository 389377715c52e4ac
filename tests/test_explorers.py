"Tests of transject_nb.lab.explorers through the functions its widgets call."
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from transject_nb.lab.analysis import PAPER_SENTENCE, residual_weights
from transject_nb.lab.explorers import (KNOBS, default_tokenizer, explorer_model, flow_explorer, flow_trajectories, layer_profile,
                                    plot_flow_explorer, plot_flow_step, plot_profile, plot_variant_explorer, point_cloud,
                                    variant_explorer)
from transject_nb.gradflow import neutreno_fixed_point, spread

torch.set_num_threads(1)
TOK = default_tokenizer([PAPER_SENTENCE])
models = pytest.importorskip('transject_nb.models', reason='transject_nb.models is exported by the lead')


class FakeLearner:
    def __init__(self, model, tokenizer): self.model, self.dls, self.tokenizer = model, None, tokenizer


def test_knobs_come_from_the_variants_table():
    from transject_nb.core import variant_spec
    assert KNOBS == {v: variant_spec(v).knob for v in models.VARIANTS} and tuple(KNOBS) == models.VARIANTS
    assert (KNOBS['transject'], KNOBS['transformer'], KNOBS['transformer-rezero'], KNOBS['neutreno'], KNOBS['similarity-removal']) == \
           ('alpha', None, 'alpha', 'lam', 'tau')


@pytest.mark.parametrize('variant', list(KNOBS))
def test_profile_of_every_variant(variant):
    m = explorer_model(variant, TOK.vocab_sz, n_layers=3, knob=0.4, d_model=16)
    field = KNOBS[variant]
    if field == 'alpha': np.testing.assert_allclose(residual_weights(m), 0.4, atol=1e-6)
    elif field: assert getattr(m.cfg, field) == pytest.approx(0.4)
    p = layer_profile(m, PAPER_SENTENCE, TOK)
    assert p.shape == (4, 7) and list(p.index) == [0, 1, 2, 3]
    assert np.isfinite(p[['lo', 'hi', 'cosine', 'similarity', 'diversity']].values).all()
    np.testing.assert_allclose(p.loc[0, ['lo', 'hi']].astype(float), 1)
    assert p.bound_lo.notna().all() == ('transject' in variant)
    if 'transject' in variant: assert (p.lo >= p.bound_lo - 1e-6).all() and (p.hi <= p.bound_hi + 1e-6).all()
    assert not m.training


def test_knob_zero_makes_transject_the_identity():
    m = explorer_model('transject', TOK.vocab_sz, n_layers=4, knob=0.0, d_model=16)
    p = layer_profile(m, PAPER_SENTENCE, TOK)
    np.testing.assert_allclose(p[['lo', 'hi']].values, 1, atol=1e-6)
    np.testing.assert_allclose(p.cosine, p.cosine[0], atol=1e-6)


def test_explorer_figures_and_widgets():
    fig = plot_variant_explorer('neutreno', n_layers=2, knob=0.5, tokenizer=TOK)
    assert len(fig.axes) == 2
    loaded = {'mine': FakeLearner(explorer_model('transformer', TOK.vocab_sz, 2, d_model=16), TOK)}
    assert len(plot_variant_explorer('mine', models=loaded).axes) == 2
    with pytest.raises(ValueError, match='carries no tokenizer'):
        plot_variant_explorer('mine', models={'mine': explorer_model('transformer', TOK.vocab_sz, 2, d_model=16)})
    with pytest.raises(ValueError, match='valid variants are'): explorer_model('transjekt', 10)
    ex = variant_explorer(models=loaded)
    assert [c.description for c in ex.children[:5]] == ['variant', 'layers', 'α / λ / τ', 'seed', 'text']
    assert 'mine' in ex.children[0].options
    ex.children[1].value = 2                                                                # 2 layers: quick
    ex.update()                                                                            # what a click (or a slider move) runs
    assert ex.kwargs['n_layers'] == 2
    fe = flow_explorer(max_steps=10)
    assert fe.children[0].max == 10
    fe.update()
    assert len(plot_flow_explorer(step=3).axes) == 2
    plt.close('all')


def test_flow_known_answers():
    tr = flow_trajectories(n_points=12, steps=30, beta=0., lam=0.5, seed=1)
    u0 = tr['attention'][0]
    np.testing.assert_allclose(tr['attention'][1], np.broadcast_to(u0.mean(0), u0.shape), atol=1e-12)   # uniform attention: one step
    fid = tr['fidelity λ=0.5'][-1]
    P = torch.full((12, 12), 1 / 12, dtype=torch.float64)
    np.testing.assert_allclose(fid, neutreno_fixed_point(P, torch.as_tensor(u0), 0.5).numpy(), atol=1e-9)
    d = flow_trajectories()
    assert float(spread(torch.as_tensor(d['attention'][-1])).max()) < 1e-3
    assert float(spread(torch.as_tensor(d['fidelity λ=0.6'][-1])).max()) > 1.
    assert point_cloud(7).shape == (7, 2)
    with pytest.raises(ValueError, match='n_points >= 2'): flow_trajectories(n_points=1)
    assert len(plot_flow_step(d, step=0).axes) == 2
    plt.close('all')
