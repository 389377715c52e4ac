"""`transject_nb.lab.experiments`: baselines with known answers on tiny data, the results files' columns, tables built from run files, and a run loaded back."""
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from transject_nb.training.data import TokenSplit
from transject_nb.training.tasks import TaskData
from transject_nb.lab.experiments import (BASELINE_COLUMNS, PAPER_RESULTS, PAPER_SETUP, RESULT_COLUMNS, TRANSJECT_CLAIMS, check_orderings, collect_runs,
                                      format_table, linear_baselines, load_run, majority_class, missing_runs, paper_table, paused_runs, results_table,
                                      spread_claim, tfidf_logreg)
from transject_nb.lab.stats import welch

ROOT = Path(__file__).resolve().parent.parent
REPRO = ROOT/'nbs'/'results'/'repro'


def _task(train, valid, test, task='imdb', key='k'):
    "A hand-made TaskData from lists of (token ids, label)."
    mk = lambda xs: TokenSplit.from_lists([x for x, _ in xs], [y for _, y in xs])
    n = 1 + max(int(y) for _, y in train + valid + test)
    return TaskData(task, mk(train), mk(valid), mk(test), vocab_sz=1 + max(max(x) for x, _ in train + valid + test), n_classes=n,
                    classes=tuple(map(str, range(n))), tokenizer=None, max_len=8, source='hand-made', cache_key=key)


def _separable(labels):
    "Label 0 carries token 5, label 1 token 6, between fillers that do not depend on the label."
    return [([1 + i % 4, 5 + y, 1 + (i + 1) % 4], y) for i, y in enumerate(labels)]


def test_majority_of_an_imbalanced_set():
    d = _task(_separable([0] * 7 + [1] * 3), _separable([0, 1, 1]), _separable([0, 0, 0, 0, 1]))
    r = majority_class(d.train, d.valid, d.test)
    assert r['test_acc'] == pytest.approx(0.8) and r['valid_acc'] == pytest.approx(1 / 3)
    d1 = _task(_separable([1] * 6 + [0] * 4), _separable([0, 1, 1]), _separable([0, 0, 0, 0, 1]))     # the majority is class 1 now
    assert majority_class(d1.train, d1.valid, d1.test)['test_acc'] == pytest.approx(0.2)


def test_separable_tokens_give_100_percent():
    d = _task(_separable([0] * 7 + [1] * 3), _separable([0, 0, 1]), _separable([0, 0, 0, 0, 1]))
    b = linear_baselines(d, min_df=1)
    assert list(b.columns) == list(BASELINE_COLUMNS)
    assert b.set_index('model').test_acc.to_dict() == {'majority class': 0.8, 'tfidf-lr unigrams': 1.0, 'tfidf-lr uni+bigrams': 1.0}
    assert (b.data_key == 'k').all()
    assert tfidf_logreg(d.train, d.valid, d.test, Cs=(0.1,))['test_acc'] == pytest.approx(0.8)   # strong regularisation: the majority class


def test_bigrams_see_order_and_bytes_task_has_its_features():
    order = lambda labels: [([1, 2, 3] if y else [2, 1, 3], y) for y in labels]
    d = _task(order([0, 1] * 4), order([0, 1]), order([0, 1, 1, 0]), task='charimdb')
    assert linear_baselines(d, min_df=1).model.tolist() == ['majority class', 'tfidf-lr byte 1-4-grams']
    b = linear_baselines(d, min_df=1, features=[('uni', (1, 1)), ('bi', (1, 2))]).set_index('model').test_acc
    assert b['uni'] == 0.5 and b['bi'] == 1.0


def test_bad_input_is_named():
    d = _task(_separable([0] * 4), _separable([0, 1]), _separable([0, 1]))
    with pytest.raises(ValueError, match='single class'): tfidf_logreg(d.train, d.valid, d.test)
    with pytest.raises(TypeError, match='TaskData'): linear_baselines('imdb')


def _write_run(root, task, variant, seed, test_acc, valid_acc=0.5, key='key1'):
    d = root/task/variant/f'seed{seed}'
    d.mkdir(parents=True)
    res = dict(task=task, variant=variant, seed=seed, test_acc=test_acc, test_loss=0.7, valid_acc=valid_acc, valid_loss=0.7, majority=0.5,
               params=1000, epochs=3, best_epoch=2, train_secs=10.0)
    cfg = dict(task=task, variant=variant, preset=f'{task}-repro', model={}, train={}, data={}, data_key=key)
    (d/'results.json').write_text(json.dumps(dict(results=res, config=cfg, presets=[], history={})))


