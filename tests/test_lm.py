"Tests of causal attention (transject_nb.baselines) and the language models of transject_nb.training.lm (runs: training.lm_runs; studies: lab.lm_studies); no data files needed."
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated')
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import Perplexity
from fastai.torch_core import set_seed

from transject_nb.baselines import attention_mask, future_leak, remove_similarity_causal
from transject_nb.core import PAD_ID
from transject_nb.training.lm import (CAUSAL_VARIANTS, LanguageModel, generate, lm_dls, lm_learner, lm_stream,
                                      unigram_perplexity)
from transject_nb.models import BASELINES, VARIANTS, create_model
from transject_nb.similarity import remove_similarity

torch.set_num_threads(1)
V = 60


def padded_batch(seed=0):
    "Three rows: right padding, left padding, none."
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, V, (3, 11), generator=g)
    x[0, 8:] = 0; x[1, :3] = 0
    return x


def model(name, causal, seed=0, **cfg):
    torch.manual_seed(seed)
    m = create_model(name, V, 2, d_model=16, n_layers=3, max_len=32, causal=causal, **cfg).eval()
    if m.cfg.rezero:                                   # ReZero is the identity at α = 0: nothing could leak
        with torch.no_grad():
            for b in m.blocks: b.alpha.fill_(0.5)
    return m


# --- the causal mask and the prefix-mean removal ------------------------------------------

def test_causal_variants_are_the_softmax_family():
    assert CAUSAL_VARIANTS == BASELINES


def test_attention_mask():
    m = torch.tensor([[1, 1, 0], [0, 1, 1]]).bool()
    assert torch.equal(attention_mask(m), m[:, None, None, :])
    cm = attention_mask(m, causal=True)[:, 0]
    assert not cm.triu(1).any() and cm.any(-1).all()
    assert torch.equal(cm & m[:, :, None], (m[:, :, None] & m[:, None, :]).tril())


def test_prefix_mean_removal_is_the_formula_and_causal():
    torch.manual_seed(0)
    Y = torch.randn(2, 6, 3, dtype=torch.float64)
    mk = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]).bool()
    want = torch.stack([torch.stack([Y[b, t] - 0.5 * Y[b, :t + 1][mk[b, :t + 1]].mean(0) if mk[b, :t + 1].any() else Y[b, t]
                                     for t in range(6)]) for b in range(2)])
    assert torch.allclose(remove_similarity_causal(Y, mk, 0.5), want, atol=1e-12)
    Y2 = Y.clone(); Y2[:, 3] += 1.
    assert torch.equal(remove_similarity_causal(Y2, mk)[:, :3], remove_similarity_causal(Y, mk)[:, :3])
    assert (remove_similarity(Y2, mk) - remove_similarity(Y, mk))[:, :3].abs().max() > 0.2   # the full mean leaks


# --- no position sees the future ------------------------------------------------------------

@pytest.mark.parametrize('name', BASELINES)
@pytest.mark.parametrize('sym', [False, True])
def test_no_future_when_causal(name, sym):
    x = padded_batch()
    m = model(name, True, sym=sym)
    for t in (0, 2, 5, 7, 8, 9):
        assert future_leak(m, x, t) < 1e-6, f"{name}: position <= {t} saw token {t + 1}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('name', BASELINES)
@pytest.mark.parametrize('bf16', [False, True])
def test_no_future_when_causal_cuda(name, bf16):
    "The same on the GPU's attention kernels, in float32 and under bfloat16 autocast."
    x, m = padded_batch().cuda(), model(name, True).cuda()
    with torch.autocast('cuda', dtype=torch.bfloat16, enabled=bf16):
        for t in (0, 2, 5, 7, 8, 9):
            assert future_leak(m, x, t) < 1e-6, f"{name} on CUDA (bf16={bf16}): position <= {t} saw token {t + 1}"


@pytest.mark.parametrize('name', BASELINES)
def test_future_seen_when_not_causal(name):
    x = padded_batch()
    m = model(name, False)
    for t in (0, 2, 5, 9):
        assert future_leak(m, x, t) > 1e-3, f"{name}: the test cannot fail (no change at t={t} without the mask)"


