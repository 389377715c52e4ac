"""The training module: batches, config resolution, callbacks, resume, export/predict, safe loading.

Everything runs on a tiny generated ListOps (no files, no network) with d_model 16 and 1-2 epochs.
"""
import os, warnings
from pathlib import Path

import pytest, torch
from fastai.callback.core import Callback
from hypothesis import given, strategies as st

from transject_nb.core import PAD_ID
from transject_nb.data import TokenSplit, load_task
from transject_nb.core import atomic_save
from transject_nb.learner import (BucketDL, TaskLearner, TrainCheckpoint, evaluate, get_dls, get_learner, history,
                                  load_checkpoint, load_trained, load_weights, resolve_config, results_table, train_learner)


@pytest.fixture(scope='module')
def data():
    return load_task('listops', max_len=32, n_train=192, n_valid=64, n_test=64, cache_dir=False, progress=False,
                     min_length=4, max_length=32, max_depth=3, max_args=4)


def _learn(data, path, variant='transformer', **kw):
    return get_learner('listops', variant, preset='cpu', data=data, path=path, device='cpu',
                       **(dict(d_model=16, n_layers=1, max_len=32, epochs=1, bs=32, lr=2e-3) | kw))


# --- batches -----------------------------------------------------------------------------------------

@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=120), bs=st.integers(1, 9), bucket=st.integers(1, 4), epoch=st.integers(0, 3))
def test_bucket_dl_is_a_padded_permutation(lens, bs, bucket, epoch):
    split = TokenSplit.from_lists([[1 + i % 5] * n for i, n in enumerate(lens)], [0] * len(lens))
    dl = BucketDL(split, bs=bs, shuffle=True, seed=3, bucket=bucket, max_len=16)
    dl.set_epoch(epoch)
    idxs = dl.get_idxs()
    assert sorted(idxs) == list(range(len(lens)))
    dl.set_epoch(epoch)
    assert dl.get_idxs() == idxs                                     # the order depends on (seed, epoch) only
    seen = 0
    dl.set_epoch(epoch)
    for x, y in dl:
        assert x.shape[1] <= 16 and x.dtype == torch.long
        n = (x != PAD_ID).sum(1)
        assert ((x != PAD_ID) == (torch.arange(x.shape[1]) < n[:, None])).all()   # right padding only
        seen += len(y)
    assert seen == len(lens)


def test_bucketing_saves_padding(data):
    dls = get_dls(data, bs=16, device='cpu')
    real = tot = 0
    for x, _ in dls.train: real += int((x != 0).sum()); tot += x.numel()
    assert 1 - real / tot < 0.15


def test_bucket_dl_rejects_bad_input():
    with pytest.raises(TypeError, match='needs a TokenSplit'): BucketDL([[1, 2]], bs=2)
    with pytest.raises(ValueError, match='bs must be a positive int'): BucketDL(TokenSplit.from_lists([[1]], [0]), bs=0)


# --- config ------------------------------------------------------------------------------------------

def test_resolve_config_presets_and_overrides():
    rc = resolve_config('listops', 'transject', preset='cpu', d_model=32, lr=1e-3)
    assert (rc['model']['d_model'], rc['model']['pooling'], rc['train'].lr, rc['train'].eps) == (32, 'max', 1e-3, 1e-9)
    assert 'eps' not in rc['model'] and 'n_heads' not in rc['model']
    assert resolve_config('agnews', 'transformer', preset='paper')['model']['max_len'] == 256
    with pytest.raises(TypeError, match="valid fields are: model: d_model"): resolve_config('listops', 'transformer', n_experts=2)
    with pytest.raises(ValueError, match='valid variants are'): resolve_config('listops', 'nope')
    with pytest.raises(ValueError, match='valid tasks are'): resolve_config('sst2', 'transject')
    with pytest.raises(ValueError, match='valid presets are'): resolve_config('listops', 'transject', preset='gpu')
    with pytest.raises(ValueError, match='sched must be one of'): resolve_config('listops', 'transject', sched='cosine')


def test_get_learner_checks_its_data(data, tmp_path):
    with pytest.raises(ValueError, match="data are for task 'listops', not 'imdb'"):
        get_learner('imdb', 'transformer', preset='cpu', data=data, path=tmp_path)
    with pytest.raises(TypeError, match='must be a TaskData'): get_learner('listops', 'transformer', preset='cpu', data=[1], path=tmp_path)


# --- training, saving, predicting --------------------------------------------------------------------

