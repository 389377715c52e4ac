"""The comparison protocol on a real PostgreSQL server (`transject_nb.lab.protocol_store`, "Across machines"): a throwaway
cluster (`initdb` and `pg_ctl` from Debian's `postgresql` package, in a temporary folder, on a free port) serves the
storage of tiny studies. Workers that share it never race into failed trials, each planned run completes once with
the values a SQLite storage gives, a worker killed mid-trial is retried, and the queue's lock is a row lock in the
database itself, which holds for workers on several machines.

Skipped where the server's programs or the `psycopg` driver are missing, unless TRANSJECT_NB_REQUIRE_TOOLS=1 (as
`.ci/run` sets after `apt-get install postgresql`), when it fails. initdb and postgres refuse to run as root: run as
root, the cluster runs as `nobody`. No timing is asserted: every wait polls for its condition."""
import glob, os, pwd, shutil, signal, socket, subprocess, sys, tempfile, textwrap, time, warnings
from contextlib import contextmanager
from pathlib import Path
import pandas as pd
import pytest
import torch
warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated')
from transject_nb.training.checkpoint import load_checkpoint
from transject_nb.training.cli import run_command
from transject_nb.lab.protocol_store import QueueLock, arm_study, open_storage
from transject_nb.lab.protocol_workers import work
from transject_nb.lab.protocol_results import arm_status, study_runs, study_trials

REQUIRED = os.environ.get('TRANSJECT_NB_REQUIRE_TOOLS') == '1'      # .ci/run: no skipping
TINY = dict(n_train=300, n_valid=100, n_test=100, max_len=32, min_length=8, max_length=32, max_depth=3, max_args=4,
            d_model=16, n_layers=1)
PLAN = """
from transject_nb.lab.protocol import Protocol, StudyPlan
plan = StudyPlan('tiny', 'listops', {arms!r}, preset='cpu', fixed={fixed!r},
                 protocol=Protocol(lrs={lrs!r}, below=(), above=(), seeds={seeds!r}, epochs={epochs},
                                   patience={patience}, prune_warmup={epochs}))
"""   # prune_warmup = epochs: no run is pruned, so the trials do not depend on the order in which workers finish them
WORKER = """
import sys
from transject_nb.lab.protocol_store import open_storage
from transject_nb.lab.protocol_workers import work
work(plan, open_storage(sys.argv[1], heartbeat={heartbeat}, grace={grace}), out=sys.argv[2], cache_dir=False,
     poll=0.2, name=sys.argv[3])
"""


def pg_bin()->Path|None:
    "PostgreSQL's server programs' folder: on PATH, else Debian's /usr/lib/postgresql/<version>/bin; None: absent."
    if (p := shutil.which('initdb')) and shutil.which('pg_ctl'): return Path(p).resolve().parent
    found = sorted(glob.glob('/usr/lib/postgresql/*/bin/initdb'), key=lambda f: int(Path(f).parts[-3]))
    return Path(found[-1]).parent if found else None


def _missing()->str|None:
    "Why these tests cannot run here, or None."
    if pg_bin() is None: return 'needs the PostgreSQL server (apt-get install postgresql)'
    try: import psycopg  # noqa: F401
    except ImportError: return 'needs the psycopg driver (pip install "transject_nb[postgres]")'
    return None


needs_server = pytest.mark.skipif(not REQUIRED and _missing() is not None, reason=str(_missing()))


def _free_port()->int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


@contextmanager
def pg_cluster():
    "A throwaway PostgreSQL cluster on 127.0.0.1 (trust auth, user postgres): yields `new_db(name) -> URL`."
    if (why := _missing()) is not None: pytest.fail(f"{why} (TRANSJECT_NB_REQUIRE_TOOLS=1)", pytrace=False)
    import psycopg
    # as root, in /tmp, where `nobody` reaches it (a $TMPDIR of root's might not be)
    bin_, root = pg_bin(), Path(tempfile.mkdtemp(prefix='transject-pg-', dir='/tmp' if os.geteuid() == 0 else None))
    as_user = {}
    if os.geteuid() == 0:                                   # initdb and postgres refuse root: run them as nobody
        pw = pwd.getpwnam('nobody'); os.chown(root, pw.pw_uid, pw.pw_gid)
        as_user = dict(user=pw.pw_uid, group=pw.pw_gid, extra_groups=[])
    run = lambda *cmd: subprocess.run([str(bin_/cmd[0]), *cmd[1:]], check=True, capture_output=True, text=True,
                                      cwd=root, env=dict(os.environ, LC_ALL='C'), **as_user)
    data, port = root/'data', _free_port()
    try:
        run('initdb', '-D', str(data), '-U', 'postgres', '--auth=trust', '--no-locale', '-E', 'UTF8', '--no-sync')
        run('pg_ctl', '-D', str(data), '-l', str(root/'server.log'), '-w', '-t', '120', 'start',
            '-o', f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off")
    except subprocess.CalledProcessError as e:
        log = (root/'server.log').read_text() if (root/'server.log').is_file() else ''
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"{e.cmd[0]} failed:\n{e.stdout}\n{e.stderr}\n{log}") from None

    def new_db(name:str)->str:
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://postgres@127.0.0.1:{port}/{name}"
    try: yield new_db
    finally:
        try: run('pg_ctl', '-D', str(data), '-m', 'immediate', '-w', 'stop')
        finally: shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope='module')
