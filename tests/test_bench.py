"Tests of `transject_nb.lab.bench` and `lab.bench_report` on tiny sizes: shapes and sanity of the measurements, the FLOP counts against torch's FlopCounterMode, the CLI. Timings are never asserted."
import argparse, math, os, re, subprocess, sys

import pandas as pd
import pytest
import torch
from hypothesis import given, settings, strategies as st

from transject_nb import transject as tj, cpu
from transject_nb.lab.bench import (REFERENCE, TorchEncoder, flop_count, inverse_flops, interleaved_times, machine_info,
                                make_step, matmul_peak, measured_flops, quiet_profiler, peak_memory, profile_step,
                                reference_encoder, train_briefly, transject_flops, unfused_transject_, uses_fused)
from transject_nb.lab.bench_report import (BENCH_HELP, add_bench_args, bench_command, bench_table, crossover, main,
                                       plot_memory, plot_throughput)
from transject_nb.models import VARIANTS, create_model

torch.set_num_threads(1)


def model(name, d=16, **kw):
    torch.manual_seed(0)
    if name == REFERENCE: return reference_encoder(50, 3, d_model=d, n_layers=2, max_len=64, **kw)
    return create_model(name, 50, 3, d_model=d, n_layers=2, max_len=64, **kw)


NAMED = [(v, k) for v in VARIANTS for k in (('readable', 'fused') if 'transject' in v else (None,))] + [(REFERENCE, None)]

@pytest.mark.parametrize('name,kernel', NAMED)
@pytest.mark.parametrize('n', [5, 24])
def test_flop_count_matches_flop_counter(name, kernel, n):
    "One count of the math: the readable layer's products, or the fused kernel's (Σ folded in where it folds), both as torch runs them."
    m = model(name) if kernel is None else model(name, kernel=kernel)
    x = torch.randint(1, 50, (2, n))
    for train in (True, False):
        f = flop_count(m, 2, n, train)
        assert f['total'] == sum(v for k, v in f.items() if k != 'total')
        assert f['total'] - f.get('lapack', 0) == measured_flops(m, x, train)


@settings(max_examples=15, deadline=None)
@given(d=st.sampled_from([8, 12, 32]), E=st.integers(1, 3), B=st.integers(1, 3), n=st.integers(1, 40),
       variant=st.sampled_from(['transject', 'random-entropic-transject']), kernel=st.sampled_from(['readable', 'fused']))
def test_transject_flops_random_sizes(d, E, B, n, variant, kernel):
    torch.manual_seed(0)
    m = create_model(variant, 30, 2, d_model=d, n_layers=2, n_experts=E, max_len=64, kernel=kernel)
    x = torch.randint(1, 30, (B, n))
    f = flop_count(m, B, n, True)
    assert f['total'] - f['lapack'] == measured_flops(m, x, True)


def test_transject_flops_one_count_for_both_kernels():
    "The kernels differ only where the fused one folds Σ into the experts; everything else is the same count."
    cfg = tj.TransJectConfig(100, 2, d_model=16, n_layers=2, n_experts=3)
    for n in (8, 40):
        r, f = transject_flops(cfg, 2, n), transject_flops(cfg, 2, n, fused=True)
        assert {k: v for k, v in r.items() if k not in ('fold', 'experts', 'total')} == {k: v for k, v in f.items() if k not in ('fold', 'experts', 'total')}
        assert (r == f) == (cpu.layer_path(n, 16) == 'direct') and r['fold'] == 0
    assert uses_fused(model('transject', kernel='auto')) and not uses_fused(model('transject', kernel='readable'))


def test_inverse_flops():
    assert inverse_flops(64) == (0, 2 * 64 ** 3)
    g, lap = inverse_flops(256)
    assert lap == 4 * 2 * 64 ** 3 and g > 0
    assert 1.5 * 256 ** 3 < g + lap < 2.5 * 256 ** 3               # about 2 d^3 in all


def test_flop_count_rejects_other_models():
    with pytest.raises(TypeError, match='flop_count knows'): flop_count(torch.nn.Linear(2, 2), 1, 1)


def test_reference_encoder_contract():
    m = model(REFERENCE).eval()
    x = torch.tensor([[5, 3, 9, 0, 0], [7, 1, 4, 4, 8]])
    with torch.no_grad():
        assert m(x).shape == (2, 3)
        assert torch.allclose(m(x)[:1], m(x[:1, :3]), atol=1e-5)        # padding is masked
    assert isinstance(m, TorchEncoder) and m.blocks[0].enc.layers[0].linear1.out_features == 64