def test_full_mean_similarity_removal_would_leak():
    from transject_nb.baselines import SimilarityRemovalBlock, SimilarityRemovalEncoder
    class FullBlock(SimilarityRemovalBlock):
        def correct(self, a, mask, ctx): return remove_similarity(a, mask, self.cfg.tau)
    class Full(SimilarityRemovalEncoder): Block = FullBlock
    m = model('similarity-removal', True)
    full = Full(m.cfg).eval(); full.load_state_dict(m.state_dict())
    x = padded_batch()
    assert future_leak(m, x, 4) < 1e-6 and future_leak(full, x, 4) > 1e-3


@pytest.mark.parametrize('name', BASELINES)
def test_causal_default_off_and_padding_invariant(name):
    assert create_model(name, V, 2).cfg.causal is False
    m = model(name, True)
    x = padded_batch()
    with torch.no_grad():
        assert torch.allclose(m.encode(x)[-1][:1, :8], m.encode(x[:1, :8])[-1], atol=1e-5)


@pytest.mark.parametrize('name', [v for v in VARIANTS if v not in BASELINES])
def test_transject_cannot_be_causal(name):
    with pytest.raises(ValueError, match=re.escape("Σ(X⁰) is computed from the whole sequence")):
        create_model(name, V, 2, causal=True)
    assert not hasattr(create_model(name, V, 2, causal=False).cfg, 'causal')


# --- the language model ----------------------------------------------------------------------

def test_language_model_tie_shapes_and_no_future():
    enc = create_model('neutreno', V, 2, d_model=16, n_layers=2, max_len=32, causal=True, lam=0.4)
    lm = LanguageModel(enc, V).eval()
    assert lm.head.decoder.weight is enc.emb.weight
    free = LanguageModel(create_model('neutreno', V, 2, d_model=16, n_layers=2, max_len=32, causal=True), V, tie_weights=False)
    assert free.head.decoder.weight is not free.encoder.emb.weight
    assert sum(p.numel() for p in free.parameters()) - sum(p.numel() for p in lm.parameters()) == V * 16
    x = padded_batch()
    with torch.no_grad():
        y = lm(x); x2 = x.clone(); x2[:, 6] = x[:, 6] % (V - 1) + 1
        assert y.shape == (3, 11, V)
        assert torch.equal(lm(x2)[:, :6], y[:, :6])


def test_language_model_errors():
    with pytest.raises(ValueError, match='needs a causal encoder'): LanguageModel(create_model('transformer', V, 2), V)
    with pytest.raises(ValueError, match='cannot be causal'): LanguageModel(create_model('transject', V, 2), V)
    with pytest.raises(ValueError, match='differs from the encoder'): LanguageModel(create_model('transformer', V, 2, causal=True), V + 1)


def test_lm_stream_and_batches_shift_by_one():
    assert lm_stream([[5, 6], [7]], 3).tolist() == [5, 6, 3, 7, 3]
    with pytest.raises(ValueError, match='holds the padding id'): lm_stream([[5, 0]], 3)
    docs = [list(range(1 + 7 * i, 8 + 7 * i)) for i in range(20)]
    dls = lm_dls(docs[:15], docs[15:], 3, bs=2, seq_len=6, shuffle=False, device='cpu')
    s = lm_stream(docs[15:], 3)
    bl = (len(s) - 1) // 2
    x, y = dls.valid.one_batch()
    assert torch.equal(x[:, 1:], y[:, :-1])
    for r in range(2):
        assert x[r].tolist() == s[r * bl: r * bl + 6].tolist() and y[r].tolist() == s[r * bl + 1: r * bl + 7].tolist()


def test_perplexity_is_exp_of_mean_token_loss():
    from types import SimpleNamespace
    torch.manual_seed(0)
    logits, targ = torch.randn(3, 4, 9), torch.randint(0, 9, (3, 4))
    want = math.exp(-logits.log_softmax(-1).gather(-1, targ[..., None]).mean().item())
    ppl = Perplexity(); ppl.reset()
    ppl.accumulate(SimpleNamespace(training=False, yb=(targ,), loss=CrossEntropyLossFlat()(logits, targ), to_detach=lambda t: t.detach()))
    assert math.isclose(ppl.value.item(), want, rel_tol=1e-5)


