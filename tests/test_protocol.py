"""The comparison protocol (`transject_nb.lab.protocol`) at tiny sizes: the search's edge rule, early stopping, two workers
sharing one storage, a worker killed mid-trial, the dashboard and the `study` command. No timing is asserted."""
import json, os, signal, subprocess, sys, textwrap, time, warnings
from dataclasses import replace
from pathlib import Path
import pandas as pd
import optuna
import pytest
import torch
warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated')
from transject_nb.lab.protocol import Arm, Protocol, StudyPlan, chosen_rate, next_trials
from transject_nb.lab.protocol_store import open_storage
from transject_nb.lab.protocol_workers import plan_data, work
from transject_nb.lab.protocol_results import arm_status, study_runs, study_trials
from transject_nb.lab.studies import STUDIES, CLASSIFICATION_STUDIES, study_plan, plan_cost, run_workers
from transject_nb.training.cli import run_command
from transject_nb.training.checkpoint import load_checkpoint

TINY = dict(n_train=300, n_valid=100, n_test=100, max_len=32, min_length=8, max_length=32, max_depth=3, max_args=4, d_model=16, n_layers=1)
PLAN = """
from transject_nb.lab.protocol import Protocol, StudyPlan
TINY = {tiny!r}
plan = StudyPlan('tiny', 'listops', {arms!r}, preset='cpu', fixed=TINY | {extra!r}, protocol=Protocol(lrs={lrs!r}, below=(), above=(), seeds={seeds!r}, epochs={epochs}, patience={patience}))
"""


def row(lr, value, state='COMPLETE', phase='search', seed=0): return dict(phase=phase, lr=lr, seed=seed, state=state, value=value)


def test_search_extends_past_an_edge_while_the_best_sits_there():
    p = Protocol(lrs=(1e-3, 1e-2), below=(1e-4, 1e-5), above=(3e-2, 1e-1), seeds=(1, 2, 3))
    assert [t['lr'] for t in next_trials([], p)] == [1e-3, 1e-2]
    rows = [row(1e-3, .4), row(1e-2, .5)]
    assert next_trials(rows, p) == [dict(phase='search', lr=3e-2, seed=0)]
    rows.append(row(3e-2, .6))
    assert next_trials(rows, p) == [dict(phase='search', lr=1e-1, seed=0)]
    rows.append(row(1e-1, .7))                      # still the best at the last rate allowed: the seeds run there
    assert next_trials(rows, p) == [dict(phase='seed', lr=1e-1, seed=s) for s in (1, 2, 3)]
    low = [row(1e-3, .6), row(1e-2, .5), row(1e-4, .7), row(1e-5, .65)]
    assert chosen_rate(low) == 1e-4 and next_trials(low, p)[0] == dict(phase='seed', lr=1e-4, seed=1)


def test_the_search_never_looks_at_a_pruned_or_running_run():
    p = Protocol(lrs=(1e-3, 1e-2), below=(1e-4,), above=(3e-2,), seeds=(1,))
    assert next_trials([row(1e-3, .4), row(1e-2, None, 'RUNNING')], p) == []
    assert chosen_rate([row(1e-3, .4), row(1e-2, .9, 'PRUNED')]) == 1e-3
    rows = [row(1e-3, .4), row(1e-2, .9, 'PRUNED'), row(1e-4, .3)]
    assert next_trials(rows, p) == [dict(phase='recheck', lr=1e-2, seed=0)]          # a pruned neighbour: run to its end
    assert next_trials(rows + [row(1e-2, .35, phase='recheck')], p) == [dict(phase='seed', lr=1e-3, seed=1)]
    far = [row(1e-3, .4), row(1e-2, .3), row(3e-2, .9, 'PRUNED'), row(1e-4, .3)]   # pruned, but not a neighbour
    assert next_trials(far, p) == [dict(phase='seed', lr=1e-3, seed=1)]


def test_a_recheck_that_wins_moves_the_choice_and_the_table():
    p = Protocol(lrs=(1e-3, 1e-2), below=(1e-4,), above=(3e-2,), seeds=(1, 2))
    rows = [row(1e-3, .6), row(1e-2, .4), row(1e-4, .3, 'PRUNED')] + [row(1e-3, .6, phase='seed', seed=s) for s in (1, 2)]
    assert next_trials(rows, p) == [dict(phase='recheck', lr=1e-4, seed=0)]        # even after the seeds ran
    rows.append(row(1e-4, .7, phase='recheck'))
    assert chosen_rate(rows) == 1e-4
    assert next_trials(rows, p) == [dict(phase='seed', lr=1e-4, seed=s) for s in (1, 2)]
    rows += [row(1e-4, .7, phase='seed', seed=s) for s in (1, 2)]
    assert next_trials(rows, p) == []
    plan = StudyPlan('x', 'listops', ('transject',), protocol=p)
    t = pd.DataFrame([dict(r, task='listops', arm='transject', variant='transject', test_acc=.5, best_epoch=1, epochs=3,
                           train_secs=1., params=10, data_key='k', number=i, retry_of=None) for i, r in enumerate(rows)])
    assert arm_status(t, plan).loc['transject', 'state'] == 'done'
    assert list(study_runs(t, plan).lr) == [1e-4, 1e-4]                          # the overturned seeds leave the table
    assert arm_status(t.iloc[:-2], plan).loc['transject', 'state'] == 'seeds'              # the recheck won: seeds again
    assert arm_status(t.iloc[:-3], plan).loc['transject', 'state'] == 'search'             # a recheck is due


