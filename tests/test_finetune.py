"Pretraining, then fine-tuning: the encoder's weights reach the classifier, and each stage trains what it says."
import subprocess, sys, textwrap, warnings
from pathlib import Path
import numpy as np
import pytest, torch
import torch.nn as nn
from fastai.callback.core import Callback
warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated')
from transject_nb.models import create_model
from transject_nb.training.checkpoint import TrainCheckpoint
from transject_nb.training.lm import LanguageModel
from transject_nb.training.finetune import fine_tune, layer_groups, load_pretrained, ulmfit_schedule
from transject_nb.lab.finetune_plans import PRETRAIN_STUDIES


@pytest.mark.parametrize('variant', ['transformer', 'neutreno', 'transject', 'random-entropic-transject'])
def test_a_pretrained_encoder_loads_into_the_classifier(variant):
    torch.manual_seed(0)
    causal = variant in ('transformer', 'neutreno')
    enc = create_model(variant, 50, 2, d_model=16, n_layers=2, max_len=32, **({'causal': True} if causal else {}))
    lm = LanguageModel(enc, 50, tie_weights=causal, objective='causal' if causal else 'masked')
    clf = create_model(variant, 50, 3, d_model=16, n_layers=2, max_len=128)
    copied = load_pretrained(clf, lm)
    sd, esd = clf.state_dict(), enc.state_dict()
    assert copied and all(torch.equal(sd[k], esd[k]) for k in copied)
    assert {k for k in sd if k not in copied} == {'head.weight', 'head.bias'}
    assert len(layer_groups(clf)) == 4 and sum(len(g) for g in layer_groups(clf)) == len(list(clf.parameters()))


def test_the_schedule_freezes_what_it_says():
    "fastai's optimiser, built on `layer_groups`: after freeze_to(n) only the groups n.. (and fastai's norm weights) train."
    from fastai.optimizer import Adam
    from fastai.torch_core import params
    torch.manual_seed(0)
    m = create_model('transformer', 50, 2, d_model=16, n_layers=2)
    groups = layer_groups(m)
    opt = Adam(groups, lr=1e-2)
    for stage in ulmfit_schedule(1e-2, len(groups), n_gradual=2):
        opt.freeze_to(stage.freeze_to)
        k = len(groups) + stage.freeze_to if stage.freeze_to < 0 else stage.freeze_to
        assert all(p.requires_grad == (i >= k) for i, g in enumerate(groups) for p in g)
    assert [s.freeze_to for s in ulmfit_schedule(1e-2, 4, n_gradual=2)] == [-1, -2, 0]