def test_train_evaluate_export_predict(data, tmp_path):
    learn = _learn(data, tmp_path/'tj', 'transject')
    assert 'recon_loss' in [m.name for m in learn.metrics]           # the approx variant's reconstruction loss is tracked
    train_learner(learn, progress=False)
    res = evaluate(learn)
    assert len(history(learn)) == 1 and 0 <= res['test_acc'] <= 1 and res['majority'] > 0
    assert len(history(learn)) == 1                                  # validate() left the history alone
    best = torch.load(tmp_path/'tj'/'models'/'best.pth', weights_only=True)
    assert set(best) == set(learn.model.state_dict())
    assert load_checkpoint(tmp_path/'tj'/'models'/'checkpoint.pth')['done']
    learn.export()
    with pytest.warns(UserWarning, match='only load files you trust'): inf = load_trained(tmp_path/'tj')
    assert isinstance(inf, TaskLearner) and inf.classes == tuple('0123456789')
    label, idx, probs = inf.predict('[MAX 2 9 [MIN 4 7 ] 0 ]')
    assert label == str(int(idx)) and probs.shape == (10,) and abs(float(probs.sum()) - 1) < 1e-5
    lra = '( ( ( ( [MAX 2 ) 9 ) ( ( ( [MIN 4 ) 7 ) ] ) ) 0 ) ] )'
    torch.testing.assert_close(inf.predict(lra)[2], probs)
    texts = [data.tokenizer.decode(data.test[i][0]) for i in range(len(data.test))]
    acc = (inf.predict_proba(texts).argmax(1) == data.test.labels).float().mean().item()
    assert abs(acc - res['test_acc']) < 1e-6
    with pytest.raises(ValueError, match='empty text'): inf.predict(' ')
    with pytest.raises(ValueError, match='unknown ListOps token'): inf.predict('[MAX 1 [FIRST 2 ] ]')
    fresh = load_weights(_learn(data, tmp_path/'other', 'transject'), tmp_path/'tj'/'models'/'best.pth')
    torch.testing.assert_close(fresh.predict_proba(texts), inf.predict_proba(texts))


def test_variants_without_aux_loss_have_no_recon_metric(data, tmp_path):
    assert [m.name for m in _learn(data, tmp_path, 'random-transject').metrics] == ['accuracy']


class _Crash(Callback):
    order = TrainCheckpoint.order + 1
    def after_epoch(self):
        if self.epoch == 0: raise RuntimeError('simulated crash')


def test_resume_equals_uninterrupted(data, tmp_path):
    kw = dict(epochs=2, patience=5)
    full = train_learner(_learn(data, tmp_path/'full', **kw), progress=False)
    with pytest.raises(RuntimeError, match='simulated crash'): train_learner(_learn(data, tmp_path/'res', cbs=_Crash(), **kw), progress=False)
    st = load_checkpoint(tmp_path/'res'/'models'/'checkpoint.pth')
    assert st['epoch'] == 0 and not st['done']
    res = train_learner(_learn(data, tmp_path/'res', **kw), progress=False)
    h1, h2 = history(full).drop(columns='seconds'), history(res).drop(columns='seconds')
    assert len(h2) == 2
    assert (h1 - h2).abs().max().max() < 1e-5
    for k, v in full.model.state_dict().items(): assert (v - res.model.state_dict()[k]).abs().max() < 1e-5, k
    # a finished run is loaded, not trained again; a foreign checkpoint is refused
    again = train_learner(_learn(data, tmp_path/'res', **kw), progress=False)
    assert (history(again).drop(columns='seconds') - h2).abs().max().max() == 0
    with pytest.raises(ValueError, match='different run'): train_learner(_learn(data, tmp_path/'res', **(kw | dict(d_model=32))))


def test_early_stopping_uses_patience(data, tmp_path):
    learn = _learn(data, tmp_path, epochs=6, patience=1, lr=1.0)      # a learning rate that cannot keep improving
    train_learner(learn, progress=False)
    h = history(learn)
    assert len(h) < 6
    assert load_checkpoint(tmp_path/'models'/'checkpoint.pth')['early_stopped']


def test_atomic_save_keeps_the_old_file_on_failure(tmp_path):
    f = tmp_path/'m.pth'
    atomic_save({'a': torch.ones(2)}, f)
    with pytest.raises(Exception): atomic_save({'a': lambda: 0}, f)      # not picklable: torch.save fails midway
    assert torch.load(f, weights_only=True)['a'].tolist() == [1., 1.]
    assert [p.name for p in tmp_path.iterdir()] == ['m.pth']             # no temporary file left
    with pytest.raises(ValueError, match='not a transject_nb training checkpoint'): load_checkpoint(f)


def test_load_weights_refuses_pickled_code(data, tmp_path):
    class Evil:
        def __reduce__(self): return (os.system, ('echo pwned',))
    torch.save({'x': Evil()}, tmp_path/'evil.pth')
    with pytest.raises(Exception, match='(?i)weights.only|unsupported|global'):
        load_weights(_learn(data, tmp_path), tmp_path/'evil.pth')


def test_results_table():
    rows = [dict(variant='a', test_acc=.5, valid_acc=.4, majority=.2, params=10, epochs=2, train_secs=1.0),
            dict(variant='a', test_acc=.7, valid_acc=.6, majority=.2, params=10, epochs=2, train_secs=1.0),
            dict(variant='b', test_acc=.3, valid_acc=.3, majority=.2, params=5, epochs=1, train_secs=2.0)]
    t = results_table(rows)
    assert list(t.index) == ['a', 'b'] and t.loc['a', 'seeds'] == 2 and abs(t.loc['a', 'test_acc'] - .6) < 1e-12
    f = results_table(rows, fmt=True)
    assert f.loc['a', 'test acc %'] == '60.0 ± 14.1' and f.loc['b', 'test acc %'] == '30.0'