def test_unigram_perplexity():
    assert math.isclose(unigram_perplexity(torch.arange(1, 5), torch.arange(1, 5), 5), 4.0, rel_tol=1e-12)
    p1, p2 = 4 / 7, 2 / 7
    assert math.isclose(unigram_perplexity(torch.tensor([1, 1, 2, 1]), torch.tensor([1, 2]), 4), math.exp(-(math.log(p1) + math.log(p2)) / 2))


def test_learner_trains_and_generates():
    docs = [[5 + (i + j) % 7 for j in range(12)] for i in range(240)]    # a periodic pattern a model can learn
    set_seed(0)
    dls = lm_dls(docs[:200], docs[200:], 3, bs=8, seq_len=16, device='cpu')
    learn = lm_learner(dls, 'transformer-prenorm', 16, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    with learn.no_bar(), learn.no_logging(): learn.fit(3, 1e-2)
    loss, acc, ppl = learn.validate()
    assert math.isclose(ppl, math.exp(loss), rel_tol=1e-4)
    assert ppl < unigram_perplexity(lm_stream(docs[:200], 3), lm_stream(docs[200:], 3), 16)
    greedy = generate(learn, [5, 6, 7], n=5, temperature=0)
    assert greedy.tolist() == generate(learn, [5, 6, 7], n=5, top_k=1, seed=0).tolist()
    assert generate(learn, [5], n=8, seed=1).tolist() == generate(learn, [5], n=8, seed=1).tolist()
    assert not (generate(learn, [5], n=50, temperature=5., seed=0) == PAD_ID).any()
    with pytest.raises(ValueError, match='a causal language model has causal=True; got causal=False'): lm_learner(dls, 'transformer', 16, causal=False)


def test_masking_rate_and_ignored_positions():
    from transject_nb.training.lm import IGNORE_INDEX, mask_tokens
    g = torch.Generator().manual_seed(1)
    x = torch.randint(5, 500, (32, 256), generator=g)
    inp, targ = mask_tokens(x, mask_id=4, vocab_sz=500, p=0.2, generator=g)
    chosen = targ != IGNORE_INDEX
    assert abs(chosen.float().mean().item() - 0.2) < 0.01
    assert torch.equal(inp[~chosen], x[~chosen]) and torch.equal(targ[chosen], x[chosen])
    assert abs((inp[chosen] == 4).float().mean().item() - 0.8) < 0.03



@pytest.mark.parametrize('variant', VARIANTS)
def test_the_masked_loss_is_the_same_with_the_head_on_the_chosen_positions_only(variant):
    "`LanguageModel(x, at)` scores the chosen positions alone: `MaskedLMLoss` and its gradients do not change."
    from transject_nb.training.lm import IGNORE_INDEX, MaskedLMLoss, mask_tokens
    torch.manual_seed(0)
    m = LanguageModel(create_model(variant, 60, 2, d_model=16, n_layers=2, max_len=12), 60, False, 'masked')
    inp, targ = mask_tokens(torch.randint(5, 60, (3, 12)), 4, 60, p=0.3, generator=torch.Generator().manual_seed(0))
    chosen = targ != IGNORE_INDEX
    def logits(at):                                    # the same draws each time: the entropic residual samples
        torch.manual_seed(1); return m(inp, at)
    def run(at):
        m.zero_grad(set_to_none=True)
        loss = MaskedLMLoss()(logits(at), targ); loss.backward()
        return loss.item(), {k: q.grad.clone() for k, q in m.named_parameters() if q.grad is not None}
    (full, g_full), (only, g_only) = run(None), run(chosen)
    assert logits(chosen).shape == (int(chosen.sum()), 60)
    assert math.isclose(full, only, rel_tol=1e-5)
    assert math.isclose(full, CrossEntropyLossFlat(ignore_index=IGNORE_INDEX)(logits(None), targ).item(), rel_tol=1e-5)
    assert g_full.keys() == g_only.keys()
    assert all(torch.allclose(g_full[k], g_only[k], atol=1e-6) for k in g_full)

def small_imdb(root, seed=0):
    "A small IMDb folder of made-up reviews (train, test, unsup CSVs and a vocab.txt); test review 0 is also in train."
    import pandas as pd
    root.mkdir(parents=True, exist_ok=True)
    words = 'the a film plot good bad long dull great music'.split()
    rnd = torch.Generator().manual_seed(seed)
    say = lambda: ' '.join(words[i] for i in torch.randint(0, len(words), (int(torch.randint(6, 20, (1,), generator=rnd)),), generator=rnd))
    tr, te, un = [say() for _ in range(30)], [say() for _ in range(30)], [say() for _ in range(40)]
    te[0] = tr[0]
    for name, texts in dict(train=tr, test=te).items():
        pd.DataFrame(dict(id=range(len(texts)), label=[i % 2 for i in range(len(texts))], text=texts)).to_csv(root/f'{name}.csv', index=False)
    pd.DataFrame(dict(id=range(len(un)), text=un)).to_csv(root/'unsup.csv', index=False)
    chars = sorted(set(''.join(words)))
    (root/'vocab.txt').write_text('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', *chars, *('##' + c for c in chars), *words]) + '\n')
    return root