@pytest.mark.parametrize('name', list(PRETRAIN_STUDIES))
def test_the_pretrain_plan_reports_its_state_from_the_command_line(tmp_path, name):
    r = subprocess.run([sys.executable, '-m', 'transject_nb.training.cli', 'study', name, '--status', '--out', str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    plan = PRETRAIN_STUDIES[name]
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"0 of {len(plan.arms)} arms finished, 0 runs (at least {len(plan.arms) * plan.runs_per_arm()} in all" in r.stdout


def test_a_running_pretraining_shows_its_progress(tmp_path):
    "An unfinished language model's epochs (parts of its pass) and rate tries come out of `--export`: progress.csv, rates.csv."
    import pandas as pd
    plan = PRETRAIN_STUDIES['ulmfit-imdb']
    h = tmp_path/'runs'/plan.name/plan.arms[0]/'lm'/'history.csv'
    h.parent.mkdir(parents=True)
    h.write_text('epoch,train_loss,valid_loss,accuracy,perplexity,time\n0,5.9,5.8,0.15,330.3,14:13\n1,5.6,5.5,0.17,244.7,1:00:02\n')
    t = tmp_path/'runs'/plan.name/plan.arms[0]/'lm-rates'/f'lr{plan.lm_lrs[1]:g}'/'history.csv'   # one rate tried so far
    t.parent.mkdir(parents=True)
    t.write_text('epoch,train_loss,valid_loss,accuracy,perplexity,time\n0,5.1,5.07,0.2,158.4,08:39\n')
    r = subprocess.run([sys.executable, '-m', 'transject_nb.training.cli', 'study', plan.name, '--out', str(tmp_path/'runs'),
                        '--export', str(tmp_path/'out')], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    prog = pd.read_csv(tmp_path/'out'/'progress.csv')
    k = plan.lm['shards']
    assert prog.to_dict('records') == [dict(arm=plan.arms[0], epoch=0, part=f'1 of {k}', valid_ppl=330.3, secs=853.0),
                                       dict(arm=plan.arms[0], epoch=1, part=f'2 of {k}', valid_ppl=244.7, secs=3602.0)]
    rates = pd.read_csv(tmp_path/'out'/'rates.csv')
    assert len(rates) == len(plan.arms) * len(plan.lm_lrs) and rates.done.sum() == 1
    assert rates[rates.done].to_dict('records') == [dict(arm=plan.arms[0], lr=plan.lm_lrs[1], done=True, valid_loss=5.07,
                                                         valid_ppl=158.4, secs=519.0)]


def test_a_running_pretraining_is_carried_to_another_machine_from_the_command_line(tmp_path):
    ("`--snapshot DIR` copies the rate tries' and the pass's histories and the controls' records; "
     "`--start-from DIR` puts them under a new --out.")
    plan = PRETRAIN_STUDIES['ulmfit-imdb']
    run = tmp_path/'runs'/plan.name/plan.arms[0]
    (run/'lm').mkdir(parents=True); (run/'lm'/'history.csv').write_text('epoch,valid_loss,perplexity,time\n0,5.8,330.3,14:13\n')
    (run/'lm-rates'/'lr0.01').mkdir(parents=True)
    (run/'lm-rates'/'lr0.01'/'history.csv').write_text('epoch,valid_loss,perplexity,time\n0,5.07,158.4,08:39\n')
    (run/'lm-rates'/'lr0.001').mkdir(parents=True); (run/'lm-rates'/'lr0.001'/'history.csv').write_text('')  # not finished
    ctl = tmp_path/'runs'/f'{plan.name}-controls'/plan.arms[0]/'causal-from-scratch'/'seed0'       # a finished control
    ctl.mkdir(parents=True); (ctl/'results.json').write_text('{"valid_acc": 0.86}'); (ctl/'history.csv').write_text('')
    cli = [sys.executable, '-m', 'transject_nb.training.cli', 'study', plan.name]
    r = subprocess.run(cli + ['--out', str(tmp_path/'runs'), '--snapshot', str(tmp_path/'snap')], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'snapshot of ulmfit-imdb' in r.stdout and '3 files' in r.stdout     # the two histories and the control
    assert (tmp_path/'snap'/plan.arms[0]/'lm'/'history.csv').is_file()
    assert (tmp_path/'snap'/'controls'/ctl.relative_to(ctl.parents[2])/'results.json').is_file()   # its record only
    assert not (tmp_path/'snap'/'controls'/ctl.relative_to(ctl.parents[2])/'history.csv').exists()
    assert not (tmp_path/'snap'/plan.arms[0]/'lm-rates'/'lr0.001').exists()
    r = subprocess.run(cli + ['--out', str(tmp_path/'other'), '--start-from', str(tmp_path/'snap'), '--status'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '330.3' not in r.stdout                          # --status trains nothing and copies nothing
    r = subprocess.run(cli + ['--out', str(tmp_path/'runs'), '--snapshot', str(tmp_path/'runs'/plan.name/'s')],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and 'would be inside' in r.stderr


class _CrashInLastStage(Callback):
    "Raise after the first epoch of the schedule's stage `stage` (after its checkpoint is written)."
    order, _only_train_loop = TrainCheckpoint.order + 1, True
    def __init__(self, stage): self.stage = stage
    def after_epoch(self):
        if self.learn.train_checkpoint.fname == self.stage and self.epoch == 0: raise RuntimeError('simulated crash')


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_a_fine_tune_resumes_on_cuda(tmp_path):
    "A fine-tune on a GPU, crashed in its last stage, resumes there on the GPU: the optimiser state back on CUDA, the same stages."
    from transject_nb.training.tasks import load_task
    from transject_nb.training.learner import get_learner, train_learner
    data = load_task('listops', max_len=32, n_train=192, n_valid=64, n_test=64, cache_dir=False, progress=False,
                     min_length=4, max_length=32, max_depth=3, max_args=4)
    mk = lambda path, cbs=None: get_learner('listops', 'transformer', preset='cpu', data=data, path=path, device='cuda',
                                            d_model=16, n_layers=2, max_len=32, bs=32, epochs=1, lr=2e-3, cbs=cbs)
    src = train_learner(mk(tmp_path/'lm'), progress=False)              # the "pretrained" encoder, trained on the GPU
    sched = ulmfit_schedule(1e-2, len(layer_groups(src.model)), n_gradual=2, epochs_last=3, patience_last=5)
    last = f'stage{len(sched) - 1}'

    def tuned(path, cbs=None):
        torch.manual_seed(0); learn = mk(path, cbs); load_pretrained(learn, src.model); return learn
    def run(learn, **kw):
        with learn.no_bar(), learn.no_logging(): return fine_tune(learn, sched, **kw)
    whole = run(tuned(tmp_path/'whole'), resume=True)
    with pytest.raises(RuntimeError, match='simulated crash'): run(tuned(tmp_path/'cut', _CrashInLastStage(last)), resume=True)
    again, ck = tuned(tmp_path/'cut'), tmp_path/'cut'/'models'
    stamp = {p.name: p.stat().st_mtime_ns for p in ck.glob('stage*.pth')}
    resumed = run(again, resume=True)
    assert resumed.groups.tolist() == whole.groups.tolist() and resumed.epochs.tolist() == whole.epochs.tolist()
    assert {k for k, t in stamp.items() if (ck/k).stat().st_mtime_ns != t} == {f'{last}.pth'}   # only the cut stage trained
    np.testing.assert_allclose(resumed.valid_loss, whole.valid_loss, rtol=1e-3)   # CUDA kernels need not be bitwise alike
    state = [t for s in again.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state and all(t.device.type == 'cuda' for t in state)
    assert next(again.model.parameters()).device.type == 'cuda'


def test_the_status_names_the_classifiers_still_training(tmp_path):
    "A classifier with epochs and no results.json (a fine-tune in its third stage) is printed by `--status`, how far it got."
    plan = PRETRAIN_STUDIES['ulmfit-imdb']
    run = tmp_path/plan.name/plan.arms[0]/'ulmfit'/'seed1'
    (run/'models').mkdir(parents=True)
    for k in (0, 1, 2): (run/'models'/f'stage{k}.pth').write_bytes(b'')
    (run/'history.csv').write_text('epoch,train_loss,valid_loss,accuracy,time\n0,0.44,0.46,0.788,03:58\n1,0.41,0.45,0.791,04:02\n')
    r = subprocess.run([sys.executable, '-m', 'transject_nb.training.cli', 'study', plan.name, '--status', '--out', str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    row = r.stdout.split('classifiers training:\n')[1].splitlines()[1].split()
    assert row == ['0', plan.arms[0], 'ulmfit', 'seed', '1', 'NaN', '2', '2', '0.791', '8.0']   # stage 2, 2 epochs, 8 minutes


def test_the_controls_come_out_of_the_command_line(tmp_path):
    "A finished control (`run_controls`'s results.json) is printed by `--status` and written by `--export` (controls.csv)."
    import json
    import pandas as pd
    from transject_nb.lab.finetune_controls import PRETRAIN_CONTROLS
    plan = PRETRAIN_STUDIES['ulmfit-imdb']
    arm = next(v for v in plan.arms if plan.objective(v) == 'causal')
    f = tmp_path/'runs'/f'{plan.name}-controls'/arm/'causal-from-scratch'/'seed0'/'results.json'
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps(dict(seed=0, valid_acc=0.86, test_acc=0.85, lr=1e-3, epochs=5, max_epochs=40)))
    cli = [sys.executable, '-m', 'transject_nb.training.cli', 'study', plan.name, '--out', str(tmp_path/'runs')]
    r = subprocess.run(cli + ['--export', str(tmp_path/'out')], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '1 controls in controls.csv' in r.stdout and 'superseded.csv' not in r.stdout
    ctl = pd.read_csv(tmp_path/'out'/'controls.csv')
    assert ctl[['arm', 'control', 'valid_acc']].values.tolist() == [[arm, list(PRETRAIN_CONTROLS)[0], 0.86]]
    r = subprocess.run(cli + ['--status'], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and 'controls:' in r.stdout and 'causal from scratch' in r.stdout, r.stderr[-2000:]
    assert 'controls training:' not in r.stdout and 'set aside' not in r.stdout
    aside = f.parent.parent/'superseded'/'lr0.003-seed0'/'results.json'        # a control at a rate the search left
    aside.parent.mkdir(parents=True)
    aside.write_text(json.dumps(dict(seed=0, valid_acc=0.84, test_acc=0.83, lr=3e-3, epochs=5, max_epochs=40)))
    r = subprocess.run(cli + ['--export', str(tmp_path/'out')], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and '1 runs set aside in superseded.csv' in r.stdout, r.stderr[-2000:]
    assert pd.read_csv(tmp_path/'out'/'superseded.csv')[['arm', 'seed', 'lr']].values.tolist() == [[arm, 0, 3e-3]]
    assert len(pd.read_csv(tmp_path/'out'/'controls.csv')) == 1                # the control kept aside is not one of them
    r = subprocess.run(cli + ['--status'], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and 'set aside, trained again' in r.stdout, r.stderr[-2000:]
    run = f.parent.parent/'seed1'; run.mkdir()                                 # a control still training
    (run/'history.csv').write_text('epoch,train_loss,valid_loss,accuracy,time\n0,0.36,0.35,0.8460,18:30\n')
    r = subprocess.run(cli + ['--status'], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and 'controls training:' in r.stdout and '0.846' in r.stdout, r.stderr[-2000:]


def test_the_controls_are_refused_for_a_plan_that_does_not_pretrain(tmp_path):
    r = subprocess.run([sys.executable, '-m', 'transject_nb.training.cli', 'study', 'lm-neutreno', '--controls',
                        '--storage', str(tmp_path/'s.db')], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and 'it is for a pretraining plan' in r.stderr


def test_two_workers_share_a_pretraining_plan_an_arm_each(tmp_path):
    "A worker leaves an arm that another process holds, says which process, and trains nothing of it; bad --arms are refused."
    plan = PRETRAIN_STUDIES['ulmfit-imdb']
    (tmp_path/'data'/'imdb').mkdir(parents=True)
    arm = tmp_path/'runs'/plan.name/plan.arms[0]
    holder = subprocess.Popen([sys.executable, '-c', textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from transject_nb.lab.finetune_plans import _arm_claim
        with _arm_claim(Path(sys.argv[1])) as other:
            print('held' if other is None else other, flush=True); time.sleep(600)
        """), str(arm)], stdout=subprocess.PIPE, text=True)
    cli = [sys.executable, '-m', 'transject_nb.training.cli', 'study', plan.name, '--out', str(tmp_path/'runs'), '--data', str(tmp_path/'data')]
    try:
        assert holder.stdout.readline().strip() == 'held'
        r = subprocess.run(cli + ['--arms', plan.arms[0]], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"[{plan.name}] {plan.arms[0]}: process {holder.pid} is training it; left to it" in r.stdout
        assert [f.name for f in arm.iterdir()] == ['.lock']                       # nothing of it trained
    finally:
        holder.kill(); holder.wait()
    r = subprocess.run(cli + ['--arms', 'nope'], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "unknown arm 'nope'" in r.stderr
    r = subprocess.run(cli + ['--controls', '--arms', plan.arms[0]], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and 'takes no --arms' in r.stderr


def test_the_controls_table_judges_each_step_across_seeds():
    "Each step of the controls is a change in points with Welch's interval once the four classifiers share two seeds."
    import pandas as pd
    from scipy.stats import ttest_ind
    from transject_nb.lab.finetune_controls import CONTROL_STEPS, PRETRAIN_CONTROLS, controls_table
    acc = {'scratch': [.85, .86], 'ulmfit': [.80, .82]}
    runs = pd.DataFrame([dict(arm='t', kind=k, phase='seed', seed=s, lr=1e-3, valid_acc=a, test_acc=a)
                         for k, v in acc.items() for s, a in zip((1, 2), v)])
    c = list(PRETRAIN_CONTROLS)
    ctl = pd.DataFrame([dict(arm='t', control=k, seed=s, test_acc=a)
                        for k, v in zip(c, ([.83, .84], [.78, .79])) for s, a in zip((1, 2), v)])
    t = controls_table(ctl, runs).loc['t']
    assert list(t.index) == list(CONTROL_STEPS)
    mask = t.loc[CONTROL_STEPS[0]]
    assert abs(mask['change (points)'] - (83.5 - 85.5)) < 1e-9
    assert abs(mask.p - ttest_ind([.83, .84], [.85, .86], equal_var=False).pvalue) < 1e-9
    assert (t.lo <= t['change (points)']).all() and (t['change (points)'] <= t.hi).all()
    one = controls_table(ctl[ctl.seed == 1], runs).loc['t']           # one seed in common: no test
    assert one.p.isna().all() and one['change (points)'].notna().all()


RESULTS = Path(__file__).parent.parent/'nbs'/'results'/'lm'


@pytest.mark.parametrize('name', [n for n in PRETRAIN_STUDIES if (RESULTS/n/'state').is_dir()])
def test_a_committed_pretraining_export_is_its_snapshot_read_back(tmp_path, name):
    "Every committed pretraining plan's runs.csv is what its committed `state/` reads back as: no number by hand."
    import pandas as pd
    from transject_nb.lab.finetune_plans import _start_from
    from transject_nb.lab.finetune_search import pretrain_results
    plan = PRETRAIN_STUDIES[name]
    _start_from(plan, tmp_path, RESULTS/name/'state')
    back, runs = pretrain_results(plan, tmp_path), pd.read_csv(RESULTS/name/'runs.csv')
    assert len(back) == len(runs) > 0
    key, cols = ['arm', 'kind', 'phase', 'seed', 'lr'], list(runs.columns)
    tidy = lambda d: d[cols].sort_values(key).reset_index(drop=True).astype({'seed': float})
    pd.testing.assert_frame_equal(tidy(back), tidy(runs), check_dtype=False, atol=1e-6)