def test_make_step_train_and_eval():
    m = model('transject')
    x = torch.randint(1, 50, (2, 8))
    s = make_step(m, x)
    s()
    assert m.training and all(p.grad is not None for p in m.parameters())
    e = make_step(m, x, train=False)
    e()
    assert not m.training and e.model is m
    with torch.autocast('cpu', dtype=torch.bfloat16): pass
    make_step(m, x, dtype=torch.bfloat16)()                              # bf16 autocast step runs
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_make_step_with_a_compiled_model():
    "A compiled module raises on `bool()`; the step must call it, and the gradients must reach the original's parameters."
    m = model('transject')
    x = torch.randint(1, 50, (2, 8))
    compiled = torch.compile(m, backend='eager')                         # dynamo without inductor: no C++ build in the test
    with pytest.raises(TypeError): bool(compiled)
    step = make_step(m, x, compiled=compiled); step()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


def test_interleaved_times_and_peak():
    calls = []
    ts = interleaved_times({'a': lambda: calls.append('a'), 'b': lambda: calls.append('b')}, reps=3, warmup=1)
    assert calls == ['a', 'b'] * 4 and all(len(v) == 3 and min(v) >= 0 for v in ts.values())
    p = matmul_peak(shapes=((32, 32, 32), (16, 16, 16)), reps=2)
    assert set(p) == {'32x32x32', '16x16x16', 'peak'} and p['peak'] == max(p['32x32x32'], p['16x16x16']) > 0
    assert {'cpu', 'threads', 'load_1min'} <= set(machine_info())


def test_peak_memory_counts_the_step():
    def step():
        a = torch.randn(1000, 1000); b = torch.randn(1000, 1000)       # 4 MB each, both live
        return (a @ b).sum()
    mib = peak_memory(step)
    assert 11 < mib < 13                                                 # a, b and a @ b: 12 MB
    assert peak_memory(step) == mib                                      # no drift between profiled steps
    m = model('transject')
    small, big = (peak_memory(make_step(m, torch.randint(1, 50, (2, n)))) for n in (8, 32))
    assert 0 < small < big
    assert cpu.n_threads('cpu') == torch.get_num_threads()               # the kernel's worker count is restored


def test_bench_table_tiny_all_variants():
    ms = {v: model(v) for v in VARIANTS} | {REFERENCE: model(REFERENCE)}
    df = bench_table(ms, ns=(4, 12), B=2, reps=2)
    assert len(df) == 2 * len(ms) and set(df.model) == set(ms)
    for c in ('tokens_per_s', 'tok_s_min', 'tok_s_max', 'ratio', 'gflop', 'gflops_per_s', 'peak_gflops_per_s', 'frac_peak', 'peak_mib', 'load', 'threads'):
        assert c in df and df[c].notna().all(), c
    assert (df.tok_s_min <= df.tokens_per_s).all() and (df.tokens_per_s <= df.tok_s_max).all()
    assert (df[df.model == REFERENCE].ratio == 1).all() and (df.gflop > 0).all() and (df.frac_peak > 0).all()
    ev = bench_table({'transject': ms['transject'], REFERENCE: ms[REFERENCE]}, ns=(6,), B=1, reps=1, train=False, memory=False)
    assert ev.peak_mib.isna().all() and (ev.tokens_per_s > 0).all()


def test_bench_table_refuses_bad_arguments():
    ms = {'transject': model('transject'), REFERENCE: model(REFERENCE)}
    with pytest.raises(ValueError, match='max_len >= 100'): bench_table(ms, ns=(8, 100))       # the models were built for 64
    with pytest.raises(ValueError, match='B >= 1'): bench_table(ms, ns=(8,), B=0)
    with pytest.raises(ValueError, match='reps >= 1'): bench_table(ms, ns=(8,), reps=0)
    with pytest.raises(ValueError, match='positive integer lengths'): bench_table(ms, ns=(0,))
    with pytest.raises(ValueError, match='at least one model'): bench_table({}, ns=(8,))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match='CUDA is not available'): bench_table(ms, ns=(8,), device='cuda')


def test_bench_table_with_worker_threads():
    prev = torch.get_num_threads(); torch.set_num_threads(2)
    try:
        df = bench_table({'transject': model('transject', d=8), REFERENCE: model(REFERENCE, d=8)}, ns=(40,), B=3, reps=1, memory=True)
    finally: torch.set_num_threads(prev)
    assert (df.threads == 2).all() and df.peak_mib.notna().all()


