"""The training module: batches, config resolution, callbacks, resume, export/predict, safe loading, fastai's tools.

Everything runs on tiny data (no shared files, no network): a generated ListOps with d_model 16 and 1-2 epochs, and
for fastai's tools on every task, tiny IMDb / AG News / byte-IMDb folders written to a temporary folder.
"""
import os, pickle, warnings
from pathlib import Path

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest, torch
import fastai.text.data, fastai.text.learner
from fastai.callback.core import Callback
from fastai.interpret import ClassificationInterpretation
from hypothesis import given, strategies as st

import transject_nb.training.fastai_fixes as FF
from transject_nb.core import PAD_ID
from transject_nb.presets import TASKS
from transject_nb.training.data import CLASSES, TokenSplit, pad_batch
from transject_nb.training.tokenizers import ListOpsTokenizer
from transject_nb.training.tasks import TaskData, load_task
from transject_nb.training.items import task_datasets
from transject_nb.training.utils import atomic_save
from transject_nb.training.batches import BucketDL
from transject_nb.training.checkpoint import HistoryCSV, TrainCheckpoint, load_checkpoint, load_trained, load_weights
from transject_nb.training.config import resolve_config
from transject_nb.training.learner import TaskLearner, evaluate, get_dls, get_learner, history, train_learner
from test_data import tiny_vocab, write_aclimdb, write_agnews, write_imdb_csv


@pytest.fixture(scope='module')
def data():
    return load_task('listops', max_len=32, n_train=192, n_valid=64, n_test=64, cache_dir=False, progress=False,
                     min_length=4, max_length=32, max_depth=3, max_args=4)


def _learn(data, path, variant='transformer', **kw):
    return get_learner('listops', variant, preset='cpu', data=data, path=path, device='cpu',
                       **(dict(d_model=16, n_layers=1, max_len=32, epochs=1, bs=32, lr=2e-3) | kw))


def _task(split, max_len=64):
    "A ListOps TaskData whose three splits are `split`."
    return TaskData('listops', split, split, split, ListOpsTokenizer.vocab_sz, 10, CLASSES['listops'], ListOpsTokenizer(), max_len, 'test')


# --- batches -----------------------------------------------------------------------------------------

@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=120), bs=st.integers(1, 9), bucket=st.integers(1, 4), epoch=st.integers(0, 3))
def test_bucket_dl_is_a_padded_permutation(lens, bs, bucket, epoch):
    split = TokenSplit.from_lists([[1 + i % 5] * n for i, n in enumerate(lens)], [0] * len(lens))
    dl = BucketDL(task_datasets(_task(split)).train, bs=bs, shuffle=True, seed=3, bucket=bucket, max_len=16)
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
    with pytest.raises(TypeError, match='needs a fastai Datasets'): BucketDL([[1, 2]], bs=2)
    with pytest.raises(TypeError, match='needs a fastai Datasets'): BucketDL(TokenSplit.from_lists([[1]], [0]), bs=2)
    with pytest.raises(ValueError, match='bs must be a positive int'): BucketDL(task_datasets(_task(TokenSplit.from_lists([[1]], [0]))).train, bs=0)


