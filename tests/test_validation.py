"""The numbers a Learner records while it trains equal a fresh evaluation of the same weights, for every variant.

After each epoch a callback deep-copies the model's weights into a freshly built model and evaluates that copy on
the validation set; the recorder's `valid_loss` and `accuracy` of that epoch must match it to float tolerance.
Right after `fit`, with no reload, `validate` and `predict` must use the current weights too.

This is the regression test of a stale cache: TransJect's orthogonal matrices were cached without gradients, keyed on
the parameters' version counters, which fastai's optimiser (it writes through `p.data`) never bumps; every validation
pass inside `fit` then reused the matrices of the first one.
"""
import copy

import pytest, torch
from fastai.callback.core import Callback

from transject_nb.training.tasks import load_task
from transject_nb.training.learner import get_learner
from transject_nb.models import VARIANTS, create_model


@pytest.fixture(scope='module')
def data():
    return load_task('listops', max_len=32, n_train=160, n_valid=64, n_test=32, cache_dir=False, progress=False,
                     min_length=4, max_length=32, max_depth=3, max_args=4)


def fresh_copy(model):
    "A newly built model of the same class and config, on the same device, holding a deep copy of `model`'s weights (no state but the weights)."
    m = type(model)(copy.deepcopy(model.cfg)).to(next(model.parameters()).device)
    m.load_state_dict(copy.deepcopy(model.state_dict()))
    return m.eval()


@torch.no_grad()
def fresh_eval(model, dl):
    "Mean cross-entropy (weighted by batch size, as fastai's `AvgLoss`) and accuracy of a fresh copy of `model` on `dl`."
    m, tot, correct, n = fresh_copy(model), 0., 0, 0
    for x, y in dl:
        x, y = x.as_subclass(torch.Tensor), y.as_subclass(torch.Tensor)     # plain tensors: fastai's typed ones dispatch differently
        out = m(x).float()
        tot += torch.nn.functional.cross_entropy(out, y, reduction='sum').item()
        correct += (out.argmax(-1) == y).sum().item(); n += len(y)
    return tot / n, correct / n


class CheckEachEpoch(Callback):
    "After the recorder has logged an epoch, evaluate a fresh copy of the weights and keep both."
    order = 70                                                        # after the Recorder (50): its values for the epoch exist
    def before_fit(self): self.rows = []
    def after_epoch(self):
        names = list(self.recorder.metric_names[1:-1])                # without 'epoch' and 'time'
        logged = dict(zip(names, self.recorder.values[-1]))
        self.rows.append((logged['valid_loss'], logged['accuracy'], *fresh_eval(self.learn.model, self.dls.valid)))


DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA'))]

@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('variant', VARIANTS)
def test_recorded_validation_equals_fresh_evaluation(data, tmp_path, variant, device):
    torch.manual_seed(0)
    learn = get_learner('listops', variant, preset='cpu', data=data, path=tmp_path, device=device, amp='off',
                        d_model=16, n_layers=2, max_len=32, epochs=3, bs=32, lr=3e-2, patience=10)
    cb = CheckEachEpoch()
    with learn.no_bar(), learn.no_logging(): learn.fit(3, 3e-2, cbs=cb)
    assert len(cb.rows) == 3
    for ep, (loss, acc, f_loss, f_acc) in enumerate(cb.rows):
        assert loss == pytest.approx(f_loss, rel=1e-4, abs=1e-5), f"{variant}, epoch {ep}: recorded valid_loss {loss} != fresh {f_loss}"
        assert acc == pytest.approx(f_acc, abs=1e-6), f"{variant}, epoch {ep}: recorded accuracy {acc} != fresh {f_acc}"
    losses = [r[0] for r in cb.rows]
    assert len(set(losses)) == 3, f"{variant}: the validation loss did not change between epochs: {losses} (the test would be vacuous)"
    # right after fit, with no reload: validate and predict use the current weights
    f_loss, f_acc = fresh_eval(learn.model, learn.dls.valid)
    with learn.no_bar(): v_loss, v_acc = learn.validate()[:2]            # [loss, accuracy, (recon_loss)]
    assert v_loss == pytest.approx(f_loss, rel=1e-4, abs=1e-5) and v_acc == pytest.approx(f_acc, abs=1e-6)
    text = '[MAX 4 3 [MIN 2 3 ] 1 0 ]'
    x = learn.encode(text).to(device)
    with torch.no_grad(): p_fresh = fresh_copy(learn.model)(x).float().softmax(-1)[0].cpu()
    torch.testing.assert_close(learn.predict(text)[2], p_fresh, rtol=1e-4, atol=1e-5)


def test_no_grad_matrices_follow_in_place_data_changes():
    "The mechanism itself: an optimiser's in-place change through `.data` (no version bump) must reach the no-grad matrices."
    from transject_nb.cpu import OrthogonalBank
    torch.manual_seed(0)
    bank = OrthogonalBank(2, 6)
    with torch.no_grad(): before = bank().clone()
    bank.parametrizations.weight.original.data.add_(0.3 * torch.randn(2, 6, 6))
    with torch.no_grad(): after = bank()
    assert (after - before).abs().max() > 1e-2
    torch.testing.assert_close(after, bank().detach(), rtol=0, atol=1e-6)  # equals the matrices computed with gradients
