"""A wheel built from the repository works on its own: installed into a scratch folder (`pip install --no-deps --target`, so torch
and the other dependencies are the environment's and nothing is downloaded) and run from an empty folder, it finds the presets it
ships, builds a learner, and its `transject-nb` script trains and compares, writing plain-line logs."""
import json, os, re, shutil, subprocess, sys, zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ['--n_train', '128', '--n_valid', '32', '--n_test', '32', '--max_len', '32', '--min_length', '4', '--max_length', '32',
        '--max_depth', '3', '--max_args', '4', '--d_model', '16', '--n_layers', '1', '--epochs', '2', '--cache-dir', 'none', '--preset', 'cpu']


def _setuptools_recent()->bool:
    "Whether this environment's setuptools can build the wheel itself (pyproject.toml needs >= 77), so that no download is needed."
    try: import setuptools
    except ImportError: return False
    try: return int(setuptools.__version__.split('.')[0]) >= 77
    except ValueError: return False


def _run(args, cwd, env=None, timeout=300)->str:
    "Run `args` in `cwd`; fail with its stderr unless it exits 0; return its stdout as written (carriage returns kept)."
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, timeout=timeout)
    assert r.returncode == 0, f"{args[:4]} exited {r.returncode}:\n{r.stderr.decode(errors='replace')[-4000:]}"
    return r.stdout.decode()


@pytest.fixture(scope='module')
def wheel(tmp_path_factory)->Path:
    "The wheel, built from a copy of the package's sources (building in place would leave build/ and *.egg-info in the checkout)."
    tmp = tmp_path_factory.mktemp('wheel')
    src = tmp/'src'; src.mkdir()
    for f in ['pyproject.toml', 'README.md', 'settings.ini', *[p.name for p in REPO.glob('LICEN[CS]E*')]]: shutil.copy2(REPO/f, src/f)
    # symlinks=True: the copy keeps transject_nb/settings.ini -> ../settings.ini, the link the repository has, for setuptools to resolve
    shutil.copytree(REPO/'transject_nb', src/'transject_nb', symlinks=True, ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
    cmd = [sys.executable, '-m', 'pip', 'wheel', '--no-deps', '-w', str(tmp/'dist'), str(src)]
    if _setuptools_recent(): cmd.insert(4, '--no-build-isolation')     # offline; else pip fetches setuptools into an isolated build
    _run(cmd, tmp, dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK='1'), timeout=600)
    whl, = (tmp/'dist').glob('transject_nb-*.whl')
    return whl


@pytest.fixture(scope='module')
def scratch(wheel, tmp_path_factory)->Path:
    "The wheel installed, without dependencies, into a folder of its own."
    target = tmp_path_factory.mktemp('scratch')
    _run([sys.executable, '-m', 'pip', 'install', '--no-deps', '--no-compile', '--target', str(target), str(wheel)], target,
         dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK='1'))
    return target


@pytest.fixture
def env(scratch)->dict:
    "The environment of a user of the installed wheel: the package from `scratch` only, no presets override."
    e = dict(os.environ, PYTHONPATH=str(scratch), OMP_NUM_THREADS='1')
    e.pop('TRANSJECT_SETTINGS', None)
    return e


def test_wheel_ships_the_presets(wheel, scratch):
    shipped = (REPO/'settings.ini').read_bytes()
    assert zipfile.ZipFile(wheel).read('transject_nb/settings.ini') == shipped     # the linked file's content, not the link
    installed = scratch/'transject_nb'/'settings.ini'
    assert not installed.is_symlink() and installed.read_bytes() == shipped


def test_installed_package_builds_a_learner_from_an_empty_folder(scratch, env, tmp_path):
    code = ("import json, transject_nb\n"
            "from transject_nb.presets import settings_files\n"
            "from transject_nb.training.learner import get_learner\n"
            "learn = get_learner('listops', 'transject', preset='cpu', path='run', cache_dir=False, n_train=64, n_valid=16, n_test=16, max_len=32,\n"
            "                    min_length=4, max_length=32, max_depth=3, max_args=4, d_model=16, n_layers=1)\n"
            "print(json.dumps(dict(file=transject_nb.__file__, presets=[str(p) for p in settings_files()], preset=learn.config['preset'],\n"
            "                      d_model=learn.config['model']['d_model'], lr=learn.train_cfg.lr, batches=len(learn.dls.train))))\n")
    got = json.loads(_run([sys.executable, '-c', code], tmp_path, env).strip().splitlines()[-1])
    assert Path(got['file']).resolve().is_relative_to(scratch.resolve()), got['file']      # the wheel's copy, not the repository's
    assert got['presets'] == [str(scratch/'transject_nb'/'settings.ini')]
    assert (got['preset'], got['d_model'], got['lr'], got['batches']) == ('listops-cpu', 16, 5e-4, 2)   # lr: the shipped [DEFAULT]


def _plain(log:str, epochs:int, runs:int)->list:
    "The lines of a log written to a pipe, checked: no carriage return, no overlong line, one line per epoch and one per finished run."
    assert '\r' not in log
    lines = log.split('\n')
    assert max(map(len, lines)) <= 300
    assert sum(bool(re.match(r'epoch \d+ \(\d+ of \d+\): train_loss ', l)) for l in lines) == epochs
    assert sum(l.startswith('--- ') for l in lines) == runs
    return lines


def test_console_script_trains_and_compares_from_an_empty_folder(scratch, env, tmp_path):
    script = scratch/'bin'/'transject-nb'
    lines = _plain(_run([str(script), 'train', '--task', 'listops', '--variant', 'transformer', '--out', 'one', *TINY], tmp_path, env), 2, 0)
    assert lines[0] == f"presets [listops-cpu] from {scratch/'transject_nb'/'settings.ini'}"
    res = json.loads((tmp_path/'one'/'results.json').read_text())
    assert res['results']['epochs'] == 2 and res['presets'] == [str(scratch/'transject_nb'/'settings.ini')]
    _plain(_run([str(script), 'compare', '--task', 'listops', '--variants', 'random-transject,transformer', '--seeds', '1', '--out', 'cmp', *TINY],
                tmp_path, env), 2 * 2, 2)
    assert {'summary.md', 'results.csv', 'curves.png'} <= {p.name for p in (tmp_path/'cmp').iterdir()}
