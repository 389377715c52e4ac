"""The sweep machinery at tiny sizes: cells, the records' shapes, divergence detection, and the resume of finished and interrupted runs."""
import json, math
import pandas as pd
import pytest
import torch
from transject_nb.lab.sweeps import grid_cells, cell_key, depth_measures, diverged, run_cell, run_grid, init_sweep, GRID_SCALARS
from transject_nb.lab.sweep_tables import depth_answer, grid_summary, best_cells
from transject_nb.models import create_model

TINY = dict(n_train=96, n_valid=32, n_test=32, max_len=32, min_length=4, max_length=32, max_depth=3, max_args=4, d_model=16, epochs=1, cache_dir=False)


def test_cells_and_keys():
    cells = grid_cells({'n_layers': [1, 2, 4], 'lr': [1e-3]})
    assert [c['n_layers'] for c in cells] == [1, 2, 4] and all(c['lr'] == 1e-3 for c in cells)
    assert cell_key(cells[0]) == 'n_layers=1,lr=0.001'
    with pytest.raises(ValueError, match='empty'): grid_cells({'n_layers': []})

@pytest.mark.parametrize('variant', ['transject', 'transformer', 'neutreno'])
def test_depth_measures_shapes(variant):
    torch.manual_seed(0)
    m = create_model(variant, 50, 3, d_model=16, n_layers=3, max_len=12)
    x, y = torch.randint(1, 50, (4, 12)), torch.tensor([0, 1, 2, 0])
    r = depth_measures(m.train(), x, y)
    assert len(r['cosine_layers']) == len(r['share_layers']) == 4
    assert r['cosine'] == r['cosine_layers'][-1] and 0 <= r['share'] <= 1 and r['grad_norm_first'] >= 0
    assert m.training and all(p.grad is None for p in m.parameters())     # mode kept, gradients cleared


def test_divergence_detection():
    h = lambda tl, vl: pd.DataFrame(dict(train_loss=tl, valid_loss=vl))
    assert not diverged(h([2.0, 1.0], [1.5, 1.2]), 1.6)
    assert diverged(h([2.0, math.inf], [1.5, 1.2]), 1.6)
    assert diverged(h([2.0, 1.0], [float('nan'), float('nan')]), 1.6)
    assert diverged(h([2.0, 1.0], [1.7, 1.6]), 1.6)                        # never below the initial validation loss


def test_a_run_with_a_huge_learning_rate_is_flagged(tmp_path):
    rec = run_cell('listops', 'transformer', {'lr': 1e3}, 1, tmp_path/'r', preset='cpu', **TINY | dict(epochs=2, grad_clip=0.0))
    assert rec['diverged'], rec['history']


def test_grid_records_and_resume(tmp_path):
    args = ('listops', {'n_layers': [1, 2]})
    kw = dict(variants=['random-transject', 'transformer'], seeds=(1,), out=tmp_path, preset='cpu', progress=False, **TINY)
    df = run_grid(*args, **kw)
    assert list(df.columns) == [*GRID_SCALARS[:4], 'n_layers', *GRID_SCALARS[4:]] and len(df) == 4
    assert len(json.loads((tmp_path/'grid.json').read_text())) == 4
    # an interrupted run (checkpoint and init.json, no record) continues; finished ones are read back untouched
    run = tmp_path/'transformer'/'n_layers=2'/'seed1'
    init = (run/'init.json').read_text()
    (run/'record.json').unlink()
    kept = (tmp_path/'transformer'/'n_layers=1'/'seed1'/'record.json').stat().st_mtime_ns
    again = run_grid(*args, **kw)
    assert (run/'record.json').exists() and (run/'init.json').read_text() == init
    assert (tmp_path/'transformer'/'n_layers=1'/'seed1'/'record.json').stat().st_mtime_ns == kept
    pd.testing.assert_series_equal(again['test_acc'], df['test_acc'])
    s = grid_summary(again)
    assert s['seeds'].tolist() == [1] * 4 and list(best_cells(again, 'n_layers').index) == ['random-transject', 'transformer']