@pytest.fixture
def runs_tree(tmp_path):
    for s, (a, b) in enumerate([(0.80, 0.70), (0.82, 0.74), (0.84, 0.72)], 1):
        _write_run(tmp_path, 'imdb', 'transject', s, a)
        _write_run(tmp_path, 'imdb', 'transformer', s, b)
    _write_run(tmp_path, 'agnews', 'neutreno', 1, 0.6, key='key2')
    (tmp_path/'imdb'/'transformer'/'seed4').mkdir()                        # a run still training: no results.json yet
    (tmp_path/'imdb'/'results.json').write_text(json.dumps(dict(task='imdb', results=[])))   # a compare summary: not a run
    return tmp_path


def test_results_files_have_result_columns(runs_tree, tmp_path):
    df = collect_runs(runs_tree)
    assert list(df.columns) == list(RESULT_COLUMNS)
    assert df[['task', 'variant', 'seed']].values.tolist()[:2] == [['imdb', 'transject', 1], ['imdb', 'transject', 2]]   # tasks and variants in package order
    assert len(df) == 7
    df.to_csv(tmp_path/'runs.csv', index=False)
    assert list(pd.read_csv(tmp_path/'runs.csv').columns) == list(RESULT_COLUMNS)


def test_committed_results_files_have_their_columns():
    "The files the experiments notebook renders its tables from."
    runs, base = pd.read_csv(REPRO/'runs.csv'), pd.read_csv(REPRO/'baselines.csv')
    assert list(runs.columns) == list(RESULT_COLUMNS) and len(runs)
    assert list(base.columns) == list(BASELINE_COLUMNS) and len(base)
    assert runs.groupby('task').data_key.nunique().max() == 1
    results_table(runs, base)      # runs and baselines of a task share their splits


def test_committed_gpu_run_is_compares_output_and_agrees_with_its_history():
    "The paper-size IMDb run on a GPU that the TransJect page and the README render: compare's results.csv, its history, its settings."
    gpu = ROOT/'nbs'/'results'/'imdb_paper_h100'
    res, hist, run = pd.read_csv(gpu/'results.csv'), pd.read_csv(gpu/'history.csv'), json.loads((gpu/'run.json').read_text())
    assert [c for c in RESULT_COLUMNS if c not in res] == ['data_key', 'preset'] and 'device' in res
    assert {'variant', 'epoch', 'train_loss', 'valid_loss', 'accuracy'} <= set(hist.columns)
    assert set(res.variant) <= set(hist.variant) and (res.epochs == run['train']['epochs']).all()
    kept = hist.set_index(['variant', 'epoch']).loc[list(zip(res.variant, res.best_epoch))]
    assert np.allclose(kept.accuracy.values, res.valid_acc.values, atol=1e-7)            # the recorded validation accuracy is the kept epoch's
    assert np.allclose(kept.valid_loss.values, res.valid_loss.values, atol=1e-7)
    assert (kept.valid_loss.values == [hist[hist.variant == v].valid_loss.min() for v in res.variant]).all()   # kept: the lowest validation loss


def test_results_table_from_files(runs_tree):
    runs = collect_runs(runs_tree)
    base = pd.DataFrame([dict(task='imdb', model='majority class', valid_acc=0.5, test_acc=0.5, secs=0.0, C=np.nan, data_key='key1')])
    t = results_table(runs, base)
    row = t.loc[('imdb', 'transject')]
    assert row.n == 3 and row.test_acc == pytest.approx(0.82) and row.test_std == pytest.approx(0.02)
    assert t.loc[('imdb', 'transformer'), 'test_acc'] == pytest.approx(0.72)
    assert t.loc[('imdb', 'majority class'), 'kind'] == 'baseline' and np.isnan(t.loc[('imdb', 'majority class'), 'test_std'])
    assert t.index.tolist() == [('imdb', 'transject'), ('imdb', 'transformer'), ('imdb', 'majority class'), ('agnews', 'neutreno')]
    assert t.loc[('imdb', 'transject'), 'paper'] == pytest.approx(0.881) and t.loc[('imdb', 'transformer'), 'paper'] == pytest.approx(0.813)   # Table 2
    assert t.paper[[('imdb', 'majority class'), ('agnews', 'neutreno')]].isna().all()                                   # not in the paper's tables
    wide = format_table(t)
    assert wide.loc['transject', 'imdb'] == '82.0 ± 2.0' and wide.loc['neutreno', 'agnews'] == '60.0 (n=1)'
    o = check_orderings(t).set_index(['task', 'better', 'worse'])
    r = o.loc[('imdb', 'transject', 'transformer')]
    assert r.verdict == 'reproduced' and (r.n_better, r.n_worse) == (3, 3)
    assert r.p == pytest.approx(welch([0.80, 0.82, 0.84], [0.70, 0.74, 0.72])['p']) and r.df == pytest.approx(4.0)   # Welch on the runs' own values
    miss = missing_runs(runs, tasks=('imdb',), variants=('transject', 'transformer'), seeds=(1, 2, 3, 4))
    assert miss.values.tolist() == [['imdb', 'transject', 4], ['imdb', 'transformer', 4]]