@pytest.mark.parametrize('pad_multiple', [1, 8])
def test_gathered_batches_equal_fastai_items(data, pad_multiple):
    "The vectorised batches equal fastai's per-item transforms padded, and raw texts through `test_dl` give the same batches."
    dls = get_dls(data, bs=16, device='cpu')
    for dl in dls.loaders:
        dl = dl.new(pad_multiple=pad_multiple)
        assert dl.tfm is not None                                           # the fast path
        dl.set_epoch(1)
        idxs = dl.get_idxs()
        dl.set_epoch(1)
        for k, (x, y) in enumerate(dl):
            items = [dl.dataset[i] for i in idxs[k * dl.bs:(k + 1) * dl.bs]]
            want = pad_batch([it[0] for it in items])
            n = -(-want.shape[1] // pad_multiple) * pad_multiple
            assert type(x).__name__ == 'TensorText' and type(y).__name__ == 'TensorCategory'
            assert x.shape == (len(items), min(n, data.max_len)) and torch.equal(x[:, :want.shape[1]], want) and (x[:, want.shape[1]:] == PAD_ID).all()
            assert torch.equal(y, torch.stack([it[1] for it in items]))
    # the same examples as raw texts go through the transforms (the slow path) and give the same batches
    texts = [data.tokenizer.decode(data.valid[i][0]) for i in range(len(data.valid))]
    tdl = dls.test_dl(texts)
    assert tdl.tfm is None and tdl.get_idxs() == list(range(len(texts)))  # a test set keeps its order
    for (xt,), (xv, _) in zip(tdl, dls.valid.new(sort=False)): assert torch.equal(xt, xv)
    for (xt,), (xv, _) in zip(dls.test_dl(texts, sort=True), dls.valid): assert torch.equal(xt, xv)   # both longest first
    # a test set of example indices (as fastai's Interpretation makes) takes the fast path, with or without labels, in its order
    gidx = list(dls.valid.dataset.items)[:5][::-1]
    for with_labels in (True, False):
        tl = dls.test_dl(gidx, with_labels=with_labels)
        b = tl.one_batch()
        assert tl.tfm is not None and len(b) == 1 + with_labels and torch.equal(b[0], pad_batch([data.valid[i][0] for i in range(5)][::-1]))


def test_targets_and_evaluate_majority(data):
    dls = get_dls(data, bs=16, device='cpu')
    assert torch.equal(dls.test.targets, data.test.labels) and torch.equal(dls.train.targets, data.train.labels)
    with pytest.raises(TypeError, match='task examples only'): dls.test_dl(['[MAX 1 2 ]']).targets


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
    with pytest.raises(ValueError, match='valid schedules are: constant, 1cycle'): resolve_config('listops', 'transject', sched='cosine')


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_resume_on_cuda(data, tmp_path):
    "A run resumed on a GPU: the checkpoint is read onto the CPU, and its optimiser state must go back to the GPU."
    kw = dict(epochs=2, patience=5)
    mk = lambda **k: get_learner('listops', 'transformer', preset='cpu', data=data, path=tmp_path, device='cuda',
                                 **(dict(d_model=16, n_layers=1, max_len=32, bs=32, lr=2e-3) | kw | k))
    with pytest.raises(RuntimeError, match='simulated crash'): train_learner(mk(cbs=_Crash()), progress=False)
    res = train_learner(mk(), progress=False)
    assert len(history(res)) == 2 and all(t.device.type == 'cuda' for s in res.opt.state.values() for t in s.values()
                                         if isinstance(t, torch.Tensor))


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


# --- fastai's tools, on every task ---------------------------------------------------------------------

def _tiny_task(task, tmp_path):
    "A tiny TaskData of `task`, from the generator or from files written here."
    if task == 'listops':
        return load_task('listops', max_len=32, n_train=64, n_valid=32, n_test=32, cache_dir=False, progress=False,
                         min_length=4, max_length=32, max_depth=3, max_args=4)
    if task == 'imdb': return load_task('imdb', write_imdb_csv(tmp_path/'imdb'), vocab=tiny_vocab(tmp_path/'v.txt'), max_len=16, cache_dir=False)
    if task == 'agnews': return load_task('agnews', write_agnews(tmp_path/'ag'), vocab=tiny_vocab(tmp_path/'v.txt'), max_len=16, cache_dir=False)
    return load_task('charimdb', write_aclimdb(tmp_path/'aclImdb'), max_len=48, valid_pct=0.25, cache_dir=False)

LONG = dict(listops='[MAX ' + '1 ' * 200 + ']', imdb='the movie was great ' * 50, agnews='the plot was bad ' * 50, charimdb='x' * 500)


@pytest.fixture
def shown(monkeypatch):
    "The tables fastai's text functions display (show_batch, show_results, plot_top_losses), captured."
    out = []
    for mod in (fastai.text.data, fastai.text.learner, FF): monkeypatch.setattr(mod, 'display_df', out.append)
    return out


@pytest.mark.parametrize('task', TASKS)
def test_fastai_tools_on_every_task(task, tmp_path, shown):
    data = _tiny_task(task, tmp_path)
    learn = get_learner(task, 'transformer', preset='cpu', data=data, path=tmp_path/'run', device='cpu', d_model=16, n_layers=1, n_heads=2,
                        d_ff=32, max_len=data.max_len, epochs=1, bs=8, lr=2e-3)
    train_learner(learn, progress=False)
    h0, csv0 = history(learn), (tmp_path/'run'/'history.csv').read_text()
    tok, classes = data.tokenizer, data.classes
    decoded = lambda x: [tok.decode(r) for r in x]
    with learn.no_bar():
        # show_batch: the decoded texts and class names of the batch
        b = learn.dls.train.one_batch()
        _, _, its = learn.dls.train.show_batch(b, max_n=4, show=False)
        assert [str(t) for t, _ in its] == decoded(b[0][:4]) and [str(c) for _, c in its] == [classes[i] for i in b[1][:4]]
        learn.dls.train.show_batch(b, max_n=4)
        df = shown.pop()
        assert list(df.columns) == ['text', 'category'] and df['text'].tolist() == decoded(b[0][:4])
        assert df['category'].tolist() == [classes[i] for i in b[1][:4]]
        # show_results: texts, targets and predictions
        learn.show_results(max_n=4)
        df = shown.pop()
        assert list(df.columns) == ['text', 'category', 'category_'] and len(df) == 4
        assert set(df['category']) | set(df['category_']) <= set(classes)
        valid_texts = {tok.decode(data.valid[i][0]) for i in range(len(data.valid))}
        assert set(df['text']) <= valid_texts
        # ClassificationInterpretation: confusion matrix = predictions against targets; top losses with their texts
        interp = ClassificationInterpretation.from_learner(learn)
        assert list(interp.vocab) == list(classes)
        preds, targs = learn.get_preds()
        cm = interp.confusion_matrix()
        want = np.zeros((len(classes),) * 2, dtype=int)
        np.add.at(want, (targs.numpy(), preds.argmax(1).numpy()), 1)
        assert (cm == want).all() and cm.sum() == len(data.valid)
        mc = interp.most_confused()
        assert all(a != p and cm[classes.index(a), classes.index(p)] == n for a, p, n in mc)
        assert sum(n for *_, n in mc) == cm.sum() - np.trace(cm)
        interp.plot_confusion_matrix()
        assert [t.get_text() for t in plt.gca().get_xticklabels()] == list(classes)
        plt.close('all')
        interp.plot_top_losses(3)
        df = shown.pop()
        losses, idx = interp.top_losses(3)
        assert list(df.columns) == ['input', 'target', 'predicted', 'probability', 'loss'] and len(df) == 3
        gidx = np.asarray(list(interp.dl.items))[idx.numpy()]
        assert df['input'].tolist() == [tok.decode(data.valid[int(g) - len(data.train)][0]) for g in gidx]
        np.testing.assert_allclose(df['loss'].astype(float), losses.numpy(), rtol=1e-5)
        # test_dl on raw texts: the package's own predict_proba agrees; longer texts are cut; an empty text is refused
        texts = [tok.decode(data.test[i][0]) for i in range(5)] + [LONG[task]]
        dl = learn.dls.test_dl(texts)
        p, y = learn.get_preds(dl=dl)
        assert y is None and p.shape == (6, len(classes))
        torch.testing.assert_close(p, learn.predict_proba(texts))
        assert len(dl.dataset[5][0]) == data.max_len and dl.one_batch()[0].shape[1] == data.max_len
        with pytest.raises(ValueError, match=r"item 1 .*empty text"): learn.dls.test_dl([texts[0], '  \n'])
        # summary: the model's layers; the history, history.csv and checkpoint stay as they were
        s = learn.summary()
        assert type(learn.model).__name__ in s and 'Total params' in s
    pd.testing.assert_frame_equal(history(learn), h0)
    assert (tmp_path/'run'/'history.csv').read_text() == csv0
    assert load_checkpoint(tmp_path/'run'/'models'/'checkpoint.pth')['done']
    # export after all of these, load back, predict
    learn.export()
    with pytest.warns(UserWarning, match='only load files you trust'): inf = load_trained(tmp_path/'run')
    torch.testing.assert_close(inf.predict(texts[0])[2], learn.predict(texts[0])[2])
    torch.testing.assert_close(inf.get_preds(dl=inf.dls.test_dl(texts))[0], p)
    assert len(inf.dls.train.dataset) == 0 and inf.dls.valid_ds.tls[0].tfms.fs[0].items is None   # the export has no data


def _csv_cb(learn): return next(c for c in learn.cbs if isinstance(c, HistoryCSV))


def test_summary_runs_no_training_callbacks(data, tmp_path):
    "fastai's own summary (not only TaskLearner's) leaves the checkpoint, history.csv and an open file alone."
    learn = _learn(data, tmp_path)
    train_learner(learn, progress=False)
    ck, csv = (tmp_path/'models'/'checkpoint.pth').read_bytes(), (tmp_path/'history.csv').read_text()
    from fastai.learner import Learner
    with learn.no_bar(): Learner.summary(learn)
    assert (tmp_path/'models'/'checkpoint.pth').read_bytes() == ck and (tmp_path/'history.csv').read_text() == csv
    assert all(getattr(c, '_only_train_loop', False) for c in (learn.train_checkpoint, _csv_cb(learn)))
    pickle.dumps(_csv_cb(learn))                                      # no open file in the logger
    learn.export()


def test_crashed_fit_leaves_no_open_file_and_lr_find_keeps_history(data, tmp_path):
    learn = _learn(data, tmp_path, cbs=_Crash(), epochs=2, patience=5)
    with pytest.raises(RuntimeError, match='simulated crash'): train_learner(learn, progress=False)
    pickle.dumps(_csv_cb(learn))
    assert learn.logger is print or not isinstance(getattr(learn.logger, '__self__', None), HistoryCSV)
    learn.export()                                                         # the crashed learner pickles
    done = _learn(data, tmp_path/'done')
    train_learner(done, progress=False)
    csv = (tmp_path/'done'/'history.csv').read_text()
    with done.no_bar(): done.lr_find(num_it=5, show_plot=False)
    assert (tmp_path/'done'/'history.csv').read_text() == csv


def test_one_cycle_schedule(data, tmp_path):
    learn = train_learner(_learn(data, tmp_path, sched='1cycle', epochs=2), progress=False)
    assert len(history(learn)) == 2 and max(learn.recorder.lrs) > min(learn.recorder.lrs)


def test_old_exports_find_their_classes():
    "Exports and checkpoints of older versions name these classes in `transject_nb.training.learner`: they must still be there."
    import transject_nb.training.learner as TL, transject_nb.training.checkpoint as CK, transject_nb.training.config as CF
    import transject_nb.training.batches as B
    for name, mod in dict(TaskLearner=TL, ModelRecipe=CK, TrainCheckpoint=CK, SaveBestCallback=CK, HistoryCSV=CK,
                          TrainConfig=CF, DataConfig=CF, BucketDL=B, TokenDataLoaders=TL, AuxLoss=TL,
                          ReconLoss=TL).items():
        assert getattr(TL, name) is getattr(mod, name), name


def test_export_pickles_classes_by_their_module(data, tmp_path):
    learn = _learn(data, tmp_path)
    state = learn.__getstate__()
    recipe = type(state['model'])
    assert (recipe.__module__, recipe.__name__) == ('transject_nb.training.checkpoint', 'ModelRecipe')


# --- resume and extension (issue 60) ------------------------------------------------------------------------------

class _CrashAt(Callback):
    "A crash after epoch `at`, once its checkpoint is written."
    order = TrainCheckpoint.order + 1
    def __init__(self, at): self.at = at
    def after_epoch(self):
        if self.epoch == self.at: raise RuntimeError('simulated crash')


def test_an_interrupted_extension_resumes_as_the_extension_or_is_refused(data, tmp_path):
    kw = dict(patience=10)
    full = train_learner(_learn(data, tmp_path/'full', epochs=3, **kw), progress=False)
    train_learner(_learn(data, tmp_path/'ext', epochs=1, **kw), progress=False)                      # the run: one epoch
    with pytest.raises(RuntimeError, match='simulated crash'):                                     # extended to 3, cut
        train_learner(_learn(data, tmp_path/'ext', epochs=3, cbs=_CrashAt(1), **kw), progress=False)
    ck = tmp_path/'ext'/'models'/'checkpoint.pth'
    saved = {f: f.read_bytes() for f in (ck, tmp_path/'ext'/'models'/'best.pth')}
    with pytest.raises(ValueError, match=r'its run has trained 2 epochs \(it was set to 3\); epochs=1 would report them as a shorter run'):
        train_learner(_learn(data, tmp_path/'ext', epochs=1, **kw), progress=False)               # the original budget
    assert {f: f.read_bytes() for f in saved} == saved                                             # nothing changed
    ext = train_learner(_learn(data, tmp_path/'ext', epochs=3, **kw), progress=False)               # as the extension
    h1, h2 = history(full).drop(columns='seconds'), history(ext).drop(columns='seconds')
    assert len(h2) == 3 and (h1 - h2).abs().max().max() < 1e-5
    assert evaluate(ext)['epochs'] == 3


def test_a_full_disk_while_saving_a_checkpoint_keeps_the_saved_one(data, tmp_path, disk_full):
    learn = train_learner(_learn(data, tmp_path, epochs=1, patience=10), progress=False)
    models = tmp_path/'models'
    saved = {f.name: f.read_bytes() for f in models.iterdir()}
    disk_full(after=len((tmp_path/'history.csv').read_bytes()) * 3 + 1000)   # the history goes through; the weights do not
    with pytest.raises(OSError, match='No space left on device'):
        train_learner(_learn(data, tmp_path, epochs=2, patience=10), progress=False)
    assert {f.name: f.read_bytes() for f in models.iterdir()} == saved       # the old files whole, no temporary
    assert load_checkpoint(models/'checkpoint.pth')['epoch'] == 0