def test_init_sweep_identity_at_init():
    torch.manual_seed(0)
    x, y = torch.randint(1, 50, (3, 10)), torch.tensor([0, 1, 0])
    df = init_sweep(x, y, 50, 2, depths=(1, 8), variants=['transject', 'transformer'], d_model=16, max_len=10)
    tj = df[df.variant == 'transject'].share.tolist()
    assert abs(tj[0] - tj[1]) < 1e-6                                      # TransJect's layers are the identity at initialisation
    with pytest.raises(ValueError, match="unknown variant"): init_sweep(x, y, 50, 2, variants=['nope'])


def test_axis_cells_share_the_centre_and_carry_every_field():
    from transject_nb.lab.sweeps import axis_cells
    cells = axis_cells({'d_model': 64, 'n_train': 200}, {'d_model': [32, 64], 'n_train': [100, 200, 400]})
    assert cells[0] == {'d_model': 64, 'n_train': 200} and len(cells) == 4      # the centre once, then 32, then 100 and 400
    assert all(set(c) == {'d_model', 'n_train'} for c in cells)
    with pytest.raises(ValueError, match='repeated cells'): grid_cells([{'a': 1}, {'a': 1}])


def test_tuning_chooses_on_validation_and_later_seeds_follow(tmp_path, monkeypatch):
    "The choice uses validation accuracy only (not test), skips diverged runs, and seed 2 reuses it; a resume trains nothing."
    import transject_nb.lab.sweeps as S
    fake = {1e-3: dict(valid_acc=0.6, test_acc=0.9, diverged=False), 1e-2: dict(valid_acc=0.7, test_acc=0.1, diverged=False),
            1e-1: dict(valid_acc=0.9, test_acc=0.9, diverged=True)}
    calls = []
    def run_cell(task, v, cell, seed, path, **kw):
        calls.append((cell['lr'], seed)); path.mkdir(parents=True)
        rec = dict(task=task, variant=v, seed=seed, **cell, **fake[cell['lr']], wall_secs=0.0)
        (path/'record.json').write_text(json.dumps(rec)); return rec
    monkeypatch.setattr(S, 'run_cell', run_cell)
    df = run_grid('listops', {'n_layers': [1]}, ['transformer'], seeds=(1, 2), out=tmp_path, tune={'lr': [1e-3, 1e-2, 1e-1]}, progress=False)
    assert calls == [(1e-3, 1), (1e-2, 1), (1e-1, 1), (1e-2, 2)]
    assert df[df.chosen].lr.tolist() == [1e-2, 1e-2]
    assert grid_summary(df)['seeds'].tolist() == [2]
    calls.clear()
    again = run_grid('listops', {'n_layers': [1]}, ['transformer'], seeds=(1, 2), out=tmp_path, tune={'lr': [1e-3, 1e-2, 1e-1]}, progress=False)
    assert calls == [] and again.equals(df)
    with pytest.raises(ValueError, match='both grid fields and tuned fields'):
        run_grid('listops', {'lr': [1e-3]}, ['transformer'], out=tmp_path/'x', tune={'lr': [1e-3]})


def test_export_and_load_grid(tmp_path):
    from transject_nb.lab.sweeps import export_grid, load_grid, LAYER_KEYS
    run_grid('listops', {'n_layers': [1]}, ['transformer'], seeds=(1,), out=tmp_path/'g', preset='cpu', progress=False, **TINY)
    t = export_grid(tmp_path/'g', tmp_path/'res')
    t2, recs = load_grid(tmp_path/'res')
    assert t2.shape == t.shape and len(recs) == 1 and all(len(recs[0][k]) == 2 for k in LAYER_KEYS)
    with pytest.raises(FileNotFoundError, match='run the sweep'): export_grid(tmp_path/'none', tmp_path/'res2')


def _fake_runs(monkeypatch, valid):
    "Replace `run_cell` by one that writes a record with the given validation accuracy per lr; returns the list of (lr, seed) trained."
    import transject_nb.lab.sweeps as S
    calls = []
    def run_cell(task, v, cell, seed, path, **kw):
        calls.append((cell['lr'], seed)); path.mkdir(parents=True)
        rec = dict(task=task, variant=v, seed=seed, **cell, valid_acc=valid[cell['lr']], test_acc=0.5, diverged=False, wall_secs=0.0)
        (path/'record.json').write_text(json.dumps(rec)); return rec
    monkeypatch.setattr(S, 'run_cell', run_cell)
    return calls