def test_results_table_refuses_mixed_splits(runs_tree):
    _write_run(runs_tree, 'imdb', 'neutreno', 1, 0.8, key='other')
    with pytest.raises(ValueError, match='different splits'): results_table(collect_runs(runs_tree))
    runs = collect_runs(runs_tree)
    runs = runs[runs.variant != 'neutreno']
    base = pd.DataFrame([dict(task='imdb', model='majority class', valid_acc=0.5, test_acc=0.5, secs=0.0, C=np.nan, data_key='nope')])
    with pytest.raises(ValueError, match='other splits'): results_table(runs, base)
    with pytest.raises(ValueError, match='lacks the columns'): results_table(runs.drop(columns='data_key'))


def test_load_run_gives_back_the_trained_model(tmp_path):
    from transject_nb.training.cli import run_one
    tiny = dict(n_train=64, n_valid=32, n_test=32, max_len=16, min_length=4, max_length=16, max_depth=2, max_args=3, d_model=16, n_layers=1, epochs=1)
    learn, res = run_one('listops', 'transject', tmp_path/'run', preset='cpu', cache_dir=False, progress=False, export=False, seed=3, **tiny)
    back = load_run(tmp_path/'run', cache_dir=False)
    assert back.results == json.loads((tmp_path/'run'/'results.json').read_text())['results']
    x = learn.dls.test.one_batch()[0].cpu()
    assert (back.predict_proba(x) - learn.predict_proba(x)).abs().max() < 1e-6
    assert len(back.recorder.values) == res['epochs']
    with pytest.raises(FileNotFoundError, match='no results.json'): load_run(tmp_path)


def test_paused_runs_names_the_slow_and_nets_their_excess():
    df = pd.DataFrame(dict(task='imdb', variant=['transject'] * 3 + ['transformer'] * 3, train_secs=[100, 110, 500, 200, 210, 190]))
    slow, total = paused_runs(df, ['task', 'variant'])
    assert slow.index.tolist() == [2] and total == pytest.approx(df.train_secs.sum() - 390)
    with pytest.raises(ValueError, match='wall_secs'): paused_runs(df, ['task'], 'wall_secs')


def _fake(accs, stds, ns, keys):
    return pd.DataFrame(dict(kind='neural', n=ns, test_acc=accs, test_std=stds), index=pd.MultiIndex.from_tuples(keys))


def test_check_orderings_uses_welch_not_two_standard_errors():
    keys = [('imdb', 'transject'), ('imdb', 'transformer'), ('imdb', 'transformer-rezero')]
    t = _fake([0.80, 0.76, 0.70], [0.02, 0.02, np.nan], [3, 3, 1], keys)
    o = check_orderings(t)
    assert list(o.columns) == ['task', 'better', 'worse', 'better_acc', 'worse_acc', 'n_better', 'n_worse', 'diff', 'lo', 'hi', 'se', 'df', 'p', 'verdict', 'claim']
    first = o.iloc[0]
    assert first.lo < 0 < first.hi                                                                   # its interval holds 0
    assert first['diff'] > 2 * first.se and first.verdict == 'not shown' and first.p == pytest.approx(0.0705, abs=1e-4)   # 2 SE said holds
    assert o.verdict.tolist() == ['not shown', 'not tested']
    assert check_orderings(t.assign(test_std=[0.01, 0.01, np.nan])).verdict.tolist() == ['reproduced', 'not tested']
    assert check_orderings(t.assign(test_acc=[0.70, 0.80, 0.7], test_std=[0.01, 0.01, np.nan])).verdict.tolist() == ['contradicted', 'not tested']


def test_check_orderings_restricts_a_claim_to_its_tasks():
    keys = [(task, v) for task in ('imdb', 'agnews') for v in ('transject', 'random-transject')]
    t = _fake([0.80, 0.70, 0.70, 0.80], 0.01, 3, keys)
    claims = [('random-transject', 'transject', 'random beats approximated on AG News', ('agnews',))]
    o = check_orderings(t, claims)
    assert o.task.tolist() == ['agnews'] and o.verdict.tolist() == ['reproduced']
    assert check_orderings(t, [c[:3] for c in claims]).verdict.tolist() == ['contradicted', 'reproduced']     # a triple: every task
    with pytest.raises(ValueError, match="tasks must be a tuple of task names"): check_orderings(t, [('a', 'b', 'c', 'agnews')])
    with pytest.raises(ValueError, match='a claim is'): check_orderings(t, [('a', 'b')])


