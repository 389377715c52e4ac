"""The `transject-nb` command line: parsing, errors, train and compare end to end on a tiny generated ListOps, and its logs when stdout is a file."""
import json, os, re, subprocess, sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import transject_nb

from transject_nb.training.cli import DEMO, main, run_command, run_env, summary_table
from transject_nb.training.cli_parsers import field_configs, field_defaults, parse_overrides
from transject_nb.lab.experiments import RESULT_COLUMNS, results_table
from transject_nb.models import VARIANTS

TINY = ['--n_train', '128', '--n_valid', '32', '--n_test', '32', '--max_len', '32', '--min_length', '4', '--max_length', '32',
        '--max_depth', '3', '--max_args', '4', '--d_model', '16', '--n_layers', '1', '--epochs', '1', '--cache-dir', 'none', '--quiet', '--preset', 'cpu']


def _err(argv, capsys):
    with pytest.raises(SystemExit) as e: main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_values_typed_by_the_fields_annotation():
    "One conversion, `presets.convert_field`, from the dataclass that declares each field."
    from transject_nb.training.config import DataConfig, TrainConfig
    assert parse_overrides(['--epochs', '3', '--lr', '1', '--n_train', 'none', '--source', 'data'], ['transject']) == dict(epochs=3, lr=1.0, n_train=None, source='data')
    assert type(parse_overrides(['--lr', '1'], ['transject'])['lr']) is float
    owners = field_configs(['transject'])
    assert owners['epochs'] is TrainConfig and owners['n_train'] is DataConfig and owners['d_model'].__name__ == 'TransJectConfig'
    with pytest.raises(ValueError, match=r"--epochs: expected int, got '2\.5'"): parse_overrides(['--epochs', '2.5'], ['transject'])
    with pytest.raises(ValueError, match=r"--n_train: expected int\|None, got 'all'"): parse_overrides(['--n_train', 'all'], ['transject'])


def test_parse_overrides():
    assert parse_overrides(['--d-model', '32', '--lr=1e-3', '--pooling', 'mean'], ['transject']) == dict(d_model=32, lr=1e-3, pooling='mean')
    assert parse_overrides(['--n_heads', '2'], ['transject', 'transformer']) == dict(n_heads=2)
    with pytest.raises(ValueError, match='missing value'): parse_overrides(['--lr'], ['transject'])
    with pytest.raises(ValueError, match='expected --field value'): parse_overrides(['lr'], ['transject'])


def test_errors_list_the_valid_choices(capsys):
    assert "invalid choice: 'sst2'" in _err(['train', '--task', 'sst2', '--variant', 'transject'], capsys)
    assert 'transject' in _err(['train', '--task', 'listops', '--variant', 'nope'], capsys)
    e = _err(['train', '--task', 'listops', '--variant', 'transject', '--d_modle', '3'], capsys)
    assert "unknown field 'd_modle'; valid fields are: d_model" in e and 'lr' in e and 'n_train' in e
    assert "unknown variant 'bert'; valid variants are: " + ', '.join(VARIANTS) in _err(['compare', '--variants', 'transject,bert'], capsys)
    assert "unknown field 'n_heads'" in _err(['compare', '--task', 'listops', '--variants', 'transject', '--n_heads', '2'], capsys)
    assert '--seeds: expected comma-separated integers' in _err(['compare', '--seeds', 'a,b'], capsys)


def test_train_writes_model_and_results(tmp_path, capsys):
    out = tmp_path/'one'
    res = run_command(['train', '--task', 'listops', '--variant', 'transformer', '--out', str(out), *TINY])
    files = {str(p.relative_to(out)) for p in out.rglob('*') if p.is_file()}
    assert {'export.pkl', 'history.csv', 'results.json', 'models/best.pth', 'models/checkpoint.pth'} <= files
    js = json.loads((out/'results.json').read_text())
    assert js['results']['test_acc'] == res['test_acc'] and js['config']['model']['d_model'] == 16
    assert js['env']['device'] == 'cpu' and js['env']['torch'] == torch.__version__ and 'commit' in js['env']     # where and with what it ran
    assert 'test_acc' in capsys.readouterr().out
    assert 'pass --resume to continue it' in _err(['train', '--task', 'listops', '--variant', 'transformer', '--out', str(out), *TINY], capsys)