def test_run_grid_extends_the_grid_at_the_edge_the_choice_sits_at(monkeypatch, tmp_path):
    # validation accuracy rises with lr up to 3e-2: the grid {1e-3, 1e-2} is extended upward twice, then stops
    calls = _fake_runs(monkeypatch, {1e-4: 0.1, 1e-3: 0.6, 1e-2: 0.7, 3e-2: 0.8, 1e-1: 0.75, 3e-1: 0.9})
    kw = dict(seeds=(1, 2), tune={'lr': [1e-3, 1e-2]}, extend={'lr': [1e-4, 3e-2, 1e-1, 3e-1]}, progress=False)
    df = run_grid('listops', {'n_layers': [1]}, ['transformer'], out=tmp_path/'up', **kw)
    assert calls == [(1e-3, 1), (1e-2, 1), (3e-2, 1), (1e-1, 1), (3e-2, 2)]     # 3e-1 is never reached: 1e-1 did worse than 3e-2
    assert df[df.chosen].lr.tolist() == [3e-2, 3e-2]
    calls.clear()
    again = run_grid('listops', {'n_layers': [1]}, ['transformer'], out=tmp_path/'up', **kw)
    assert calls == [] and again.equals(df)                                      # resumed: every run, the extension's too, read back


def test_run_grid_extends_downward_once_when_every_rate_fails(monkeypatch, tmp_path):
    # a collapsed model: every rate gives the majority class; the tie goes to the smallest, so one step down is tried, and the tie keeps the grid's value
    calls = _fake_runs(monkeypatch, {1e-4: 0.5, 3e-4: 0.5, 1e-3: 0.5, 1e-2: 0.5})
    df = run_grid('listops', {'n_layers': [1]}, ['transformer'], seeds=(1,), out=tmp_path, tune={'lr': [1e-3, 1e-2]}, extend={'lr': [3e-4, 1e-4]}, progress=False)
    assert calls == [(1e-3, 1), (1e-2, 1), (3e-4, 1)]
    assert df[df.chosen].lr.tolist() == [1e-3]


def test_run_grid_extend_checks(tmp_path):
    grid = lambda **kw: run_grid('listops', {'n_layers': [1]}, ['transformer'], out=tmp_path, progress=False, **kw)
    with pytest.raises(ValueError, match='lie within the tuned values'): grid(tune={'lr': [1e-3, 1e-2]}, extend={'lr': [3e-3]})
    with pytest.raises(ValueError, match='must name the one tuned field'): grid(tune={'lr': [1e-3]}, extend={'wd': [0.1]})
    with pytest.raises(ValueError, match='must name the one tuned field'): grid(extend={'lr': [0.1]})
    with pytest.raises(ValueError, match='repeated extend values'): grid(tune={'lr': [1e-3]}, extend={'lr': [0.1, 0.1]})


def test_best_valid_skips_diverged_runs_unless_all_diverged():
    from transject_nb.lab.sweep_tables import best_valid
    df = pd.DataFrame(dict(variant=['a', 'a', 'a', 'b', 'b'], lr=[1e-3, 1e-2, 1e-1, 1e-3, 1e-2],
                           valid_acc=[0.6, 0.7, 0.9, 0.5, 0.55], test_acc=[0.6, 0.7, 0.2, 0.5, 0.5], diverged=[False, False, True, True, True]))
    b = best_valid(df)
    assert b.loc['a', 'lr'] == 1e-2          # 1e-1 scores best but diverged
    assert b.loc['b', 'lr'] == 1e-2          # every run of b diverged: the best of them
    assert list(b.index) == ['a', 'b']