def test_bad_plans_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match="is one of the seeds"): Protocol(search_seed=1)
    with pytest.raises(ValueError, match="not above the grid's highest rate"): Protocol(above=(1e-3,))
    with pytest.raises(ValueError, match="which the protocol sets"): StudyPlan('x', 'listops', ('transject',), fixed=dict(epochs=3))
    with pytest.raises(ValueError, match="repeated arm labels"): StudyPlan('x', 'listops', ('transject', Arm('transject')))
    with pytest.raises(ValueError, match="fair-imdb"): study_plan('imdb')


def test_declared_plans_cover_every_task_and_variant():
    from transject_nb.presets import TASKS
    from transject_nb.models import VARIANTS
    assert {p.task for p in CLASSIFICATION_STUDIES.values()} == set(TASKS)
    for p in CLASSIFICATION_STUDIES.values():
        assert set(VARIANTS) <= {a.label for a in p.arms}
    for p in CLASSIFICATION_STUDIES.values(): assert len(p.protocol.seeds) >= 3
    assert len(STUDIES["lm-neutreno"].protocol.seeds) == 3 and all(len(p.protocol.seeds) >= 2 for p in STUDIES.values())
    lm = {n: p for n, p in STUDIES.items() if p.objective}
    assert {a.variant for a in lm['mlm-depth'].arms} == set(VARIANTS)                # TransJect's four as masked language models
    assert len({(p.fixed['n_train'], p.fixed['max_len']) for p in lm.values()}) == 1   # one corpus and context for every language model
    assert lm['lm-neutreno'].arm('neutreno+lam=0.4+n_layers=4').overrides == dict(lam=0.4, n_layers=4)   # the authors' LM λ


def test_a_worker_runs_a_plan_and_early_stopping_fires(tmp_path):
    plan = StudyPlan('tiny', 'listops', ('transformer', 'transject'), preset='cpu', fixed=TINY,
                     protocol=Protocol(lrs=(1e-3, 3e-2), below=(), above=(), seeds=(1, 2), epochs=12, patience=1))
    st = open_storage(tmp_path/'s.db')
    n = work(plan, st, out=tmp_path/'runs', cache_dir=False, poll=0.2, progress=False)
    t = study_trials(plan, st)
    assert n == len(t) == 8
    assert set(arm_status(t, plan).state) == {'done'}
    fin = t[t.state == 'COMPLETE']
    assert (fin.epochs < 12).mean() >= 0.5                                  # the budget is not what stopped them
    runs = study_runs(t, plan)
    assert len(runs) == 4 and runs.test_acc.notna().all() and set(runs.seed) == {1, 2}
    assert t[t.phase == 'search'].test_acc.isna().all()                     # the search never touches the test set
    assert plan_cost(plan, t).runs_left.sum() == 0
    assert plan_data(plan, cache_dir=False).cache_key == t.data_key.iloc[0]      # the baselines' splits are the runs'


