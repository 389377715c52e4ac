"""What the depth study records of a model at tiny sizes: the measures' shapes, divergence detection, similarity at
initialisation; and that the retired grid engine is gone."""
import math, re
from pathlib import Path
import pandas as pd
import pytest
import torch
from transject_nb.lab.depth_measures import depth_measures, diverged, init_sweep, LAYER_KEYS, MEASURE_COLUMNS
from transject_nb.models import create_model

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize('variant', ['transject', 'transformer', 'neutreno'])
def test_depth_measures_shapes(variant):
    torch.manual_seed(0)
    m = create_model(variant, 50, 3, d_model=16, n_layers=3, max_len=12)
    x, y = torch.randint(1, 50, (4, 12)), torch.tensor([0, 1, 2, 0])
    r = depth_measures(m.train(), x, y)
    assert len(r['cosine_layers']) == len(r['share_layers']) == 4
    assert r['cosine'] == r['cosine_layers'][-1] and 0 <= r['share'] <= 1 and r['grad_norm_first'] >= 0
    assert m.training and all(p.grad is None for p in m.parameters())     # mode kept, gradients cleared
    assert {f'{k}_init' for k in r} == {c for c in (*MEASURE_COLUMNS, *LAYER_KEYS) if c.endswith('_init')}


def test_divergence_detection():
    h = lambda tl, vl: pd.DataFrame(dict(train_loss=tl, valid_loss=vl))
    assert not diverged(h([2.0, 1.0], [1.5, 1.2]), 1.6)
    assert diverged(h([2.0, math.inf], [1.5, 1.2]), 1.6)
    assert diverged(h([2.0, 1.0], [float('nan'), float('nan')]), 1.6)
    assert diverged(h([2.0, 1.0], [1.7, 1.6]), 1.6)                        # never below the initial validation loss


def test_init_sweep_identity_at_init():
    torch.manual_seed(0)
    x, y = torch.randint(1, 50, (3, 10)), torch.tensor([0, 1, 0])
    df = init_sweep(x, y, 50, 2, depths=(1, 8), variants=['transject', 'transformer'], d_model=16, max_len=10)
    tj = df[df.variant == 'transject'].share.tolist()
    assert abs(tj[0] - tj[1]) < 1e-6                                      # TransJect's layers are the identity at initialisation
    with pytest.raises(ValueError, match="unknown variant"): init_sweep(x, y, 50, 2, variants=['nope'])


def test_nothing_imports_the_retired_grid_engine():
    "Every study runs on the protocol: no module or notebook imports the grid engine, and its import says where its parts went."
    gone = re.compile(r"lab\.sweeps\b|from \.sweeps\b|\brun_grid\b|\brun_cell\b|\bexport_grid\b|\bDEPTH_STUDY\b|\bROBUSTNESS_STUDY\b|\bLR_STUDY\b")
    files = [*(ROOT/'transject_nb').rglob('*.py'), *(ROOT/'nbs').glob('*.ipynb')]
    hits = [f.name for f in files if f.name != '__init__.py' and gone.search(f.read_text())]
    assert hits == [], hits
    assert not (ROOT/'transject_nb'/'lab'/'sweeps.py').exists()
    with pytest.raises(ModuleNotFoundError, match="retired with its grid engine.*depth_measures"):
        import transject_nb.lab.sweeps  # noqa: F401