def new_db():
    with pg_cluster() as f: yield f


def _spawn(script:str, *args)->subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore')
    return subprocess.Popen([sys.executable, '-c', script, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _plan(src:str):
    ns = {}; exec(src, ns); return ns['plan']


def _wait(done, what:str, timeout:float=600):
    "Poll until `done()` holds; fail after `timeout` seconds (generous: the machine is shared)."
    t0 = time.time()
    while not done():
        if time.time() - t0 > timeout: pytest.fail(f"waited {timeout:g} s for {what}", pytrace=False)
        time.sleep(0.2)


def _saved_epoch(runs:Path)->int:
    "The last epoch a run's checkpoint under `runs` holds (-1: none yet)."
    for f in runs.rglob('checkpoint.pth'):
        try: return load_checkpoint(f)['epoch']
        except (EOFError, RuntimeError, FileNotFoundError): pass          # replaced while being read: try again
    return -1


def test_the_postgres_extra_installs_the_driver():
    from importlib.metadata import requires
    assert 'psycopg[binary]>=3.1; extra == "postgres"' in requires('transject_nb')


def test_a_missing_driver_is_one_line_that_says_what_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, 'psycopg', None)                    # as if it were not installed
    with pytest.raises(SystemExit):
        run_command(['study', 'fair-listops', '--status', '--storage', 'postgresql://user@db-host/studies'])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith('error: a postgresql:// storage needs its database driver (import of psycopg halted; '
                        'None in sys.modules): pip install "transject_nb[postgres]" (psycopg)')


@needs_server
def test_the_queue_lock_is_a_row_lock_in_the_database(new_db):
    "Held by one worker, a study's queue is locked for a connection from anywhere (another machine's); released, free."
    import sqlalchemy as sa
    url = new_db('lock')
    st, other = open_storage(url), sa.create_engine(url)
    q = sa.text("SELECT study_name FROM transject_queue_locks WHERE study_name = :s FOR UPDATE NOWAIT")
    try:
        with QueueLock(st, 'plan/arm') as lock:
            with other.connect() as c, pytest.raises(sa.exc.OperationalError, match='could not obtain lock'):
                c.execute(q, dict(s='plan/arm'))
            with QueueLock(open_storage(url), 'plan/other'): pass       # another study's queue is free meanwhile
            lock.release(); lock.release()                               # let go early; a second call does nothing
            with other.connect() as c: assert c.execute(q, dict(s='plan/arm')).scalar() == 'plan/arm'
    finally: other.dispose()


@needs_server
def test_workers_on_a_server_run_every_run_once_and_give_the_sqlite_table(new_db, tmp_path):
    "Two workers, and a third started once a trial has finished: no trial fails, none runs twice, SQLite's values."
    src = PLAN.format(arms=('transformer', 'transject'), fixed=TINY, lrs=(1e-3, 1e-2), seeds=(1,), epochs=2,
                      patience=1)
    script = src + textwrap.dedent(WORKER.format(heartbeat=2, grace=10))
    plan, url = _plan(src), new_db('race')
    st = open_storage(url)
    ps = [_spawn(script, url, tmp_path/'runs', f'w{i}') for i in (1, 2)]
    _wait(lambda: (study_trials(plan, st).state == 'COMPLETE').any() or any(p.poll() is not None for p in ps),
          'a first trial to finish')
    ps.append(_spawn(script, url, tmp_path/'runs', 'w3'))              # a late worker joins the others
    threads = torch.get_num_threads(); torch.set_num_threads(1)        # as the workers train
    try: work(plan, open_storage(tmp_path/'ref.db'), out=tmp_path/'ref', cache_dir=False, progress=False)  # SQLite's
    finally: torch.set_num_threads(threads)
    logs = [p.communicate(timeout=900)[0] for p in ps]
    if any(p.returncode for p in ps): pytest.fail('\n\n'.join(logs), pytrace=False)
    assert not any(w in log for log in logs for w in ('Traceback', 'NotQueued', 'failed')), '\n\n'.join(logs)
    assert sum(f'[w{i}] tiny/' in log for i, log in enumerate(logs[:3], 1)) >= 2      # more than one worker trained
    t = study_trials(plan, st)
    assert len(t) == 2 * (2 + 1) and set(t.state) == {'COMPLETE'}      # each planned run, once, and no trial failed
    assert not t.duplicated(['arm', 'phase', 'lr', 'seed']).any()
    assert set(arm_status(t, plan).state) == {'done'}
    key = ['arm', 'phase', 'lr', 'seed']
    trials = lambda a: a[key + ['state', 'value', 'test_acc', 'epochs', 'best_epoch', 'data_key']].sort_values(key)
    runs = lambda a: study_runs(a, plan).drop(columns='train_secs').sort_values(['variant', 'seed'])   # all but time
    sq = study_trials(plan, tmp_path/'ref.db')
    pd.testing.assert_frame_equal(trials(t).reset_index(drop=True), trials(sq).reset_index(drop=True))
    pd.testing.assert_frame_equal(runs(t).reset_index(drop=True), runs(sq).reset_index(drop=True))   # the table
    from optuna_dashboard import wsgi                                  # the dashboard reads the same URL
    from wsgiref.util import setup_testing_defaults
    env, out = {'PATH_INFO': '/api/studies', 'REQUEST_METHOD': 'GET'}, {}
    setup_testing_defaults(env)
    reply = wsgi(open_storage(url))(env, lambda status, headers, exc_info=None: out.setdefault('status', status))
    body = b''.join(reply)
    assert out['status'].startswith('200') and b'tiny/transject' in body and b'tiny/transformer' in body


HANG = """
import signal, sys
from pathlib import Path
from transject_nb.lab import protocol_workers
guard = protocol_workers.TrialGuard.after_epoch
def after_epoch(self):                      # the first run hangs once two epochs are saved, until it is killed
    guard(self)
    if self.epoch == 2: Path(sys.argv[4]).touch(); signal.pause()
protocol_workers.TrialGuard.after_epoch = after_epoch
"""


@needs_server
def test_a_worker_killed_mid_trial_on_a_server_is_retried_and_resumes(new_db, tmp_path):
    "Its trial's heartbeat stops: another worker fails it once stale (polling, no sleep), queues it again, resumes it."
    src = PLAN.format(arms=('transject',), fixed=TINY, lrs=(1e-2,), seeds=(1,), epochs=4, patience=3)
    plan, url, hung = _plan(src), new_db('killed'), tmp_path/'hung'
    p = _spawn(src + HANG + textwrap.dedent(WORKER.format(heartbeat=1, grace=3)), url, tmp_path/'runs', 'w1', hung)
    _wait(lambda: hung.exists() or p.poll() is not None, 'the run to hang with two epochs saved')
    assert p.poll() is None, p.communicate()[0]
    p.send_signal(signal.SIGKILL); p.communicate()
    st = open_storage(url, heartbeat=1, grace=3)
    killed = study_trials(plan, st).query("state == 'RUNNING'")
    assert len(killed) == 1
    work(plan, st, out=tmp_path/'runs', cache_dir=False, poll=0.2, progress=False)   # waits for it to go stale
    t = study_trials(plan, st).set_index('number')
    k = int(killed.number.iloc[0])
    assert t.loc[k, 'state'] == 'FAIL' and (t.state == 'FAIL').sum() == 1
    retry = t[t.retry_of == k]
    assert len(retry) == 1 and retry.state.iloc[0] == 'COMPLETE'
    assert (retry.lr.iloc[0], retry.seed.iloc[0]) == (killed.lr.iloc[0], killed.seed.iloc[0])
    [tr] = [x for x in arm_study(plan, plan.arms[0], st).trials if x.number == int(retry.index[0])]
    assert tr.user_attrs['resumed_at'] == 2                              # went on from the killed run's checkpoint
    s = arm_status(study_trials(plan, st), plan)
    assert set(s.state) == {'done'} and s.retried.sum() == 1 and s.failed.sum() == 0   # retried, not failed for good