PAPER_TABLES = {   # Tables 2 (IMDb, AG News) and 3 (ListOps, Char-IMDb) of the TransJect paper, in %: mean and the printed s.d. (TransJect rows)
    'transformer':               ((81.3, None), (88.8, None), (36.4, None), (64.3, None)),
    'transformer-rezero':        ((83.4, None), (89.6, None), (38.9, None), (65.6, None)),
    'transject':                 ((88.1, 0.01), (88.8, 0.00), (48.3, 0.00), (68.8, 0.01)),
    'entropic-transject':        ((87.5, 0.00), (89.1, 0.00), (40.7, 0.02), (64.7, 0.03)),
    'random-transject':          ((86.5, 0.00), (90.2, 0.00), (43.9, 0.00), (68.8, 0.03)),
    'random-entropic-transject': ((86.5, 0.02), (90.8, 0.00), (39.5, 0.01), (65.6, 0.01)),
}


def test_paper_results_hold_the_papers_numbers():
    tasks = ('imdb', 'agnews', 'listops', 'charimdb')
    acc, std = PAPER_RESULTS['test_acc'], PAPER_RESULTS['test_std']
    assert PAPER_RESULTS['found'] and set(acc) == {(t, v) for v in PAPER_TABLES for t in tasks}
    for v, cells in PAPER_TABLES.items():
        for t, (a, s) in zip(tasks, cells):
            assert acc[(t, v)] == pytest.approx(a / 100, abs=1e-9), (t, v)
            assert (std.get((t, v)) is None) if s is None else std[(t, v)] == pytest.approx(s), (t, v)
    assert PAPER_RESULTS['tables'] == dict(imdb='Table 2', agnews='Table 2', listops='Table 3', charimdb='Table 3')
    assert PAPER_RESULTS['cited'] == {'transformer': 'Dutta et al. (2021)'} and PAPER_RESULTS['n_seeds'] == 3
    assert {k: PAPER_SETUP[k] for k in ('epochs', 'patience', 'early_stopping_on', 'lr', 'beta1', 'beta2', 'eps', 'd_model', 'n_layers', 'n_experts', 'bs')} == dict(
        epochs=30, patience=4, early_stopping_on='test loss', lr=5e-4, beta1=0.9, beta2=0.98, eps=1e-9, d_model=512, n_layers=6, n_experts=4, bs=32)


def test_paper_table_and_the_papers_own_claims():
    pt = paper_table()
    assert pt.loc[('listops', 'transject')].tolist() == ['paper', 3, 0.483, 0.0]
    assert pt.loc[('listops', 'transformer'), 'n'] == 1 and np.isnan(pt.loc[('listops', 'transformer'), 'test_std'])
    assert paper_table(std_scale=0.01).loc[('imdb', 'random-entropic-transject'), 'test_std'] == pytest.approx(2e-4)
    with pytest.raises(ValueError, match='std_scale'): paper_table(std_scale=-1)
    o = check_orderings(pt, TRANSJECT_CLAIMS)
    assert o[o['diff'] <= 0][['task', 'better', 'worse']].values.tolist() == [['agnews', 'transject', 'transformer-rezero']]   # the paper's own exception
    assert set(o[o.task == 'agnews'].task) == {'agnews'} and len(o[o.task == 'agnews']) == 5     # the four AG News orderings and ReZero's
    assert set(o[o.task.isin(['listops', 'charimdb']) & (o.worse != 'transformer-rezero')].worse) == {'entropic-transject', 'random-entropic-transject'}


def test_spread_claim_on_synthetic_tables():
    vs = ('transject', 'entropic-transject', 'random-transject', 'random-entropic-transject')
    keys = [(t, v) for t in ('imdb', 'agnews', 'listops') for v in vs]
    t = _fake(0.8, [0.02, 0.001, 0.02, 0.002] + [0.01] * 4 + [0.001, 0.03, 0.002, 0.03], 3, keys)
    sc = spread_claim(t, tasks=None)
    assert sc.verdict.tolist() == ['reproduced', 'not shown', 'contradicted']
    assert sc.df_entropic.tolist() == [4.0] * 3 and sc.std_plain[0] == pytest.approx(0.02)
    assert spread_claim(t).task.tolist() == ['imdb', 'agnews']                  # by default where the paper makes the claim
    assert spread_claim(t.assign(n=1), tasks=None).verdict.eq('not tested').all()
    assert spread_claim(t.drop(index=[('agnews', 'entropic-transject'), ('agnews', 'random-entropic-transject')]), tasks=None).task.tolist() == ['imdb', 'listops']
    with pytest.raises(ValueError, match='no finite test_std'): spread_claim(t.assign(test_std=np.nan))