def test_at_best_rate_puts_the_fixed_rate_beside_the_validation_choice():
    from transject_nb.lab.sweep_tables import at_best_rate
    df = pd.DataFrame(dict(variant=['a', 'a', 'a', 'b', 'b'], lr=[5e-4, 1e-2, 1e-1, 5e-4, 1e-2],
                           valid_acc=[0.6, 0.7, 0.9, 0.5, 0.55], test_acc=[0.61, 0.71, 0.2, 0.52, 0.5], diverged=[False, False, True, False, False]))
    t = at_best_rate(df, 5e-4)
    assert list(t.index) == ['a', 'b'] and list(t.columns) == ['test at fixed lr', 'best lr (valid)', 'test at best lr']
    assert t.loc['a'].tolist() == [0.61, 1e-2, 0.71]      # 1e-1 scores best on validation but diverged
    assert t.loc['b'].tolist() == [0.52, 1e-2, 0.5]       # the choice is made on validation, not test
    with pytest.raises(ValueError, match=r"no run at lr=0.003 for \['a', 'b'\]"): at_best_rate(df, 3e-3)
    with pytest.raises(ValueError, match="several runs share a"): at_best_rate(pd.concat([df, df]), 5e-4)


def test_run_grid_read_only_trains_nothing_and_chooses_only_when_complete(monkeypatch, tmp_path):
    calls = _fake_runs(monkeypatch, {1e-3: 0.6, 1e-2: 0.7, 3e-2: 0.8, 1e-1: 0.75})
    kw = dict(seeds=(1, 2), tune={'lr': [1e-3, 1e-2]}, extend={'lr': [3e-2, 1e-1]}, progress=False)
    run_grid('listops', {'n_layers': [1]}, ['transformer'], out=tmp_path, **kw)
    full = run_grid('listops', {'n_layers': [1, 2]}, ['transformer'], out=tmp_path, train=False, **kw)   # L=2 not started: nothing trained, nothing chosen
    assert len(calls) == 5 and set(full.n_layers) == {1} and full.chosen.sum() == 2
    (tmp_path/'transformer'/'n_layers=1,lr=0.1'/'seed1'/'record.json').unlink()                          # a step beyond the grid not finished yet
    part = run_grid('listops', {'n_layers': [1]}, ['transformer'], out=tmp_path, train=False, **kw)
    assert len(calls) == 5 and len(part) == 3 and not part.chosen.any()                                   # the choice waits for it
    assert len(json.loads((tmp_path/'grid.json').read_text())) == 3                                       # and the unfinished unit is written too


def test_versus_pools_the_seed_spread_and_marks_where_a_variant_is_ahead():
    from transject_nb.lab.sweep_tables import versus
    df = pd.DataFrame(dict(variant=['transformer'] * 4 + ['neutreno'] * 4, n_layers=[1, 1, 8, 8] * 2, seed=[1, 2] * 4, cell='', chosen=True, diverged=False,
                           test_acc=[0.75, 0.75, 0.50, 0.52, 0.70, 0.72, 0.70, 0.70]))
    gain, sure = versus(df, 'transformer', 'n_layers')
    assert list(gain.index) == ['neutreno'] and gain.loc['neutreno', 8] == pytest.approx(19.0)
    assert sure.loc['neutreno'].tolist() == [True, True]
    assert gain.loc['neutreno', 1] == pytest.approx(-4.0)                     # behind at L=1, ahead at L=8, both sure


def test_versus_table_tests_with_pooled_variances():
    from transject_nb.lab.sweep_tables import versus, versus_table
    from transject_nb.lab.stats import welch_from_var
    df = pd.DataFrame(dict(variant=['transformer'] * 4 + ['transject'] * 4, n_layers=[1, 1, 2, 2] * 2, seed=[1, 2] * 4, cell='', chosen=True, diverged=False,
                           test_acc=[0.70, 0.72, 0.60, 0.62, 0.71, 0.71, 0.63, 0.65]))
    t = versus_table(df, 'transformer', 'n_layers').set_index('n_layers')
    assert list(t.columns) == ['variant', 'gain', 'lo', 'hi', 'se', 'df', 'p', 'verdict', 'sure', 'seeds', 'seeds_ref']
    ref = welch_from_var(0.03, 1e-4, 2, 2e-4, 2, df_a=2, df_b=2)          # pooled: transject 1e-4 on 2 df, transformer 2e-4 on 2 df
    assert t.loc[2, 'p'] == pytest.approx(ref['p']) and t.loc[2, 'df'] == pytest.approx(3.6) and t.loc[2, 'se'] == pytest.approx(100 * ref['se'])
    assert t.loc[2, 'gain'] > 2 * t.loc[2, 'se'] and t.loc[2, 'verdict'] == 'not shown'                # beyond two SEs, not significant
    assert t.loc[2, 'lo'] < 0 < t.loc[2, 'hi'] and t.loc[2, 'hi'] - t.loc[2, 'gain'] == pytest.approx(100 * (ref['hi'] - ref['diff']))
    gain, sure = versus(df.assign(test_acc=[0.70, 0.72, 0.60, 0.62, 0.71, 0.71, 0.70, 0.72]), 'transformer', 'n_layers')
    assert sure.loc['transject'].tolist() == [False, True] and sure.dtypes.eq(bool).all()
    one = versus(df[df.seed == 1], 'transformer', 'n_layers')[1]                                        # one seed everywhere: no spread, nothing sure
    assert not one.values.any()