def test_crossover_and_plots():
    import matplotlib; matplotlib.use('Agg')
    df = pd.DataFrame(dict(n=[100, 1000, 10000] * 2, model=['a'] * 3 + [REFERENCE] * 3, tokens_per_s=[1., 10., 100., 10., 10., 10.],
                           tok_s_min=[1.] * 6, tok_s_max=[100.] * 6, peak_mib=[1., 10., 100., 1., 100., 10000.]))
    assert math.isclose(crossover(df, 'a'), 1000.)
    assert math.isnan(crossover(df.assign(tokens_per_s=1.), 'a'))
    ax = plot_throughput(df); assert (ax.get_xscale(), ax.get_yscale()) == ('log', 'log')
    assert 'a overtakes at n ≈ 1000' in [l.get_label() for l in ax.get_lines()]
    assert not any('overtakes' in l.get_label() for l in plot_throughput(df.assign(tokens_per_s=1.)).get_lines())   # never: no mark
    ax = plot_memory(df); assert ax.get_ylabel().startswith('peak memory')


def test_unfused_matches_fused_and_profile():
    torch.manual_seed(0)
    a = cpu.reorthogonalize_(create_model('transject', 40, 2, d_model=8, n_layers=2, n_experts=2, kernel='fused').double())
    with torch.no_grad():
        for p in a.parameters(): p.add_(0.2 * torch.randn_like(p))
    b = unfused_transject_(create_model('transject', 40, 2, d_model=8, n_layers=2, n_experts=2).double())
    b.load_state_dict(a.state_dict())
    assert uses_fused(a) and not uses_fused(b)                           # the readable layer, and the Cayley map by solves
    x = torch.randint(1, 40, (2, 12))
    la, lb = (m(x).sum() + m.aux_loss for m in (a, b))
    assert torch.allclose(la, lb, atol=1e-10)
    for ga, gb in zip(torch.autograd.grad(la, list(a.parameters())), torch.autograd.grad(lb, list(b.parameters()))):
        assert torch.allclose(ga, gb, atol=1e-10)
    ops, kinds = profile_step(make_step(a.float(), x))
    assert len(ops) > 0 and kinds.sum() > 0 and 'matrix products' in kinds.index


def test_train_briefly_moves_the_weights():
    m = model('transject')
    losses = train_briefly(m, steps=5, B=2, n=6)
    assert len(losses) == 5 and all(math.isfinite(l) for l in losses)
    assert m.alphas().abs().min() > 0


def test_cli(capsys):
    df = main(['--variants', 'transject', '--n', '6,12', '--batch', '1', '--reps', '1', '--d_model', '8', '--d_ff', '16', '--no-memory'])
    out = capsys.readouterr().out
    assert 'transject-nb bench: train, float32, batch 1' in out and REFERENCE in out and any(s in out for s in ('overtakes', 'only at n =', 'slower than'))
    assert set(df.model) == {'transject (readable)', 'transject (fused)', REFERENCE} and list(df.n.unique()) == [6, 12]
    with pytest.raises(SystemExit): main(['--variants', 'nope', '--n', '4'])
    with pytest.raises(SystemExit): main(['--n', 'a,b'])
    with pytest.raises(SystemExit): main(['--n', '4', '--lr', '0.1'])
    with pytest.raises(SystemExit): main(['--n', '4', '--batch', '0'])
    assert '--batch: expected a positive integer' in capsys.readouterr().err
    with pytest.raises(SystemExit): main(['--n', '4', '--d_model', '3.5'])     # typed as the config field is: an int
    assert "--d_model: expected int, got '3.5'" in capsys.readouterr().err
    with pytest.raises(SystemExit): main(['--n', '4', '--lr', '0.1'])
    assert "unknown model config field 'lr'; valid model config fields are: " in capsys.readouterr().err
    p = argparse.ArgumentParser(); add_bench_args(p)
    a = p.parse_args(['--n', '5', '--batch', '1', '--reps', '1', '--no-memory'])
    assert set(bench_command(a, {'d_model': 8, 'd_ff': 16}).model) == {'transject (readable)', 'transject (fused)', REFERENCE}
    a = p.parse_args(['--n', '5', '--batch', '1', '--reps', '1', '--no-memory', '--kernels', 'fused', '--variants', 'transject,transformer'])
    assert set(bench_command(a, {'d_model': '8', 'd_ff': '16'}).model) == {'transject (fused)', 'transformer', REFERENCE}   # text typed by the fields
    with pytest.raises(SystemExit): main(['--n', '4', '--kernels', 'fast'])
    assert "unknown kernel 'fast'; valid kernels are: readable, fused" in capsys.readouterr().err
    with pytest.raises(ValueError, match='drop --kernel'): bench_command(argparse.Namespace(variants='transject', n='4', threads=None), {'kernel': 'fused'})