def test_the_streams_respect_their_splits(tmp_path):
    "No held-out review is a training document, a review in both of IMDb's splits is dropped, and the cache gives the same."
    from transject_nb.training.lm_runs import load_lm_corpus
    small_imdb(tmp_path)
    c = load_lm_corpus(tmp_path, vocab_size=60, n_valid=8, n_test=8, cache_dir=tmp_path/'cache')
    train = {tuple(d.tolist()) for d in c.train}
    assert not train & {tuple(d.tolist()) for d in c.valid + c.test}
    assert c.dropped >= 1
    again = load_lm_corpus(tmp_path, vocab_size=60, n_valid=8, n_test=8, cache_dir=tmp_path/'cache')
    assert [d.tolist() for d in again.test] == [d.tolist() for d in c.test] and again.tokenizer.tok.get_vocab() == c.tokenizer.tok.get_vocab()


def test_a_runs_checkpoint_moves_a_sharded_loader(tmp_path):
    "A run's `TrainCheckpoint` sets the epoch on the `ShardedLoader` (no other callback does): epoch e reads part e."
    from fastai.callback.core import Callback
    from transject_nb.training.learner import train_learner
    from transject_nb.training.checkpoint import TrainCheckpoint
    from transject_nb.training.lm_runs import get_lm_learner, load_lm_corpus

    class Parts(Callback):
        def before_fit(self): self.parts = {}
        def before_batch(self):
            if self.training: self.parts[self.epoch] = self.dls.train.loaders.index(self.dls.train.dl)

    c = load_lm_corpus(small_imdb(tmp_path/'imdb'), vocab_size=60, n_valid=8, n_test=8, cache_dir=False)
    seen = Parts()
    learn = get_lm_learner('transformer', corpus=c, path=tmp_path/'run', preset='cpu', d_model=16, n_layers=1, n_heads=2,
                           d_ff=32, max_len=16, bs=2, epochs=3, patience=5, lr=1e-3, shards=3, device='cpu', cbs=seen)
    assert any(isinstance(cb, TrainCheckpoint) for cb in learn.cbs)
    train_learner(learn, progress=False)
    assert seen.parts == {0: 0, 1: 1, 2: 2}


def test_the_depth_trend_judges_slopes_both_ways():
    "A fix whose loss falls with depth against a base whose loss rises: the claim holds one way, fails the other, same p."
    import numpy as np
    import pandas as pd
    from transject_nb.lab.lm_studies import lm_depth_trend
    rng = np.random.default_rng(1)
    runs = pd.DataFrame([dict(variant=f'{a}+n_layers={L}', seed=s, test_loss=5 + b * math.log2(L) + rng.normal(0, .01),
                              train_loss=4.5 + rng.normal(0, .01))
                         for a, b in (('fix', -.02), ('base', .02)) for L in (2, 4, 8, 16) for s in (1, 2)])
    one, other = (lm_depth_trend(runs, base=b).set_index('arm') for b in ('base', 'fix'))
    assert one.loc['fix', 'test_verdict'] == 'reproduced' and one.loc['base', 'test_verdict'] == 'contradicted'
    assert one.loc['fix', 'vs_verdict'] == 'reproduced' and other.loc['base', 'vs_verdict'] == 'contradicted'
    assert math.isclose(one.loc['fix', 'vs_p'], other.loc['base', 'vs_p'])
    assert math.isclose(math.log1p(one.loc['fix', 'vs_change']), -math.log1p(other.loc['base', 'vs_change']))
    assert one.loc['fix', 'train_verdict'] == 'not shown'                  # training text: no trend was put in