def test_depth_answer_outcomes():
    acc = {'transject': [0.75, 0.76, 0.76, 0.75, 0.75, 0.74], 'transformer': [0.75, 0.75, 0.70, 0.71, 0.50, 0.50], 'neutreno': [0.76, 0.76, 0.72, 0.72, 0.65, 0.66]}
    df = pd.DataFrame([dict(variant=v, n_layers=L, seed=s, chosen=True, diverged=False, test_acc=a, valid_acc=a)
                       for v, accs in acc.items() for (L, s), a in zip([(1, 1), (1, 2), (4, 1), (4, 2), (16, 1), (16, 2)], accs)])
    ans = depth_answer(df, [1, 4, 16])
    assert ans.outcome.to_dict() == {'transject': 'within 3 points of its best', 'transformer': 'at chance',
                                     'neutreno': 'more than 3 points below its best'}
    assert ans.loc['transject', 'verdict'] == 'not shown' and ans.loc['neutreno', 'verdict'] == 'reproduced'
    assert depth_answer(df, [1, 4, 16, 32]).outcome.eq('incomplete').all()           # a planned depth with no run
    assert depth_answer(df, [1, 4, 16], keep_within=0.0).loc['transject', 'outcome'] == 'more than 3 points below its best'


def test_depth_answer_chooses_the_best_depth_on_validation():
    df = pd.DataFrame([dict(variant='transject', n_layers=L, seed=s, chosen=True, diverged=False, test_acc=t, valid_acc=v)
                       for (L, s), t, v in zip([(1, 1), (1, 2), (4, 1), (4, 2)], [0.80, 0.80, 0.70, 0.70], [0.60, 0.60, 0.70, 0.70])])
    a = depth_answer(df, [1, 4]).loc['transject']
    assert a['best_L'] == 4 and a['best_acc'] == pytest.approx(0.70)         # the test's best, L = 1, is never looked at


def test_depth_answer_reproduces_a_drop_only_when_the_test_rejects():
    from transject_nb.lab.stats import welch
    acc = [0.7565, 0.7635, 0.7515, 0.7585, 0.7455, 0.7525]                  # a 1.1-point drop, seeds 0.7 points apart
    df = pd.DataFrame([dict(variant='random-transject', n_layers=L, seed=s, chosen=True, diverged=False, test_acc=a, valid_acc=a)
                       for (L, s), a in zip([(1, 1), (1, 2), (4, 1), (4, 2), (16, 1), (16, 2)], acc)])
    a = depth_answer(df, [1, 4, 16]).loc['random-transject']
    assert a['drop'] > 2 * grid_summary(df, ['n_layers'])['std'].mean()     # the old rule: beyond twice the mean seed std, 'prefers shallow'
    assert a['verdict'] == 'not shown' and a['p'] == pytest.approx(welch(acc[:2], acc[4:])['p']) and a['lo'] < 0
    tight = df.assign(test_acc=[0.760, 0.761, 0.755, 0.756, 0.740, 0.741])                              # a 2-point drop, seeds 0.1 points apart
    tight = tight.assign(valid_acc=tight.test_acc)
    assert depth_answer(tight, [1, 4, 16]).loc['random-transject', 'verdict'] == 'reproduced'
    assert depth_answer(tight, [1, 4, 16], alpha=1e-6).loc['random-transject', 'verdict'] == 'not shown'
