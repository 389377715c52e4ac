"""Two processes on CPU (gloo) against one process that sees the same global batches.

`ddp_train.py` trains a tiny softmax Transformer on generated ListOps for 3 epochs, once under
`torch.distributed.run --nproc_per_node 2` (fastai `distrib_ctx`, accelerate, DDP over gloo, batch 16 per process)
and once in this process's child with batch 32 grouped as the two processes' batches are (see its docstring).

Tolerances (float32): the per-epoch losses and accuracies, and the test logits, agree to 1e-5; every weight agrees
to 1e-5 except the attention's key bias. Softmax attention is invariant to the key bias (it adds the same q·b to every
score of a query), so its true gradient is 0 and what the two runs compute is float noise of ~1e-10; Adam with
eps=1e-9 turns that noise into steps of about lr, different in the two runs, which change nothing the model computes.
"""
import json, os, subprocess, sys
from pathlib import Path
import pytest, torch

HERE = Path(__file__).resolve().parent
TOL = 1e-5


def _run(args, tmp):
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore')
    r = subprocess.run([sys.executable, *args], cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads((tmp/'ddp_result.json').read_text())


def test_two_processes_match_one(tmp_path):
    ddp, ref = tmp_path/'ddp', tmp_path/'ref'
    a = _run(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2', str(HERE/'ddp_train.py'), str(ddp)], ddp)
    b = _run([str(HERE/'ddp_train.py'), str(ref), '--reference'], ref)
    assert (a['world_size'], b['world_size']) == (2, 1)
    for k in ('train_loss', 'valid_loss', 'accuracy'):
        assert len(a['history'][k]) == 3
        assert max(abs(x - y) for x, y in zip(a['history'][k], b['history'][k])) < TOL, (k, a['history'][k], b['history'][k])
    assert abs(a['results']['test_loss'] - b['results']['test_loss']) < TOL
    la, lb = torch.load(ddp/'test_logits.pt', weights_only=True), torch.load(ref/'test_logits.pt', weights_only=True)
    assert (la - lb).abs().max().item() < TOL
    wa, wb = torch.load(ddp/'models'/'best.pth', weights_only=True), torch.load(ref/'models'/'best.pth', weights_only=True)
    d = 16                                                      # d_model of the test model: qkv.bias is [q | k | v]
    for k in wa:
        x, y = (wa[k][:d], wb[k][:d]) if k.endswith('qkv.bias') else (wa[k], wb[k])
        if k.endswith('qkv.bias'): x, y = torch.cat([x, wa[k][2*d:]]), torch.cat([y, wb[k][2*d:]])
        assert (x - y).abs().max().item() < TOL, k
    # training made a difference: the model is not at its initial weights
    assert a['history']['valid_loss'][-1] < a['history']['valid_loss'][0]