def test_compare_table_files_and_resume(tmp_path, capsys):
    out = tmp_path/'cmp'
    argv = ['compare', '--task', 'listops', '--variants', 'random-transject,transformer', '--seeds', '1,2', '--out', str(out), *TINY]
    table = run_command(argv)
    assert list(table.index) == ['random-transject', 'transformer'] and table['seeds'].tolist() == [2, 2]
    assert all('±' in s for s in table['test acc %'])
    printed = capsys.readouterr().out
    assert '| variant' in printed and 'majority class scores' in printed
    assert 'presets [' not in printed and not re.search(r'^epoch \d', printed, re.M) and '\n--- ' not in printed   # --quiet
    for f in ('results.csv', 'summary.csv', 'summary.md', 'curves.png', 'results.json'): assert (out/f).is_file(), f
    assert len(pd.read_csv(out/'results.csv')) == 4
    pd.testing.assert_frame_equal(run_command(argv + ['--resume']), table)      # every run finished: nothing is retrained
    saved = {p: p.read_bytes() for p in out.rglob('*') if p.is_file()}
    assert "'train.lr': (0.0005, 0.01)" in _err(argv + ['--resume', '--lr', '0.01'], capsys)   # issue 60: another setting
    assert {p: p.read_bytes() for p in out.rglob('*') if p.is_file()} == saved


