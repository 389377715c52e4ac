"""Train a tiny model with 2 processes (gloo, CPU) or with 1 process that sees the same global batches.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_train.py OUT   # distributed
    python tests/ddp_train.py OUT --reference                                                 # one process, batch 2B

With W processes of batch B, fastai's `DistributedDL` gives process r the r-th contiguous W-th of each epoch's
index list, and step t averages the gradients of every process's batch t. The reference run uses one process
with batch W*B whose step-t batch is the union of those W batches, so both take the same Adam steps up to the
order of floating-point additions. Used by `tests/test_distributed.py`.
"""
import json, sys
from pathlib import Path
import torch
from fastai.torch_core import rank_distrib, num_distrib
from transject_nb.training.tasks import load_task
from transject_nb.training.batches import BucketDL
from transject_nb.training.learner import end_distributed, get_learner, train_learner, history, evaluate

B, W = 16, 2            # per-process batch, processes

class Grouped(BucketDL):
    "Batches of W*B: step t takes the t-th B-batch of each of the W contiguous parts of the W-process order."
    def get_idxs(self):
        inner = BucketDL(self.dataset, bs=self.bs // W, shuffle=True, seed=self.seed, bucket=self.bucket)
        inner.set_epoch(self.epoch); self.epoch += 1
        idxs = inner.get_idxs()
        assert len(idxs) % (W * B) == 0, "the test uses a training set that splits evenly"
        parts, out = [idxs[r * len(idxs) // W:(r + 1) * len(idxs) // W] for r in range(W)], []
        for t in range(0, len(parts[0]), B):
            for p in parts: out += p[t:t + B]
        return out

def main(out, reference=False):
    torch.set_num_threads(1)
    data = load_task('listops', max_len=32, n_train=256, n_valid=128, n_test=64, cache_dir=False, progress=False,
                     min_length=4, max_length=32, max_depth=3, max_args=4)
    bs = W * B if reference else B
    learn = get_learner('listops', 'transformer', preset='cpu', data=data, path=out, device='cpu', d_model=16, n_heads=2, d_ff=32,
                        n_layers=1, max_len=32, epochs=3, patience=10, bs=bs, lr=2e-3)
    if reference:
        tr = learn.dls.train
        learn.dls.loaders[0] = Grouped(tr.dataset, bs=bs, shuffle=True, seed=tr.seed, bucket=tr.bucket, max_len=tr.max_len, device=tr.device)
    train_learner(learn, resume=False, progress=False)
    res = evaluate(learn)
    model = learn.model.eval()
    with torch.no_grad(): logits = model(data.test.batch(range(len(data.test)))[0])     # (n_test, n_classes)
    if rank_distrib() == 0:
        torch.save(logits, Path(out)/'test_logits.pt')
        json.dump(dict(world_size=max(num_distrib(), 1), history=history(learn).drop(columns='seconds').to_dict('list'), results=res),
                  open(Path(out)/'ddp_result.json', 'w'))
    end_distributed()   # a gloo group left open can abort the exit (SIGABRT) after the work is done

if __name__ == '__main__':
    main(sys.argv[1], reference='--reference' in sys.argv)