def test_console_script_offers_bench():
    "`cli` imports `bench` and offers it; `bench` does not import `cli` (the import goes one way)."
    import ast, inspect, transject_nb.lab.bench_report as bench
    from transject_nb.training.cli import make_parser, COMMANDS
    help = make_parser().format_help()
    assert 'bench' in COMMANDS and 'bench' in help and COMMANDS['bench'][1] is add_bench_args
    tree = ast.parse(inspect.getsource(bench))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.endswith('cli') for m in imported), imported


def test_quiet_profiler_leaves_the_environment_as_it_was(monkeypatch):
    monkeypatch.delenv('KINETO_LOG_LEVEL', raising=False)
    with quiet_profiler(): assert os.environ['KINETO_LOG_LEVEL'] == '6'
    assert 'KINETO_LOG_LEVEL' not in os.environ
    monkeypatch.setenv('KINETO_LOG_LEVEL', '2')
    with quiet_profiler(): assert os.environ['KINETO_LOG_LEVEL'] == '2'     # the user's level wins


def test_bench_on_the_cpu_prints_no_noise(tmp_path):
    "A small `transject-nb bench`, peak memory included (the profiler runs), in the environment a user's shell has: its table, and no warning, error or profiler line."
    env = {k: os.environ[k] for k in ('PATH', 'HOME', 'PYTHONPATH') if k in os.environ} | dict(OMP_NUM_THREADS='1')
    argv = ['bench', '--variants', 'transject,transformer', '--n', '8', '--reps', '1', '--warmup', '0', '--batch', '2', '--d_model', '16', '--n_layers', '1']
    r = subprocess.run([sys.executable, '-m', 'transject_nb.training.cli', *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and 'peak_mib' in r.stdout, out[-4000:]
    assert not re.search(r'Warning|ERROR|USDT|profiler_st|gpuGetDeviceCount|^\[W\d', out, re.M), out


def test_every_bench_option_works_or_is_refused_in_one_line(tmp_path, capsys, read_only):
    "Issue 60: `--threads 0` was ignored, an unknown `--device` and an unwritable `--csv` ended in tracebacks (the latter after the benchmark)."
    from transject_nb.training.cli import main as cli
    def fails(argv, code):
        with pytest.raises(SystemExit) as e: cli(['bench', *argv])
        err = capsys.readouterr().err
        assert e.value.code == code and 'Traceback' not in err, err
        return err.strip().splitlines()[-1]
    tiny = ['--n', '8', '--reps', '1', '--warmup', '0', '--batch', '1', '--no-memory', '--d_model', '8', '--d_ff', '16', '--variants', 'transformer']
    assert '--threads: expected a positive integer, got 0' in fails(tiny + ['--threads', '0'], 2)
    assert "device 'gpu' is no device torch knows" in fails(tiny + ['--device', 'gpu'], 2)
    assert "device 'cuda:7'" in fails(tiny + ['--device', 'cuda:7'], 2)
    ro = tmp_path/'ro'; ro.mkdir(); (ro/'old.csv').write_text('kept\n'); read_only(ro)
    said = fails(tiny + ['--csv', str(ro/'t.csv')], 1)
    assert said == f'transject-nb bench: error: Permission denied: {ro}; choose a folder you can write to, or make it writable', said
    assert 'tokens_per_s' not in capsys.readouterr().out                          # refused before the benchmark
    assert [p.name for p in ro.iterdir()] == ['old.csv'] and (ro/'old.csv').read_text() == 'kept\n'
    prev = torch.get_num_threads()
    try:
        from transject_nb.training.utils import split_fields
        p = argparse.ArgumentParser(); add_bench_args(p)
        a, rest = p.parse_known_args(tiny + ['--threads', '2', '--csv', str(tmp_path/'t.csv')])
        df = bench_command(a, dict(split_fields(rest)))
        assert (df.threads == 2).all() and pd.read_csv(tmp_path/'t.csv').shape[0] == len(df)   # --threads took effect
    finally: torch.set_num_threads(prev)

