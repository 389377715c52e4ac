"""The depth plan (`lab.studies.DEPTH`) and its tiny copy on the protocol: arms that start from their own grid, the search
going past an edge, early stopping, the measures each seed run records, a resumed plan; its committed files."""
import json, warnings
from dataclasses import replace
from pathlib import Path
import pandas as pd
import pytest
warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated')
from transject_nb.models import VARIANTS
from transject_nb.lab.depth_measures import LAYER_KEYS, MEASURE_COLUMNS
from transject_nb.lab.protocol import Arm, Protocol, StudyPlan
from transject_nb.lab.protocol_store import open_storage
from transject_nb.lab.protocol_workers import work
from transject_nb.lab.protocol_results import arm_status, study_layers, study_trials
from transject_nb.lab.studies import DEPTH, DEPTHS, DEPTH_SEED_RATES, depth_arm
from transject_nb.lab.sweep_tables import study_grid

RESULTS = Path(__file__).parent.parent/'nbs'/'results'/'depth'
TINY = dict(n_train=300, n_valid=100, n_test=100, max_len=32, min_length=8, max_length=32, max_depth=3, max_args=4, d_model=16)


def tiny_depth(epochs=10):
    "The depth plan's shape at tiny sizes: post-norm at two depths, each from a grid whose best sits at its top edge."
    arms = tuple(Arm('transformer', dict(n_layers=L), lrs=(1e-3, 3e-3, 1e-2)) for L in (1, 2))
    return StudyPlan('tiny-depth', 'listops', arms, preset='cpu', fixed=TINY, measures=True,
                     protocol=Protocol(seeds=(1, 2), epochs=epochs, patience=1, prune_warmup=3))


def test_the_depth_plan_at_tiny_sizes_extends_stops_early_measures_and_resumes(tmp_path):
    plan, st = tiny_depth(), open_storage(tmp_path/'s.db')
    assert work(plan, st, out=tmp_path/'runs', cache_dir=False, poll=0.1, max_trials=4, progress=False) == 4
    half = study_trials(plan, st)
    assert set(arm_status(half, plan).state) != {'done'}                     # stopped part-way
    work(plan, st, out=tmp_path/'runs', cache_dir=False, poll=0.1, progress=False)   # the same call resumes
    t = study_trials(plan, st)
    assert len(t) > len(half) and (t.iloc[:len(half)].number.values == half.number.values).all()
    s = arm_status(t, plan)
    assert set(s.state) == {'done'}
    for a in plan.arms:                                                      # the edge rule: a choice at an edge of the
        tried = sorted(set(t[(t.arm == a.label) & (t.phase == 'search')].lr))  # rates tried has no rate left beyond it
        p, lr = plan.protocol_for(a), s.lr[a.label]
        assert not (lr == tried[-1] and p.above) or tried[-1] >= max(p.above)
        assert not (lr == tried[0] and p.below) or tried[0] <= min(p.below)
    searched = t[t.phase == 'search'].groupby('arm').lr.apply(set)
    assert any(x - set(a.lrs) for a, x in zip(plan.arms, searched[[a.label for a in plan.arms]]))   # past a grid's edge
    fin = t[t.state == 'COMPLETE']
    assert (fin.epochs < plan.protocol.epochs).mean() >= 0.5                 # early stopping, not the budget, ended most
    seeds = fin[fin.phase == 'seed']
    assert seeds[list(MEASURE_COLUMNS)].notna().all().all()                  # measured at initialisation and after training
    assert fin[fin.phase == 'search'][list(MEASURE_COLUMNS)].isna().all().all()
    layers = study_layers(plan, st)
    assert len(layers) == len(seeds) and all(len(r[k]) == r['n_layers'] + 1 for r in layers for k in LAYER_KEYS)
    g, recs = study_grid(t, plan, layers)
    assert len(g) == 4 and set(g.n_layers) == {1, 2} and len(recs) == 4


def test_a_plan_without_measures_records_none_and_an_lm_plan_may_not_measure(tmp_path):
    with pytest.raises(ValueError, match="measures are a classifier's"):
        StudyPlan('x', 'imdb', ('transformer',), objective='causal', measures=True,
                  protocol=Protocol(metric='perplexity'))
    with pytest.raises(ValueError, match="records no measures"):
        study_layers(replace(tiny_depth(), measures=False), open_storage(tmp_path/'s.db'))


def test_the_declared_depth_plan():
    assert {a.variant for a in DEPTH.arms} == set(VARIANTS) and len(DEPTH.arms) == len(VARIANTS) * len(DEPTHS)
    assert {a.overrides['n_layers'] for a in DEPTH.arms} == {2, 8, 16, 32}
    assert [a.overrides['n_layers'] for a in DEPTH.arms[:2]] == [2, 32]      # the ledger's two ends run first
    for a in DEPTH.arms:
        assert DEPTH_SEED_RATES[a.variant][a.overrides['n_layers']] in a.lrs and len(a.lrs) >= 2
    assert DEPTH.measures and DEPTH.protocol.seeds == (1, 2, 3)
    old = RESULTS/'grid.csv'
    if not old.is_file(): pytest.skip('no committed old grid')
    g = pd.read_csv(old)
    chosen = g[g.chosen & (g.seed == 1)].set_index(['variant', 'n_layers']).lr
    assert {(v, L): r for v, rs in DEPTH_SEED_RATES.items() for L, r in rs.items()} == {k: chosen[k] for k in chosen.index if k[1] in DEPTHS}
    assert depth_arm('transformer', 32).lrs == (3e-4, 1e-3, 3e-3)


def test_the_committed_depth_trials_are_the_committed_storage():
    if not (RESULTS/'studies.db').is_file(): pytest.skip('no committed depth plan yet')
    cols = ['arm', 'phase', 'lr', 'seed', 'state', 'epochs']
    key = lambda df: df[cols].sort_values(cols[:-1]).reset_index(drop=True)
    pd.testing.assert_frame_equal(key(study_trials(DEPTH, RESULTS/'studies.db')),
                                  key(pd.read_csv(RESULTS/'protocol'/'trials.csv')), check_dtype=False)
    layers = json.loads((RESULTS/'protocol'/'layers.json').read_text())
    assert len(layers) == len(study_layers(DEPTH, RESULTS/'studies.db'))


def test_a_run_that_diverges_from_its_first_epoch_finishes_and_its_worker_goes_on(tmp_path):
    "A rate so high that every validation loss is NaN: the run is scored, keeps no epoch, and does not kill its worker."
    arm = Arm('transformer', dict(n_layers=1), lrs=(1e8,))
    plan = StudyPlan('tiny-diverge', 'listops', (arm,), preset='cpu', fixed=TINY,
                     protocol=Protocol(seeds=(1,), epochs=4, patience=1, prune_warmup=3))
    st = open_storage(tmp_path/'s.db')
    assert work(plan, st, out=tmp_path/'runs', cache_dir=False, poll=0.1, max_trials=1, progress=False) == 1
    t = study_trials(plan, st)
    assert t.state.tolist() == ['COMPLETE'] and t.best_epoch.isna().all() and t.epochs.item() >= 1
