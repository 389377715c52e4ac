"""The fastai bugs that `transject_nb.training.fastai_fixes` (and `batches.BucketDL`'s test-set order) work around.

Each test shows the bug on fastai's own code and asserts that it is still there. When one fails, fastai has fixed
the bug: remove the fix it names from nbs/12b_fastai_fixes.ipynb (and its section), then this test. Each also checks
the fix.
"""
import json, subprocess, sys
from functools import partial
from pathlib import Path

import pytest, torch
from fastai.callback.progress import CSVLogger
from fastai.interpret import ClassificationInterpretation
from fastai.learner import Learner
from fastai.losses import MSELossFlat
from fastai.test_utils import RegModel, synth_dbunch

from transject_nb.training.checkpoint import HistoryCSV
from transject_nb.training.tasks import load_task
from transject_nb.training.fastai_fixes import FixedLearner
from transject_nb.training.learner import TokenDataLoaders, get_learner

FIXED = "fastai has fixed this bug: remove {} from nbs/12b_fastai_fixes.ipynb, then this test"


def _plain_fastai(code:str)->dict:
    "Run `code` with fastai alone (no transject_nb import, so none of its fixes) and return the JSON it prints last."
    out = subprocess.run([sys.executable, '-c', 'import warnings; warnings.filterwarnings("ignore")\n' + code],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_show_results_for_text_fastai_4092():
    r = _plain_fastai('''
import json
import fastai.text.learner
from fastai.data.core import show_results
from fastai.data.transforms import Category, TensorCategory
from fastai.text.data import TensorText
from fastai.torch_core import TitledStr
from fastcore.foundation import L
shown = (TensorText([[1, 2]]), TensorCategory([0]), L([(TitledStr('a fine film'), Category('pos'))]),
         L([(Category('neg'),)]))
try: show_results(*shown); print(json.dumps(dict(err=None)))
except TypeError as e: print(json.dumps(dict(err=str(e))))''')
    assert r['err'] and 'not subscriptable' in r['err'], FIXED.format('show_text_results (fastai #4092)')
    from fastai.data.core import show_results
    from fastai.data.transforms import Category, TensorCategory
    from fastai.text.data import TensorText
    from fastai.torch_core import TitledStr
    from fastcore.foundation import L
    import transject_nb.training.fastai_fixes as FF
    displayed = []
    FF.display_df, old = displayed.append, FF.display_df
    shown = (TensorText([[1, 2]]), TensorCategory([0]), L([(TitledStr('a fine film'), Category('pos'))]),
             L([(Category('neg'),)]))
    try: rows = show_results(*shown)
    finally: FF.display_df = old
    assert list(rows[0]) == ['a fine film', 'pos', 'neg'] and len(displayed) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, fastai's .cuda() works and gloo broadcasts it")
def test_distributed_dl_broadcast_without_cuda():
    r = _plain_fastai('''
import json
import torch.distributed as dist
from fastai.distributed import DistributedDL
dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
try: print(json.dumps(dict(out=DistributedDL._broadcast(None, [3, 1, 2], 0), err=None)))
except Exception as e: print(json.dumps(dict(out=None, err=type(e).__name__)))''')
    assert r['err'] is not None, FIXED.format("the patch of DistributedDL._broadcast (fastai/distributed.py, line 100)")
    import torch.distributed as dist
    from fastai.distributed import DistributedDL
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
    try: assert DistributedDL._broadcast(None, [3, 1, 2], 0) == [3, 1, 2]
    finally: dist.destroy_process_group()


def _synth(cls, path, cbs):
    Path(path).mkdir(parents=True)
    learn = cls(synth_dbunch(), RegModel(), loss_func=MSELossFlat(), path=path, cbs=cbs)
    with learn.no_bar(), learn.no_logging(): learn.fit(2)
    return learn


@pytest.mark.parametrize('name', ['validate', 'get_preds', 'summary'])
def test_evaluation_outside_fit_keeps_the_history_fastai_4132(name, tmp_path):
    plain = _synth(Learner, tmp_path/'plain', [CSVLogger()])
    rows, csv = [list(v) for v in plain.recorder.values], (tmp_path/'plain'/'history.csv').read_text()
    with plain.no_bar(): getattr(plain, name)()
    lost = [list(v) for v in plain.recorder.values] != rows
    assert lost, FIXED.format(f'FixedLearner.{name} (fastai #4132)')
    if name == 'validate': assert (tmp_path/'plain'/'history.csv').read_text() != csv   # CSVLogger truncates it
    fixed = _synth(FixedLearner, tmp_path/'fixed', [HistoryCSV()])
    rows, csv = [list(v) for v in fixed.recorder.values], (tmp_path/'fixed'/'history.csv').read_text()
    with fixed.no_bar(): getattr(fixed, name)()
    assert [list(v) for v in fixed.recorder.values] == rows and (tmp_path/'fixed'/'history.csv').read_text() == csv


def test_logger_after_fit(tmp_path):
    loggers = {}
    for cls in (Learner, FixedLearner):
        (tmp_path/cls.__name__).mkdir()
        learn = cls(synth_dbunch(), RegModel(), loss_func=MSELossFlat(), path=tmp_path/cls.__name__, cbs=CSVLogger())
        learn.fit(1)                                                   # with fastai's ProgressCallback
        loggers[cls.__name__] = learn.logger
    assert loggers['Learner'] is not print, FIXED.format('FixedLearner.fit (fastai/callback/progress.py: 46, 127)')
    assert loggers['FixedLearner'] is print


def test_interpretation_pairs_a_sorted_test_set_wrongly(tmp_path):
    tiny = load_task('listops', max_len=32, n_train=64, n_valid=32, n_test=32, cache_dir=False, progress=False,
                     min_length=4, max_length=32, max_depth=3, max_args=4)
    learn = get_learner('listops', 'transformer', preset='cpu', data=tiny, path=tmp_path, device='cpu', d_model=16,
                        n_layers=1, max_len=32)
    def paired():
        with learn.no_bar():
            _, preds, targs, _, losses = ClassificationInterpretation.from_learner(learn)[list(range(8))]
        return torch.allclose(torch.nn.functional.nll_loss(preds.log(), targs, reduction='none'), losses, atol=1e-5)
    assert paired()                                                    # BucketDL: a test set keeps its order
    learn.dls.test_dl = partial(TokenDataLoaders.test_dl, learn.dls, sort=True)   # sorted, as a SortedDL's are
    assert not paired(), ("fastai's Interpretation now pairs a sorted test set's items with their losses: "
                          "BucketDL.new's sort=False for test sets (nbs/11a_batches.ipynb) is no longer needed for it; "
                          "update nbs/12b_fastai_fixes.ipynb, then this test")


def test_export_is_atomic_and_keeps_the_learner(tmp_path, disk_full):
    "A full disk while exporting (a write failing part-way): the old export.pkl loads as before; the learner keeps its data and optimiser."
    data = load_task('listops', max_len=32, n_train=64, n_valid=32, n_test=32, cache_dir=False, progress=False,
                     min_length=4, max_length=32, max_depth=3, max_args=4)
    learn = get_learner('listops', 'transformer', preset='cpu', data=data, path=tmp_path, device='cpu', d_model=16, n_layers=1, max_len=32)
    learn.create_opt(); learn.export()
    before = (tmp_path/'export.pkl').read_bytes()
    disk_full(after=1000)
    with pytest.raises(OSError, match='No space left on device'): learn.export()
    assert (tmp_path/'export.pkl').read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ['export.pkl']
    assert learn.dls.train.n == 64 and learn.opt is not None
