"""The sweep machinery at tiny sizes: cells, the records' shapes, divergence detection, and the resume of finished and interrupted runs."""
import json, math
import pandas as pd
import pytest
import torch
from transject_nb.sweeps import grid_cells, cell_key, depth_measures, diverged, run_cell, run_grid, grid_summary, best_cells, init_sweep, GRID_SCALARS
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