def test_module_entry_point():
    r = subprocess.run([sys.executable, '-m', 'transject_nb.training.cli', 'compare', '--help'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and '--variants' in r.stdout and '--seeds' in r.stdout


def test_demo_is_visible_and_sane():
    assert DEMO['task'] == 'listops' and DEMO['overrides']['max_len'] <= 128
    assert DEMO['overrides']['lr'] == 'find'       # no shared rate: each variant's own, from fastai's lr_find (issue 23)


def test_lr_find_sets_each_runs_rate_and_records_it(tmp_path, capsys):
    assert parse_overrides(['--lr', 'find'], ['transject']) == dict(lr='find')
    out = tmp_path/'find'
    res = run_command(['train', '--task', 'listops', '--variant', 'transject', '--out', str(out), '--lr', 'find', *TINY])
    js = json.loads((out/'results.json').read_text())
    assert res['lr'] > 0 and js['config']['train']['lr'] == res['lr'] == js['results']['lr']
    assert len(pd.read_csv(out/'history.csv')) == 1                     # the range test left no epoch in the history
    again = run_command(['train', '--task', 'listops', '--variant', 'transject', '--out', str(out), '--lr', 'find', '--resume', *TINY])
    assert again['lr'] == res['lr']                                     # a started run keeps its rate
    assert "--lr: expected float, got 'finder', or 'find' for fastai's lr_find" in _err(['train', '--task', 'listops', '--variant', 'transject', '--lr', 'finder', *TINY], capsys)


def _log_to_file(argv, tmp_path)->str:
    "Run `python -m transject_nb.training.cli argv` in `tmp_path` with stdout to a file, as `transject-nb ... > log.txt` does; the log as written."
    log = tmp_path/'log.txt'
    with open(log, 'wb') as f: r = subprocess.run([sys.executable, '-m', 'transject_nb.training.cli', *argv], cwd=tmp_path, stdout=f, stderr=subprocess.PIPE, timeout=300)
    assert r.returncode == 0, r.stderr.decode(errors='replace')[-4000:]
    text = log.read_bytes().decode()          # bytes: reading in text mode would turn carriage returns into newlines
    assert '\r' not in text and max(map(len, text.split('\n'))) <= 300, text[:3000]
    return text


def test_compare_log_is_plain_lines(tmp_path):
    loud = [w for w in TINY if w != '--quiet'] + ['--epochs', '2']      # the later --epochs wins
    text = _log_to_file(['compare', '--task', 'listops', '--variants', 'transject,transformer', '--seeds', '1', '--out', 'cmp', *loud], tmp_path)
    lines = text.split('\n')
    epochs = [l for l in lines if re.match(r'epoch \d+ \(\d+ of 2\): train_loss [\d.]+, valid_loss [\d.]+, accuracy [\d.]+, .*time \d\d:\d\d$', l)]
    assert len(epochs) == 2 * 2                                          # one line per epoch of each run
    assert sum(l.startswith('--- ') and l.endswith(' done') for l in lines) == 2     # one line per finished run
    assert sum(l.startswith('presets [listops-cpu] from ') for l in lines) == 1


def test_bench_log_is_plain_lines(tmp_path):
    text = _log_to_file(['bench', '--n', '8,16', '--reps', '1', '--warmup', '0', '--batch', '2', '--no-memory', '--d_model', '16', '--n_layers', '1'], tmp_path)
    assert [l.split(' (')[0] for l in text.split('\n') if l.startswith('length ')] == ['length 8 done', 'length 16 done']
    assert 'tokens_per_s' in text


def test_run_env_claims_no_commit_outside_its_checkout(tmp_path, monkeypatch):
    assert run_env()['device'] == 'cpu'
    (tmp_path/'other.txt').write_text('tracked'); (tmp_path/'__init__.py').write_text('')
    for a in (['init', '-q'], ['add', 'other.txt'], ['-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-qm', 'other']):
        subprocess.run(['git', *a], cwd=tmp_path, check=True)            # a repo with a commit that does not track the package
    monkeypatch.setattr(transject_nb, '__file__', str(tmp_path/'__init__.py'))
    assert run_env()['commit'] is None


def _help(argv, capsys)->str:
    with pytest.raises(SystemExit) as e: run_command(argv)
    assert e.value.code == 0
    return ' '.join(capsys.readouterr().out.split())                    # argparse's wrapping undone


def test_help_lists_every_override_with_its_default(capsys):
    "The `--field value` words that `parse_overrides` takes are in `--help`: grouped, typed, with their default and its preset section."
    h = _help(['train', '--task', 'listops', '--variant', 'transject', '--preset', 'cpu', '--help'], capsys)
    for group in ('model fields (--field value)', 'training fields (--field value)', 'data fields (--field value)'): assert group in h
    assert '--d_model int width of the token representations; default 64 ([listops-cpu])' in h
    assert "--lr float|find Adam learning rate" in h and "'find': fastai's lr_find picks it" in h and 'default 0.0005 ([listops-cpu])' in h
    assert '--source str|None local data folder' in h and 'default None (DataConfig)' in h
    assert '--n_heads' not in h                                          # not a TransJect field
    everything = _help(['train', '--preset', 'cpu', '--help'], capsys)     # no task or variant: all of them
    assert {f'--{k}' for k in field_configs(VARIANTS)} <= set(everything.split())
    assert 'default 128 for imdb, listops; 64 for agnews; 256 for charimdb' in everything      # max_len, by task
    assert '; neutreno only' in everything and '; softmax variants only' in everything
    paper = _help(['train', '--task', 'imdb', '--variant', 'transformer', '--preset', 'paper', '--help'], capsys)
    assert '--d_model int width of the token representations; default 512 ([imdb])' in paper
    demo = _help(['compare', '--help'], capsys)
    assert '--lr float|find' in demo and 'Without --task, compare runs the demo (DEMO): listops with the cpu preset' in demo
    assert field_defaults(['transject'], ['listops'], 'cpu').set_index('field').loc['max_length', 'default'] == 129


def _clean_run(argv, cwd)->str:
    "stdout and stderr of `python -m transject_nb.training.cli argv`, in the environment a user's shell has: no PYTHONWARNINGS, no KINETO_LOG_LEVEL, one thread."
    env = {k: os.environ[k] for k in ('PATH', 'HOME', 'PYTHONPATH') if k in os.environ} | dict(OMP_NUM_THREADS='1')
    r = subprocess.run([sys.executable, '-m', 'transject_nb.training.cli', *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout + r.stderr

NOISE = re.compile(r'Warning|ERROR|USDT|profiler_st|gpuGetDeviceCount|^\[W\d', re.M)   # warnings, kineto's log lines, c10's warnings

def test_command_line_output_is_clean(tmp_path):
    "`--help` and a small `train` print what they are for and nothing else: no warning, no error, no profiler line."
    out = _clean_run(['train', '--help'], tmp_path)
    assert '--d_model' in out and not NOISE.search(out), out[:3000]
    tiny = [w for w in TINY if w != '--quiet']
    out = _clean_run(['train', '--task', 'listops', '--variant', 'transject', '--out', 'run', '--lr', 'find', *tiny], tmp_path)
    assert 'test_acc' in out and 'epoch 0' in out and not NOISE.search(out), out[-3000:]


def test_summary_table():
    "compare's table is `experiments.results_table` of its runs, formatted, in the order the variants ran."
    run = lambda v, s, t, va, p, e, secs: dict(task='listops', variant=v, seed=s, test_acc=t, valid_acc=va, majority=.2,
                                                params=p, epochs=e, train_secs=secs)
    rows = [run('a', 1, .5, .4, 10, 2, 1.0), run('a', 2, .7, .6, 10, 2, 1.0), run('b', 1, .3, .3, 5, 1, 2.0)]
    t = results_table(pd.DataFrame(rows).reindex(columns=list(RESULT_COLUMNS))).droplevel('task')
    assert list(t.index) == ['a', 'b'] and t.loc['a', 'n'] == 2 and abs(t.loc['a', 'test_acc'] - .6) < 1e-12
    f = summary_table(rows)
    assert list(f.index) == ['a', 'b'] and f.loc['a', 'seeds'] == 2
    assert f.loc['a', 'test acc %'] == '60.0 ± 14.1' and f.loc['b', 'test acc %'] == '30.0'
    assert list(summary_table(rows[::-1]).index) == ['b', 'a'] and f.index.name == 'variant'
    assert list(f.columns) == ['seeds', 'test acc %', 'valid acc %', 'majority %', 'params', 'epochs', 'train s']


# --- nothing silently wrong, nothing lost (issue 60): each fault injected, and what was saved before it unchanged ---

def _fails(argv, capsys, code=1)->str:
    "The one line `main(argv)` ends with on stderr, once it exits with `code`; no traceback."
    with pytest.raises(SystemExit) as e: main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code, err
    assert 'Traceback' not in err
    return err.strip().splitlines()[-1]


def _saved(folder)->dict:
    "Every file under `folder`, by its path, with its bytes."
    return {p: p.read_bytes() for p in Path(folder).rglob('*') if p.is_file()}


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
    "A finished one-epoch run of `train`, with every file a run writes; tests copy it rather than train again."
    out = tmp_path_factory.mktemp('finished')/'run'
    run_command(['train', '--task', 'listops', '--variant', 'transformer', '--out', str(out), *TINY])
    return out


def _copy(run, dest)->Path:
    import shutil
    return Path(shutil.copytree(run, dest))


def test_resume_refuses_other_training_settings_naming_them(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path/'run'); before = _saved(run)
    argv = ['train', '--task', 'listops', '--variant', 'transformer', '--out', str(run), '--resume', *TINY]
    for flag, value, old in (('--lr', '0.01', 0.0005), ('--seed', '7', 42), ('--bs', '16', 32), ('--weight_decay', '0.1', 0.0)):
        said = _fails(argv + [flag, value], capsys, code=2)
        assert f"'train.{flag[2:]}': ({old!r}, {float(value) if '.' in value else int(value)!r})" in said, said
        assert 'Resume it with its own settings, or train in another folder' in said
    assert _saved(run) == before
    assert json.loads((run/'results.json').read_text())['config']['train']['amp'] == 'off'   # recorded as it ran, on the CPU


def test_flags_that_would_do_nothing_are_refused(tmp_path, capsys):
    base = ['train', '--task', 'listops', '--variant', 'transject', '--out', str(tmp_path/'x'), *TINY]
    assert 'drop valid_pct' in _fails(base + ['--valid_pct', '0.2'], capsys, code=2)
    assert 'max_len=16 would cut the generated ListOps expressions, which run to 31 tokens' in _fails(base + ['--max_len', '16'], capsys, code=2)
    src = tmp_path/'lra'; src.mkdir()
    said = _fails(base + ['--source', str(src), '--max_depth', '3'], capsys, code=2)
    assert f"min_length, max_length, max_depth, max_args: the ListOps generator's, and source={str(src)!r} reads ListOps files instead" in said, said
    tiny_src = TINY[:8] + TINY[16:]                                     # without the generator's fields
    said = _fails(['train', '--task', 'listops', '--variant', 'transject', '--out', str(tmp_path/'x'), *tiny_src, '--source', str(src)], capsys, code=2)
    assert 'min_length' not in said and 'max_length' not in said and str(src) in said      # what is wrong: no ListOps files
    if not torch.cuda.is_available():
        assert "amp='bf16' is mixed precision on CUDA, and this run trains on cpu" in _fails(base + ['--amp', 'bf16'], capsys, code=2)
    assert not (tmp_path/'x').exists()                                  # refused before anything was written


def test_repeated_seeds_or_variants_are_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path/'cmp'
    cmd = ['compare', '--task', 'listops', '--out', str(out), *TINY]
    assert "seed 1 given more than once in '1,1,1'" in _fails(cmd + ['--variants', 'transformer', '--seeds', '1,1,1', '--resume'], capsys, code=2)
    assert "variant transformer given more than once" in _fails(cmd + ['--variants', 'transformer,transformer', '--seeds', '1'], capsys, code=2)
    assert "--seeds: no seed given in ''" in _fails(cmd + ['--variants', 'transformer', '--seeds', ''], capsys, code=2)
    assert not out.exists()


def test_a_run_never_writes_over_a_comparison(tmp_path, capsys):
    cmp_ = tmp_path/'cmp'
    run_command(['compare', '--task', 'listops', '--variants', 'transformer', '--seeds', '1', '--out', str(cmp_), *TINY])
    before = _saved(cmp_)
    train = ['train', '--task', 'listops', '--variant', 'transformer', *TINY]
    for resume in ([], ['--resume']):
        assert f'{cmp_} holds a comparison, and a run would write over its files' in _fails(train + ['--out', str(cmp_), *resume], capsys, code=2)
    assert f'{cmp_} already holds a comparison; pass --resume to continue it' in _fails(['compare', '--task', 'listops', '--variants', 'transformer', '--seeds', '1', '--out', str(cmp_), *TINY], capsys, code=2)
    run = tmp_path/'run'; run_command(train + ['--out', str(run)]); one = _saved(run)
    assert f'{run} holds a run, and a comparison would write over its files' in _fails(['compare', '--task', 'listops', '--variants', 'transformer', '--seeds', '1', '--out', str(run), '--resume', *TINY], capsys, code=2)
    assert _saved(cmp_) == before and _saved(run) == one


def test_a_killed_save_leaves_no_temporary_for_good(finished, tmp_path):
    run = _copy(finished, tmp_path/'run')
    left = [run/'models'/'checkpoint.pth.k2x9q0ab.tmp', run/'results.json.a1b2c3d4.tmp']   # mkstemp's names, 0 bytes
    for f in left: f.write_bytes(b'')
    before = _saved(run)
    run_command(['train', '--task', 'listops', '--variant', 'transformer', '--out', str(run), '--resume', *TINY])
    assert not any(f.exists() for f in left)
    after = _saved(run)
    for f in ('models/checkpoint.pth', 'models/best.pth', 'history.csv'): assert after[run/f] == before[run/f], f   # the run is as it was


def test_a_full_disk_fails_in_one_line_and_changes_nothing(finished, tmp_path, capsys, disk_full):
    run = _copy(finished, tmp_path/'run'); before = _saved(run)
    disk_full(after=10)                                                 # the next file written fails part-way
    said = _fails(['train', '--task', 'listops', '--variant', 'transformer', '--out', str(run), '--resume', *TINY, '--epochs', '2'], capsys)
    assert said.startswith('transject-nb train: error: No space left on device') and 'run the same command again' in said, said
    assert _saved(run) == before                                        # no partial file, no temporary


def test_a_read_only_folder_fails_in_one_line_before_training(finished, tmp_path, capsys, read_only):
    run = _copy(finished, tmp_path/'run'); before = _saved(run)
    read_only(run)
    said = _fails(['train', '--task', 'listops', '--variant', 'transformer', '--out', str(run), '--resume', *TINY, '--epochs', '2'], capsys)
    assert said == f'transject-nb train: error: Permission denied: {run}; choose a folder you can write to, or make it writable', said
    said = _fails(['train', '--task', 'listops', '--variant', 'transformer', '--out', str(run/'new'), *TINY], capsys)
    assert said.startswith('transject-nb train: error: Permission denied: ') and 'choose a folder you can write to' in said
    assert _saved(run) == before
    with pytest.raises(PermissionError):                                # --debug: the error itself, with its traceback
        run_command(['train', '--task', 'listops', '--variant', 'transformer', '--out', str(run), '--resume', *TINY, '--epochs', '2', '--debug'])


def test_a_truncated_best_weights_file_fails_in_one_line(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path/'run')
    best = run/'models'/'best.pth'; best.write_bytes(best.read_bytes()[:300])
    before = _saved(run)
    said = _fails(['train', '--task', 'listops', '--variant', 'transformer', '--out', str(run), '--resume', *TINY], capsys, code=2)
    assert f'{best} is damaged or holds no weights' in said and 'restore it, or train the run again in another folder' in said
    assert _saved(run) == before