def _spawn(script:str, *args)->subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore')
    return subprocess.Popen([sys.executable, '-c', script, *map(str, args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_workers_sharing_one_storage_never_run_the_same_trial_twice(tmp_path):
    plan_src = PLAN.format(tiny=TINY, arms=('transformer', 'transject'), extra={}, lrs=(1e-3, 3e-3, 1e-2), seeds=(1, 2, 3), epochs=3, patience=2)
    script = plan_src + textwrap.dedent("""
        import sys
        from transject_nb.lab.protocol_store import open_storage
        from transject_nb.lab.protocol_workers import work
        work(plan, open_storage(sys.argv[1], heartbeat=2), out=sys.argv[2], cache_dir=False, poll=0.2, name=sys.argv[3])
        """)
    ps = [_spawn(script, tmp_path/'s.db', tmp_path/'runs', f'w{i}') for i in (1, 2)]
    logs = [p.communicate(timeout=600)[0] for p in ps]
    if any(p.returncode for p in ps): pytest.fail('\n\n'.join(logs), pytrace=False)     # the workers' whole logs
    ns = {}; exec(plan_src, ns); plan = ns['plan']
    t = study_trials(plan, tmp_path/'s.db')
    assert '[w1]' in logs[0] and '[w2]' in logs[1]                         # both workers ran trials
    done = t[t.state.isin(['COMPLETE', 'PRUNED'])]
    assert not done.duplicated(['arm', 'lr', 'seed']).any()
    assert len(done) == 2 * (3 + 3)
    assert set(arm_status(t, plan).state) == {'done'}


def test_a_worker_killed_mid_trial_is_retried_and_resumes(tmp_path):
    plan_src = PLAN.format(tiny=TINY, arms=('transject',), extra=dict(n_train=3000), lrs=(1e-2, 3e-2), seeds=(1,), epochs=6, patience=5)
    script = plan_src + textwrap.dedent("""
        import sys
        from transject_nb.lab.protocol_store import open_storage
        from transject_nb.lab.protocol_workers import work
        work(plan, open_storage(sys.argv[1], heartbeat=1, grace=3), out=sys.argv[2], cache_dir=False, poll=0.2)
        """)
    p = _spawn(script, tmp_path/'s.db', tmp_path/'runs')
    ns = {}; exec(plan_src, ns); plan = ns['plan']
    def saved_epoch():
        "The last epoch the run's checkpoint holds (-1: none yet); the history is written before the checkpoint."
        for f in (tmp_path/'runs').rglob('checkpoint.pth'):
            try: return load_checkpoint(f)['epoch']
            except (EOFError, RuntimeError, FileNotFoundError): pass          # replaced while being read: try again
        return -1
    t0 = time.time()
    while saved_epoch() < 1 and time.time() - t0 < 300 and p.poll() is None: time.sleep(0.2)   # two epochs saved
    assert p.poll() is None, p.communicate()[0]                              # still training when killed
    p.send_signal(signal.SIGKILL); p.wait()
    t = study_trials(plan, tmp_path/'s.db')
    killed = t[t.state == 'RUNNING']
    assert len(killed) == 1
    time.sleep(4)                                                           # past the grace period: the trial is stale
    work(plan, open_storage(tmp_path/'s.db', heartbeat=1, grace=3), out=tmp_path/'runs', cache_dir=False, poll=0.2, progress=False)
    t = study_trials(plan, tmp_path/'s.db').set_index('number')
    k = int(killed.number.iloc[0])
    assert t.loc[k, 'state'] == 'FAIL'
    retry = t[t.retry_of == k]
    assert len(retry) == 1 and retry.state.iloc[0] == 'COMPLETE'
    assert (retry.lr.iloc[0], retry.seed.iloc[0]) == (killed.lr.iloc[0], killed.seed.iloc[0])
    from transject_nb.lab.protocol_store import arm_study
    tr = [x for x in arm_study(plan, plan.arms[0], open_storage(tmp_path/'s.db')).trials if x.number == int(retry.index[0])][0]
    assert tr.user_attrs['resumed_at'] >= 2                                 # went on from the killed run's checkpoint
    st = arm_status(study_trials(plan, tmp_path/'s.db'), plan)
    assert set(st.state) == {'done'} and st.retried.sum() == 1 and st.failed.sum() == 0   # retried, not failed for good


def test_a_worker_rides_out_a_few_storage_errors_and_not_more(tmp_path, capsys):
    from optuna.storages import RDBStorage
    from transject_nb.lab import protocol_workers
    class Flaky(RDBStorage):
        "A storage that refuses its next `fails` calls to open a study, as a locked SQLite file refuses a write."
        fails = 2
        def create_new_study(self, *a, **k):
            if self.fails:
                self.fails -= 1
                raise optuna.exceptions.StorageInternalError('(sqlite3.OperationalError) database is locked')
            return super().create_new_study(*a, **k)
    plan = StudyPlan('tiny', 'listops', ('transject',), preset='cpu', fixed=TINY,
                     protocol=Protocol(lrs=(1e-2,), below=(), above=(), seeds=(1,), epochs=2, patience=1))
    st = Flaky(f"sqlite:///{tmp_path/'s.db'}")
    assert work(plan, st, out=tmp_path/'runs', cache_dir=False, poll=0.01) == 2
    out = capsys.readouterr().out
    assert out.count('the storage failed (StorageInternalError: (sqlite3.OperationalError) database is locked)') == 2
    assert set(arm_status(study_trials(plan, st), plan).state) == {'done'}
    st2 = Flaky(f"sqlite:///{tmp_path/'s2.db'}")
    st2.fails = protocol_workers.STORAGE_RETRIES + 1                                # one too many in a row: the worker stops
    with pytest.raises(optuna.exceptions.StorageInternalError, match='database is locked'):
        work(plan, st2, out=tmp_path/'runs2', cache_dir=False, poll=0.01)


def test_a_run_that_a_storage_error_cut_short_is_queued_again_and_resumes(tmp_path, capsys):
    "A storage error inside the run (the pruner's report) fails its trial, not the run: its retry resumes the epochs."
    from optuna.storages import RDBStorage
    from transject_nb.lab.protocol_store import arm_study
    class Flaky(RDBStorage):
        "A storage that refuses the run's second report, as a locked SQLite file refuses a write."
        reports = 0
        def set_trial_intermediate_value(self, *a, **k):
            self.reports += 1
            if self.reports == 2: raise optuna.exceptions.StorageInternalError('database is locked')
            return super().set_trial_intermediate_value(*a, **k)
    plan = StudyPlan('tiny', 'listops', ('transject',), preset='cpu', fixed=TINY,
                     protocol=Protocol(lrs=(1e-2,), below=(), above=(), seeds=(1,), epochs=3, patience=2))
    st = Flaky(f"sqlite:///{tmp_path/'s.db'}")
    work(plan, st, out=tmp_path/'runs', cache_dir=False, poll=0.01)
    out = capsys.readouterr().out
    assert 'the storage failed (StorageInternalError: Exception occured in `FastAIV2PruningCallback` when calling event `after_epoch`: database is locked)' in out
    assert "failed on the storage's error; queued again, its retry resumes the run" in out
    t = study_trials(plan, st)
    assert set(arm_status(t, plan).state) == {'done'}                       # no run left for --retry-failed
    [cut] = t[t.state == 'FAIL'].number
    retry = t[t.retry_of == cut]
    assert len(retry) == 1 and retry.state.iloc[0] == 'COMPLETE' and retry.epochs.iloc[0] == 3
    [rt] = [x for x in arm_study(plan, plan.arms[0], st).trials if x.number == retry.number.iloc[0]]
    assert rt.user_attrs['resumed_at'] == 1                                  # the epoch saved before the error
    ck = load_checkpoint(Path(rt.user_attrs['run_dir'])/'models'/'checkpoint.pth')
    assert len(ck['values']) == 3                                            # each epoch once


@pytest.mark.filterwarnings('ignore::optuna.exceptions.ExperimentalWarning')
def test_a_worker_whose_trial_was_taken_over_leaves_it_to_the_retry(tmp_path):
    "A live worker whose heartbeat went stale (a paused machine): another fails its trial; it stops, before saving."
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from transject_nb.lab.protocol_store import arm_study
    plan_src = PLAN.format(tiny=TINY, arms=('transject',), extra=dict(n_train=3000), lrs=(1e-2,), seeds=(1,), epochs=8, patience=7)
    script = plan_src + textwrap.dedent("""
        import sys
        from transject_nb.lab.protocol_store import open_storage
        from transject_nb.lab.protocol_workers import work
        work(plan, open_storage(sys.argv[1], heartbeat=1, grace=3), out=sys.argv[2], cache_dir=False, poll=0.2, name='w1')
        """)
    p = _spawn(script, tmp_path/'s.db', tmp_path/'runs')
    ns = {}; exec(plan_src, ns); plan = ns['plan']
    def saved_epoch():
        for f in (tmp_path/'runs').rglob('checkpoint.pth'):
            try: return load_checkpoint(f)['epoch']
            except (EOFError, RuntimeError, FileNotFoundError): pass
        return -1
    t0 = time.time()
    while saved_epoch() < 1 and time.time() - t0 < 300 and p.poll() is None: time.sleep(0.1)
    assert p.poll() is None, p.communicate()[0]
    st = open_storage(tmp_path/'s.db', heartbeat=1, grace=3)
    study = arm_study(plan, plan.arms[0], st)
    [tr] = study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    st.set_trial_state_values(tr._trial_id, optuna.trial.TrialState.FAIL)          # what `fail_stale_trials` does
    RetryHeartbeatStaleTrialCallback(max_retry=3, inherit_intermediate_values=True)(study, st.get_trial(tr._trial_id))
    log = p.communicate(timeout=600)[0]
    assert p.returncode == 0, log
    assert f'trial {tr.number} was taken over by another worker' in log
    t = study_trials(plan, tmp_path/'s.db').set_index('number')
    assert t.loc[tr.number, 'state'] == 'FAIL' and pd.isna(t.loc[tr.number, 'epochs'])   # it recorded nothing after
    retry = t[t.retry_of == tr.number]
    assert len(retry) == 1 and retry.state.iloc[0] == 'COMPLETE' and retry.epochs.iloc[0] == 8
    [rt] = [x for x in arm_study(plan, plan.arms[0], st).trials if x.number == int(retry.index[0])]
    assert rt.user_attrs['resumed_at'] >= 2                                  # went on from the run's saved epochs
    ck = load_checkpoint(Path(rt.user_attrs['run_dir'])/'models'/'checkpoint.pth')
    assert len(ck['values']) == len(ck['times']) == 8                       # each epoch once: none trained twice
    assert set(arm_status(study_trials(plan, tmp_path/'s.db'), plan).state) == {'done'}


def test_the_dashboard_serves_the_studies(tmp_path):
    pytest.importorskip('optuna_dashboard')
    from optuna_dashboard import wsgi
    from wsgiref.util import setup_testing_defaults
    plan = StudyPlan('tiny', 'listops', ('transject',), preset='cpu', fixed=TINY, protocol=Protocol(lrs=(1e-2,), below=(), above=(), seeds=(1,), epochs=2, patience=1))
    st = open_storage(tmp_path/'s.db')
    from transject_nb.lab.protocol_store import queue_next
    queue_next(plan, plan.arms[0], st)
    env = {'PATH_INFO': '/api/studies', 'REQUEST_METHOD': 'GET'}; setup_testing_defaults(env)
    out = {}
    body = b''.join(wsgi(st)(env, lambda status, headers, exc_info=None: out.setdefault('status', status)))
    assert out['status'].startswith('200') and b'tiny/transject' in body


def test_the_study_command_says_where_a_plan_stands(tmp_path, capsys):
    st = run_command(['study', 'fair-listops', '--status', '--storage', str(tmp_path/'s.db')])
    assert set(st.state) == {'not started'} and len(st) == len(STUDIES['fair-listops'].arms)
    assert 'fair-listops: listops' in capsys.readouterr().out
    with pytest.raises(SystemExit): run_command(['study', 'fair-listops', '--lr', '1e-3'])
    with pytest.raises(SystemExit): run_command(['study', 'fair-mnist'])


def test_the_committed_tables_are_the_committed_storages():
    "Each exported runs.csv of nbs/results/fair is what the committed snapshot of the Optuna storage gives for its plan."
    fair = Path(__file__).parent.parent/'nbs'/'results'/'fair'
    if not (fair/'studies.db').is_file(): pytest.skip('no committed study yet')
    done = [p for p in CLASSIFICATION_STUDIES.values() if (fair/p.task/'runs.csv').is_file()]
    assert done, 'a snapshot without any exported plan'
    for p in done:
        t = study_trials(p, fair/'studies.db')                            # exported from the snapshot: unfinished plans too
        got = study_runs(t, p).sort_values(['variant', 'seed']).reset_index(drop=True)
        kept = pd.read_csv(fair/p.task/'runs.csv').sort_values(['variant', 'seed']).reset_index(drop=True)
        pd.testing.assert_frame_equal(got[['variant', 'seed', 'lr', 'epochs']], kept[['variant', 'seed', 'lr', 'epochs']], check_dtype=False)
        assert (got.test_acc - kept.test_acc).abs().max() < 1e-9


def test_workers_opening_a_fresh_storage_together_all_succeed(tmp_path):
    "Several processes create the same new SQLite storage at once (workers started by hand, or on several machines): none fails."
    script = textwrap.dedent("""
        import sys, time
        from transject_nb.lab.protocol_store import open_storage
        time.sleep(max(0., float(sys.argv[2]) - time.time()))           # start together
        open_storage(sys.argv[1])
        """)
    start = time.time() + 8
    ps = [_spawn(script, tmp_path/'fresh.db', start) for _ in range(4)]
    logs = [p.communicate(timeout=300)[0] for p in ps]
    assert [p.returncode for p in ps] == [0] * 4, logs


def _pruned_step(pruner, values, maximize=True):
    "The step at which `pruner` stops a run reporting `values`, after two finished runs climbing to 0.7 (None: never)."
    s = optuna.create_study(direction='maximize' if maximize else 'minimize', pruner=pruner)
    for _ in range(2):
        t = s.ask()
        for step, v in enumerate((.5, .6, .7, .7, .7)): t.report(v if maximize else 1 - v, step)
        s.tell(t, .7 if maximize else .3)
    t = s.ask()
    for step, v in enumerate(values):
        t.report(v, step)
        if t.should_prune(): return step
    return None


def test_the_patient_pruner_never_stops_a_slow_run_while_it_improves():
    slow = (.3, .4, .45, .5, .49)                       # behind the finished runs at every epoch
    assert _pruned_step(Protocol().pruner(), slow) == 1                         # the median rule: at its second epoch
    assert _pruned_step(Protocol(prune_patience=0).pruner(), slow) == 4         # patient: once it stalls
    assert _pruned_step(Protocol(prune_patience=1).pruner(), slow + (.48,)) is None  # k = 1: two epochs without gain...
    assert _pruned_step(Protocol(prune_patience=1).pruner(), (.3, .4, .45, .44, .43)) == 4  # ... at step 4, not 3
    assert _pruned_step(Protocol(prune_patience=0).pruner(), (.7, .6, .55, .56), maximize=False) == 3
    # the classification plans are declared as they ran, with the median rule; the language-model plans are patient
    assert all(p.protocol.prune_patience is None for n, p in STUDIES.items() if p.objective is None)
    assert all(p.protocol.prune_patience == 0 for n, p in STUDIES.items() if p.objective is not None)
    with pytest.raises(ValueError, match="prune_patience must be an int >= 0"): Protocol(prune_patience=1.5)


@pytest.mark.parametrize('folder', ['fair', 'lm'])
def test_the_committed_trials_are_the_committed_storages(folder):
    "Each exported trials.csv (the pages' status, cost and rechecks) is what the committed snapshot beside it holds."
    root = Path(__file__).parent.parent/'nbs'/'results'/folder
    if not (root/'studies.db').is_file(): pytest.skip('no committed study yet')
    plans = [(p, root/(p.task if folder == 'fair' else p.name))
             for p in (CLASSIFICATION_STUDIES if folder == 'fair' else STUDIES).values()
             if (p.objective is None) == (folder == 'fair')]
    plans = [(p, d) for p, d in plans if (d/'trials.csv').is_file()]
    assert plans, 'a snapshot without any exported plan'
    cols = ['arm', 'phase', 'lr', 'seed', 'state', 'epochs']
    for p, d in plans:
        db = root/p.snapshot_name()                                    # a GPU plan's snapshot is its own
        key = lambda df: df[cols].sort_values(cols[:-1]).reset_index(drop=True)
        pd.testing.assert_frame_equal(key(study_trials(p, db)), key(pd.read_csv(d/'trials.csv')), check_dtype=False)
    if folder == 'lm':                                                             # the GPU table ran, and on a GPU
        assert any(p.device == 'cuda' for p, _ in plans)
        gpu = pd.read_csv(root/'lm-depth-gpu'/'runs.csv')
        assert len(gpu) and set(gpu.data_key) == {json.loads((root/'corpus.json').read_text())['key']}   # the CPU plans' corpus


def test_a_gpu_plan_refuses_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    with pytest.raises(ValueError, match="sized for a GPU"): run_workers(STUDIES['lm-depth-gpu'], tmp_path/'s.db', tmp_path)
    with pytest.raises(ValueError, match="sized for a GPU"): work(STUDIES['lm-depth-gpu'], tmp_path/'s.db', tmp_path)
    with pytest.raises(ValueError, match="device must be None"): replace(STUDIES['lm-depth'], device='tpu')


def test_a_storage_started_from_a_snapshot_appears_whole(tmp_path, monkeypatch, capsys):
    "--start-from copies the snapshot beside the storage and puts it in place once whole: a worker started beside it never opens a partial file."
    import filecmp, shutil
    snap, url, seen = Path(__file__).parent.parent/'nbs'/'results'/'lm'/'studies.db', tmp_path/'runs'/'lm.db', []
    copyfile = shutil.copyfile
    def watched(src, dst, **kw):
        out = copyfile(src, dst, **kw); seen.append(url.exists()); return out   # is the storage there while it is written?
    monkeypatch.setattr(shutil, 'copyfile', watched)
    cmd = ['study', 'lm-neutreno', '--storage', str(url), '--start-from', str(snap), '--status']
    run_command(cmd)
    assert seen == [False] and filecmp.cmp(snap, url, shallow=False)
    first = capsys.readouterr().out
    assert f'started from {snap}' in first
    run_command(cmd)                                                          # there already: kept, not copied again
    again = capsys.readouterr().out
    assert seen == [False] and 'started from' not in again and again in first
    assert sorted(p.name for p in url.parent.iterdir()) == ['lm.db']           # no temporary left


def test_an_extension_copies_its_base_run_and_never_touches_a_saved_one(tmp_path):
    "An extending plan's run starts from a copy of its base's: the base run is left as it was, and a run of its own is never copied over."
    from transject_nb.training.checkpoint import CKPT_VERSION
    from transject_nb.lab.protocol_workers import _start_from_base
    base = StudyPlan('b', 'listops', ('transformer',), preset='cpu', fixed=TINY, protocol=Protocol(epochs=3, patience=1))
    ext = replace(base, name='e', protocol=replace(base.protocol, epochs=6), extends=base)
    arm = base.arms[0]
    src = base.run_dir(tmp_path, arm, 1e-3, 0)
    (src/'models').mkdir(parents=True)
    torch.save(dict(version=CKPT_VERSION, epoch=2, times=[1.0, 2.0, 3.5]), src/'models'/'checkpoint.pth')
    (src/'history.csv').write_text('epoch\n0\n1\n2\n')
    files = lambda d: {p.relative_to(d): p.read_bytes() for p in d.rglob('*') if p.is_file()}
    before = files(src)
    assert _start_from_base(ext, arm, 1e-3, 0, 'search', tmp_path) == src
    dest = ext.run_dir(tmp_path, arm, 1e-3, 0)
    assert json.loads((dest/'started_from.json').read_text()) == dict(plan='b', run=str(src), epochs=3, secs=6.5)
    assert files(src) == before and {k: v for k, v in files(dest).items() if k.name != 'started_from.json'} == before
    (dest/'models'/'checkpoint.pth').write_bytes(b'its own progress')                 # the extension trained on
    assert _start_from_base(ext, arm, 1e-3, 0, 'search', tmp_path) is None            # ... so it is never copied over
    assert (dest/'models'/'checkpoint.pth').read_bytes() == b'its own progress'
    assert _start_from_base(ext, arm, 1e-2, 0, 'search', tmp_path) is None            # no base run: it starts afresh
    assert _start_from_base(ext, arm, 1e-3, 0, 'recheck', tmp_path) is None           # another phase's folder
    assert _start_from_base(base, arm, 1e-3, 0, 'search', tmp_path) is None           # a plan that extends nothing
    assert not [p for p in tmp_path.rglob('*.copying')]


# --- a study's faults (issue 60): one line each, and nothing saved before them changed ----------------------------

def _fails(argv, capsys, code)->str:
    "The last line `run_command(argv)` prints on stderr, once it exits with `code`; no traceback."
    with pytest.raises(SystemExit) as e: run_command(argv)
    err = capsys.readouterr().err
    assert e.value.code == code and 'Traceback' not in err, err
    return err.strip().splitlines()[-1]


def test_a_damaged_storage_or_an_unknown_arm_is_refused_in_one_line(tmp_path, capsys):
    garbage = tmp_path/'s.db'; garbage.write_bytes(b'\x00garbage ' * 1000); before = garbage.read_bytes()
    said = _fails(['study', 'fair-listops', '--status', '--storage', str(garbage)], capsys, 2)
    assert f'storage {garbage} is damaged (file is not a database): restore it from a snapshot (--start-from)' in said, said
    new = tmp_path/'new.db'
    said = _fails(['study', 'fair-listops', '--status', '--storage', str(new), '--start-from', str(garbage)], capsys, 2)
    assert f'--start-from {garbage} is damaged' in said, said
    assert not new.exists() and sorted(p.name for p in tmp_path.iterdir()) == ['s.db']    # no damaged copy, no temporary
    said = _fails(['study', 'fair-listops', '--storage', str(new), '--arms', 'transject,bert'], capsys, 2)
    assert "unknown arm 'bert'; valid arms are: transject" in said and not new.exists()  # refused before any worker
    assert garbage.read_bytes() == before


def test_a_failed_worker_fails_the_study_in_one_line(tmp_path, capfd):
    "A worker that fails (here: no data where --data points) says why in one line; the study then fails in one line."
    with pytest.raises(SystemExit) as e:
        run_command(['study', 'fair-imdb', '--storage', str(tmp_path/'s.db'), '--out', str(tmp_path/'runs'),
                     '--data', str(tmp_path/'nowhere'), '--cache-dir', 'none'])
    out, err = capfd.readouterr()
    assert e.value.code == 1 and 'Traceback' not in out + err, out + err
    assert f"[w1] failed: FileNotFoundError: no folder {tmp_path/'nowhere'/'imdb'} for task 'imdb'" in err, err
    assert err.strip().splitlines()[-1] == ("transject-nb study: error: worker(s) w1 ended with exit code(s) 1 (each said "
                                            "why above); the storage keeps every finished trial, and the same command "
                                            "resumes; run it again with --debug to see where it failed")
    assert study_trials(STUDIES['fair-imdb'], tmp_path/'s.db').empty                    # nothing was queued


STOPPABLE = """
import sys
from transject_nb.lab.protocol import Protocol, StudyPlan
from transject_nb.lab.studies import STUDIES
TINY = {tiny!r}
plan = StudyPlan('tiny-stop', 'listops', ('transject',), preset='cpu', fixed=TINY | dict(n_train=3000),
                 protocol=Protocol(lrs=(1e-2,), below=(), above=(), seeds=(1,), epochs=6, patience=5))
STUDIES[plan.name] = plan                   # declared here, and in each worker: spawn imports this file as its main
if __name__ == '__main__':
    from transject_nb.training.cli import main
    main(['study', plan.name, *sys.argv[1:]])
"""


def test_a_study_stops_with_its_workers_and_starts_again_at_once(tmp_path):
    "SIGTERM stops the study and its worker gracefully; a SIGKILL of the study alone still stops its worker (it dies with its parent); a SIGKILL of both leaves a trial that the next start queues again at once. Each stop queues the running trial again, and its retry resumes the saved epochs."
    from transject_nb.lab.protocol_store import _alive, arm_study
    script = tmp_path/'study.py'; script.write_text(STOPPABLE.format(tiny=TINY))
    ns = {}; exec(STOPPABLE.format(tiny=TINY).replace("__name__ == '__main__'", 'False'), ns); plan = ns['plan']
    db, runs = tmp_path/'s.db', tmp_path/'runs'
    def start(**kw):
        env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore')
        return subprocess.Popen([sys.executable, str(script), '--storage', str(db), '--out', str(runs), '--cache-dir', 'none'],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    def trials(): return {t.number: t for t in arm_study(plan, plan.arms[0], open_storage(db)).get_trials()}
    def running(p, saved:int=-1):
        "Poll (generously, never as a timing) until a trial runs, owned by a worker, with more than `saved` epochs saved."
        t0 = time.time()
        while time.time() - t0 < 600 and p.poll() is None:
            if db.exists():
                for t in trials().values():
                    ck = Path(t.user_attrs.get('run_dir', '-'))/'models'/'checkpoint.pth'
                    if t.state.name == 'RUNNING' and 'owner' in t.system_attrs and ck.exists():
                        try:
                            if load_checkpoint(ck)['epoch'] > saved: return t, load_checkpoint(ck)
                        except (ValueError, FileNotFoundError): pass
            time.sleep(0.2)
        pytest.fail(f'no trial ran: {p.communicate()[0] if p.poll() is not None else "still starting"}')
    # 1. SIGTERM: the study passes it on, its worker stops gracefully, the trial is queued again
    p = start(); first, ck = running(p)
    p.send_signal(signal.SIGTERM); log = p.communicate(timeout=600)[0]
    assert p.returncode == 128 + signal.SIGTERM and 'Traceback' not in log, log
    assert '[w1] stopped by SIGTERM; its trial is queued again' in log, log
    assert log.strip().splitlines()[-1] == ('transject-nb study: stopped by SIGTERM: the running trials are queued '
                                            'again, and the same command resumes'), log
    ts = trials(); [r1] = [t for t in ts.values() if t.system_attrs.get('failed_trial') == first.number]
    assert ts[first.number].state.name == 'FAIL' and r1.state.name == 'WAITING' and r1.params == first.params
    run = Path(first.user_attrs['run_dir'])/'models'/'checkpoint.pth'
    assert load_checkpoint(run)['epoch'] >= ck['epoch']                     # the saved epochs kept
    # 2. SIGKILL of the study alone: its worker dies with it, gracefully, and queues the trial again
    p = start(); second, ck = running(p, saved=load_checkpoint(run)['epoch'])   # once it has trained on
    assert second.number == r1.number
    p.kill(); log = p.communicate(timeout=600)[0]                             # returns once the worker has closed its output
    assert '[w1] stopped by SIGTERM; its trial is queued again' in log, log
    ts = trials(); [r2] = [t for t in ts.values() if t.system_attrs.get('retry_history', [])[-1:] == [r1.number]]
    assert ts[r1.number].state.name == 'FAIL' and r2.state.name == 'WAITING'
    # 3. SIGKILL of the study and its worker together: nobody marks the trial
    p = start(start_new_session=True); third, ck = running(p, saved=load_checkpoint(run)['epoch'])
    os.killpg(p.pid, signal.SIGKILL); p.communicate(timeout=600)
    t0 = time.time()
    while _alive(third.system_attrs['owner']) and time.time() - t0 < 120: time.sleep(0.2)   # the kernel reaps it
    assert not _alive(third.system_attrs['owner']) and trials()[third.number].state.name == 'RUNNING'
    # 4. the next start queues it again at once, not after the heartbeat's grace period (two minutes here), and finishes
    p = start(); log = p.communicate(timeout=900)[0]
    assert p.returncode == 0, log
    assert f'tiny-stop/transject trial {third.number} was left running by a worker that is gone' in log, log
    ts = trials(); [r3] = [t for t in ts.values() if t.system_attrs.get('retry_history', [])[-1:] == [third.number]]
    assert ts[third.number].state.name == 'FAIL' and r3.state.name == 'COMPLETE' and r3.user_attrs['resumed_at'] >= 1
    assert r3.system_attrs['failed_trial'] == first.number                   # one run, retried three times
    done = load_checkpoint(run)
    assert done['done'] and len(done['values']) == len(done['times'])        # each epoch once
    assert set(arm_status(study_trials(plan, db), plan).state) == {'done'}


def test_sigterm_stops_a_study_as_a_stop_not_an_error():
    "In the main thread, `_stopping_on_sigterm` turns SIGTERM into `utils.Stopped`, which `except Exception` lets through, and puts the handler back."
    from transject_nb.training.utils import Stopped
    from transject_nb.lab.studies import _stopping_on_sigterm
    caught, before = [], signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped, match='stopped by SIGTERM') as e, _stopping_on_sigterm():
        try: os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)          # the handler runs as the kill returns
        except Exception as x: caught.append(x)
    assert e.value.status == 143 and caught == []
    assert signal.getsignal(signal.SIGTERM) == before
