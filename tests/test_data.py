"""Tests of transject_nb.training.data. They use only generated data and tiny files written here: no shared data, no network."""
import gzip, logging, pickle, random, warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import transject_nb.training.data as D
import transject_nb.training.tasks as TK
import transject_nb.training.tokenizers as TZ
from transject_nb.core import PAD_ID, check_tokens
from transject_nb.training.data import (LISTOPS_VOCAB, ListOpsConfig, TokenSplit, eval_listops,
                                        generate_listops, listops_tokens, listops_tree, listops_value,
                                        lra_source, pad_batch)
from transject_nb.training.readers import read_agnews, read_imdb, read_listops_tsv
from transject_nb.training.tokenizers import ListOpsTokenizer, ByteTokenizer, WordPieceTokenizer
from transject_nb.training.tasks import carve, load_task, stratified_take
from transject_nb.training.items import TaskItems, TokenIds, encode_text, task_datasets
from fastai.data.core import test_set as fastai_test_set

SMALL = dict(min_length=5, max_length=40, max_depth=4, max_args=5)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    "No test may reach the network or the user's cache."
    monkeypatch.setenv('TRANSJECT_CACHE', str(tmp_path / 'default-cache'))
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    monkeypatch.setattr(TZ, '_hub_vocab', lambda: None)
    def no_fetch(task): raise AssertionError('a test tried to download')
    monkeypatch.setattr(TK, '_fetch', no_fetch)


def small_cfg(**kw): return ListOpsConfig(**{**dict(n_train=60, n_valid=10, n_test=10), **SMALL, **kw})


def decode(ids): return ' '.join(LISTOPS_VOCAB[int(i)] for i in ids)


# ---------------------------------------------------------------- ListOps generator and evaluator
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), max_depth=st.integers(2, 6), max_args=st.integers(2, 6))
def test_generator_labels_match_independent_evaluator(seed, max_depth, max_args):
    cfg = ListOpsConfig(n_train=20, n_valid=3, n_test=3, min_length=2, max_length=60, max_depth=max_depth, max_args=max_args)
    for sp in generate_listops(cfg, seed=seed).values():
        for i in range(len(sp)):
            ids, y = sp[i]
            assert eval_listops(decode(ids)) == y
            assert cfg.min_length < len(ids) < cfg.max_length


def test_tree_shape_follows_lra():
    cfg = ListOpsConfig(max_depth=4, max_args=3, min_length=0, max_length=100, early_stop=False)
    rng = random.Random(0)
    def depth(t): return 1 if isinstance(t, int) else 1 + max(depth(k) for k in t[1])
    def check(t):
        if isinstance(t, int): assert 0 <= t <= 9; return
        assert t[0] in D.LISTOPS_OPS and 2 <= len(t[1]) <= 3
        for k in t[1]: check(k)
    for _ in range(300):
        t, n = listops_tree(rng, cfg)
        check(t)
        assert depth(t) <= 4 and len(listops_tokens(t)) == n


def test_lra_source_and_evaluator():
    t = ('[MAX', [2, 9])
    assert lra_source(t) == '( ( ( [MAX 2 ) 9 ) ] )'
    assert eval_listops(lra_source(t)) == 9 == listops_value(t)
    assert eval_listops('[MED 1 2 3 8 ]') == 2 == listops_value(('[MED', [1, 2, 3, 8]))
    assert eval_listops('[SM 9 9 5 X') == 3
    assert eval_listops('[MIN 4 [MAX 1 7 ] 5 ]') == 4
    for bad, msg in [('[MAX 2', 'never closed'), ('2 ]', 'closes no operator'), ('1 2', 'exactly one'), ('[MAX ]', 'no arguments'),
                     ('[FIRST 1 ]', 'unknown ListOps token')]:
        with pytest.raises(ValueError, match=msg): eval_listops(bad)


def test_generator_reproducible_disjoint_and_test_independent_of_n_train():
    a = generate_listops(small_cfg(), seed=3)
    b = generate_listops(small_cfg(), seed=3)
    c = generate_listops(small_cfg(n_train=5), seed=3)
    for k in a: assert torch.equal(a[k].flat, b[k].flat)
    assert torch.equal(a['test'].flat, c['test'].flat) and torch.equal(a['valid'].flat, c['valid'].flat)
    seqs = [bytes(sp.flat[int(sp.offsets[i]):int(sp.offsets[i + 1])].numpy()) for sp in a.values() for i in range(len(sp))]
    assert len(seqs) == len(set(seqs)) == 80
    assert not torch.equal(generate_listops(small_cfg(), seed=4)['test'].flat, a['test'].flat)


def test_early_stop_keeps_the_window():
    cfg = ListOpsConfig(n_train=30, n_valid=1, n_test=1, min_length=20, max_length=50)
    sp = generate_listops(cfg, seed=0)['train']
    assert int(sp.lengths.min()) > 20 and int(sp.lengths.max()) < 50


def test_generator_config_errors():
    with pytest.raises(ValueError, match='longest has'): ListOpsConfig(max_depth=2, max_args=3, min_length=10, max_length=20)
    with pytest.raises(ValueError, match='n_train must be a positive int'): ListOpsConfig(n_train=0)
    with pytest.raises(ValueError, match='op_p'): ListOpsConfig(op_p=1.5)
    with pytest.raises(RuntimeError, match='gave no new tree'):
        generate_listops(ListOpsConfig(n_train=20, n_valid=1, n_test=1, min_length=0, max_length=2, max_tries=500))


# ---------------------------------------------------------------- TokenSplit
@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(1, 30000), min_size=1, max_size=12), min_size=1, max_size=20), st.integers(1, 8))
def test_token_split_roundtrip_and_truncate(seqs, max_len):
    s = TokenSplit.from_lists(seqs, [i % 3 for i in range(len(seqs))])
    for i, q in enumerate(seqs):
        ids, y = s[i]
        assert ids.dtype == torch.long and ids.tolist() == q and y == i % 3
    t = s.truncate(max_len)
    assert [t[i][0].tolist() for i in range(len(t))] == [q[:max_len] for q in seqs]
    assert t.n_truncated == sum(len(q) > max_len for q in seqs)
    perm = list(reversed(range(len(seqs))))
    assert [s.subset(perm)[i][0].tolist() for i in range(len(seqs))] == [seqs[j] for j in perm]
    x, y = s.batch(range(len(seqs)))
    assert x.shape == (len(seqs), max(map(len, seqs))) and (x != PAD_ID).sum(1).tolist() == [len(q) for q in seqs]
    check_tokens(x, 30001, 64)
    assert torch.equal(x, pad_batch(seqs)) and y.tolist() == [i % 3 for i in range(len(seqs))]
    idx = list(reversed(range(len(seqs)))) + [0, -1]                         # any order, repeats, negative indices
    xm, ym = s.batch(idx, pad_to=20, max_len=max_len)
    assert torch.equal(xm, pad_batch([seqs[i][:max_len] for i in idx], pad_to=20)) and ym.tolist() == [y[i].item() for i in idx]
    with pytest.raises(IndexError, match='out of range'): s.batch([len(seqs)])


def test_token_split_validation_and_pad_batch():
    with pytest.raises(ValueError, match='at least one token'): TokenSplit.from_lists([[1], []], [0, 0])
    with pytest.raises(ValueError, match='labels'): TokenSplit.from_lists([[1]], [0, 1])
    with pytest.raises(IndexError): TokenSplit.from_lists([[1]], [0])[1]
    assert pad_batch([[1, 2], [3]], pad_to=4).tolist() == [[1, 2, 0, 0], [3, 0, 0, 0]]


def test_carve_and_take_are_stratified_and_seeded():
    labels = np.array([0] * 80 + [1] * 20)
    kept, carved = carve(labels, 0.1, seed=1)
    assert np.bincount(labels[carved]).tolist() == [8, 2]
    assert sorted(np.concatenate([kept, carved]).tolist()) == list(range(100))
    assert np.array_equal(carve(labels, 0.1, seed=1)[1], carved)
    assert np.bincount(labels[stratified_take(labels, 50, 0)]).tolist() == [40, 10]
    with pytest.raises(ValueError): carve(labels, 0, 1)


# ---------------------------------------------------------------- load_task: ListOps
def test_load_listops_generated_and_cache(tmp_path, caplog):
    kw = dict(max_len=30, n_train=40, n_valid=8, n_test=8, cache_dir=tmp_path, **SMALL)
    with caplog.at_level(logging.INFO, logger='transject_nb'):
        td = load_task('listops', **kw)
        td2 = load_task('listops', **kw)
    assert 'loaded from cache' in caplog.text
    assert (len(td.train), len(td.valid), len(td.test)) == (40, 8, 8)
    assert td.vocab_sz == len(LISTOPS_VOCAB) and td.n_classes == 10
    assert int(td.train.lengths.max()) <= 30
    for k in td.splits: assert torch.equal(td.splits[k].flat, td2.splits[k].flat)
    # truncated expressions keep their full-tree label; untruncated ones evaluate to it
    for sp in td.splits.values():
        for i in range(len(sp)):
            ids, y = sp[i]
            if len(ids) < 30: assert eval_listops(td.tokenizer.decode(ids)) == y
    assert set(td.summary().index) == {'train', 'valid', 'test'}
    assert [p.suffix for p in tmp_path.iterdir()] == ['.pt']


def test_listops_small_max_len_adapts_window(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger='transject_nb'):
        td = load_task('listops', max_len=40, n_train=30, n_valid=5, n_test=5, cache_dir=False)
    assert 'generating trees of length in (10, 41)' in caplog.text
    assert td.train.n_truncated == 0 and int(td.train.lengths.max()) <= 40 and int(td.train.lengths.min()) > 10


def test_corrupt_cache_is_rebuilt(tmp_path, caplog):
    kw = dict(max_len=30, n_train=20, n_valid=4, n_test=4, cache_dir=tmp_path, **SMALL)
    td = load_task('listops', **kw)
    f = next(tmp_path.iterdir())
    f.write_bytes(b'not a torch file')
    with caplog.at_level(logging.WARNING, logger='transject_nb'):
        td2 = load_task('listops', **kw)
    assert 'corrupt or unreadable' in caplog.text
    assert torch.equal(td.train.flat, td2.train.flat)
    assert load_task('listops', **kw).cache_key == td.cache_key  # the rebuilt file reads back
    assert len(list(tmp_path.iterdir())) == 1


def write_tsv(p: Path, rows, header='Source\tTarget'):
    p.write_text('\n'.join([header] + [f'{s}\t{t}' for s, t in rows]) + '\n')


def test_listops_tsv_roundtrip(tmp_path):
    gen = generate_listops(small_cfg(n_train=12, n_valid=4, n_test=4), seed=0)
    rng = random.Random(0)
    for name, f in (('train', 'train'), ('valid', 'val'), ('test', 'test')):
        rows = []
        for i in range(len(gen[name])):
            ids, y = gen[name][i]
            rows.append((decode(ids), y))
        write_tsv(tmp_path / f'basic_{f}.tsv', rows)
    # one row in LRA's own parenthesised form, with X for ]
    t = None
    while t is None or not 5 < n < 40: t, n = listops_tree(rng, small_cfg())
    write_tsv(tmp_path / 'basic_val.tsv', [(lra_source(t).replace(']', 'X'), listops_value(t))])
    td = load_task('listops', tmp_path, max_len=64, cache_dir=False, verify=True)
    assert len(td.train) == 12 and len(td.valid) == 1 and len(td.test) == 4
    assert td.tokenizer.decode(td.valid[0][0]) == ' '.join(listops_tokens(t))
    got = sorted((td.tokenizer.decode(td.train[i][0]), td.train[i][1]) for i in range(12))
    assert got == sorted((decode(gen['train'][i][0]), gen['train'][i][1]) for i in range(12))


def test_listops_tsv_errors(tmp_path):
    write_tsv(tmp_path / 'basic_val.tsv', [('[SM 1 2 ]', 3)])
    write_tsv(tmp_path / 'basic_test.tsv', [('[SM 1 2 ]', 3)])
    tr = tmp_path / 'basic_train.tsv'
    write_tsv(tr, [('[MIN 1 2 ]', 1), ('[MIN 1 2 ]', 11)])
    with pytest.raises(ValueError, match=rf"{tr}, line 3: unknown Target '11'"): read_listops_tsv(tmp_path)
    write_tsv(tr, [('[MIN 1 2 ]', 1), ('[AVG 1 2 ]', 1)])
    with pytest.raises(ValueError, match=r"line 3: unknown ListOps token '\[AVG'"): read_listops_tsv(tmp_path)
    tr.write_text('Source\tTarget\n[MIN 1 2 ]\t1\textra\n')
    with pytest.raises(ValueError, match='line 2: expected 2 tab-separated columns'): read_listops_tsv(tmp_path)
    write_tsv(tr, [('[MIN 1 2 ]', 2)])
    with pytest.raises(ValueError, match='line 2: Target 2 but the expression evaluates to 1'): read_listops_tsv(tmp_path, verify=True)
    write_tsv(tr, [])
    with pytest.raises(ValueError, match=rf'{tr}: empty split'): read_listops_tsv(tmp_path)
    write_tsv(tr, [('[MIN 1 2 ]', 1)], header='src\ttgt')
    with pytest.raises(ValueError, match='line 1: expected the header'): read_listops_tsv(tmp_path)
    (tmp_path / 'basic_test.tsv').unlink()
    with pytest.raises(FileNotFoundError, match='missing basic_test.tsv'): read_listops_tsv(tmp_path)
    with pytest.raises(TypeError, match='generator parameters'): load_task('listops', tmp_path, max_depth=3, cache_dir=False)


# ---------------------------------------------------------------- IMDb / char-IMDb
WORDS = ['the', 'movie', 'film', 'was', 'great', 'awful', 'good', 'bad', 'plot', 'acting']


def tiny_vocab(p: Path):
    p.write_text('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', ',', '!', '.', *WORDS, '##s']) + '\n')
    return p


def review(rng, label):
    w = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))] + ['great' if label else 'awful']
    return ' '.join(w) + '!'


def write_imdb_csv(d: Path, n=40, gz=True):
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for split in ('train', 'test'):
        lines = ['id,rating,label,text'] + [f'{i},{8 if i % 2 else 2},{i % 2},"{review(rng, i % 2)}, ""quoted"""' for i in range(n)]
        data = ('\n'.join(lines) + '\n').encode()
        if gz: (d / f'{split}.csv.gz').write_bytes(gzip.compress(data))
        else: (d / f'{split}.csv').write_bytes(data)
    return d


def write_aclimdb(d: Path, n=10):
    rng = random.Random(1)
    for split in ('train', 'test'):
        for lab in ('neg', 'pos'):
            (d / split / lab).mkdir(parents=True)
            for i in range(n): (d / split / lab / f'{i}_{8 if lab == "pos" else 2}.txt').write_text(review(rng, lab == 'pos') + ' <br /><br />')
    (d / 'train' / 'unsup').mkdir()
    return d


def test_imdb_csv_with_vocab(tmp_path):
    src = write_imdb_csv(tmp_path / 'imdb')
    vocab = tiny_vocab(tmp_path / 'vocab.txt')
    td = load_task('imdb', src, max_len=8, vocab=vocab, cache_dir=tmp_path / 'c', seed=0)
    assert (len(td.train), len(td.valid), len(td.test)) == (36, 4, 40)
    assert td.vocab_sz == len(vocab.read_text().split()) and td.n_classes == 2
    assert td.valid.label_counts().tolist() == [2, 2]
    assert int(td.train.lengths.max()) <= 8 and td.train.n_truncated > 0
    x, y = td.train.batch(range(len(td.train)))
    check_tokens(x, td.vocab_sz, td.max_len)
    assert td.tokenizer.decode(td.tokenizer.encode('The movie was GREAT!')) == 'the movie was great!'
    assert td.tokenizer.encode('films') == [td.tokenizer.tok.token_to_id('film'), td.tokenizer.tok.token_to_id('##s')]
    # no example of valid is in train: carved from disjoint rows
    raw = read_imdb(src)['train']
    assert len(raw.texts) == 40
    sub = load_task('imdb', src, max_len=8, vocab=vocab, n_train=10, n_test=6, cache_dir=False, seed=0)
    assert len(sub.train) == 10 and sub.train.label_counts().tolist() == [5, 5] and len(sub.test) == 6


def test_cache_key_follows_contents_not_paths_or_times(tmp_path):
    "A data set copied elsewhere (new paths, new times) keeps its key, so its cache and its runs' checkpoints; changed contents change it."
    import os, shutil
    src = write_imdb_csv(tmp_path / 'imdb'); vocab = tiny_vocab(tmp_path / 'vocab.txt')
    key = load_task('imdb', src, max_len=8, vocab=vocab, cache_dir=False, seed=0).cache_key
    copy = tmp_path / 'elsewhere' / 'imdb'; shutil.copytree(src, copy)
    for f in copy.iterdir(): os.utime(f, (1, 1))
    assert load_task('imdb', copy, max_len=8, vocab=vocab, cache_dir=False, seed=0).cache_key == key
    acl = write_aclimdb(tmp_path / 'aclImdb'); acl2 = tmp_path / 'moved' / 'aclImdb'; shutil.copytree(acl, acl2)
    k1, k2 = (load_task('charimdb', a, max_len=20, cache_dir=False).cache_key for a in (acl, acl2))
    assert k1 == k2
    f = next((copy).glob('train.csv*')); data = f.read_bytes()
    f.write_bytes(gzip.compress(gzip.decompress(data).replace(b'great', b'GREAT')) if f.suffix == '.gz' else data.replace(b'great', b'GREAT'))
    assert load_task('imdb', copy, max_len=8, vocab=vocab, cache_dir=False, seed=0).cache_key != key


def test_vocab_found_beside_the_source(tmp_path):
    src = write_imdb_csv(tmp_path / 'data' / 'imdb')
    (tmp_path / 'data' / 'bert-base-uncased').mkdir()
    tiny_vocab(tmp_path / 'data' / 'bert-base-uncased' / 'vocab.txt')
    td = load_task('imdb', src, max_len=16, cache_dir=False)
    assert td.vocab_sz == len(WORDS) + 9


def test_imdb_trains_vocab_without_one_and_logs_it(tmp_path, caplog):
    src = write_imdb_csv(tmp_path / 'imdb', gz=False)
    with caplog.at_level(logging.WARNING, logger='transject_nb'):
        td = load_task('imdb', src, max_len=32, cache_dir=tmp_path / 'c', vocab_size=80)
    assert 'trained a WordPiece vocab of size' in caplog.text and 'no bert-base-uncased vocab.txt found' in caplog.text
    assert td.tokenizer.tok.token_to_id('[PAD]') == 0 and td.vocab_sz <= 80
    td2 = load_task('imdb', src, max_len=32, cache_dir=tmp_path / 'c', vocab_size=80)  # from the cache, tokenizer included
    assert td2.tokenizer.encode('the movie was great') == td.tokenizer.encode('the movie was great')


def test_aclimdb_folder_and_charimdb(tmp_path):
    src = write_aclimdb(tmp_path / 'aclImdb')
    td = load_task('charimdb', tmp_path, max_len=20, cache_dir=False)  # the parent of aclImdb is accepted too
    assert (len(td.train), len(td.valid), len(td.test)) == (18, 2, 20)
    assert td.vocab_sz == 257 and int(td.train.lengths.max()) <= 20
    full = load_task('charimdb', src, max_len=4096, cache_dir=False)
    texts = {full.tokenizer.decode(full.test[i][0]) for i in range(len(full.test))}
    assert all(t.endswith(' <br /><br />') for t in texts)
    assert full.test.label_counts().tolist() == [10, 10]
    assert ByteTokenizer().encode('é') == [0xC3 + 1, 0xA9 + 1]


def test_imdb_errors(tmp_path):
    d = tmp_path / 'bad'; d.mkdir()
    (d / 'test.csv').write_text('id,rating,label,text\n0,1,0,fine\n')
    (d / 'train.csv').write_text('id,rating,label,text\n0,1,0,"ok"\n1,2,2,"hm"\n')
    with pytest.raises(ValueError, match=rf"{d / 'train.csv'}, line 3: unknown label '2'"): read_imdb(d)
    (d / 'train.csv').write_text('id,rating,label,text\n0,1,0,"ok"\n1,2,1\n')
    with pytest.raises(ValueError, match='line 3: expected 4 columns'): read_imdb(d)
    (d / 'train.csv').write_text('id,rating,label,text\n0,1,0,"ok\n')
    with pytest.raises(ValueError, match=rf"{d / 'train.csv'}, line \d+: malformed CSV"): read_imdb(d)
    (d / 'train.csv').write_text('id,rating,label,text\n0,1,0,"  "\n')
    with pytest.raises(ValueError, match='line 2: empty text'): read_imdb(d)
    (d / 'train.csv').write_text('id,rating,text\n0,1,"ok"\n')
    with pytest.raises(ValueError, match="line 1: header .* lacks the columns 'label' and 'text'"): read_imdb(d)
    (d / 'train.csv').write_text('id,rating,label,text\n')
    with pytest.raises(ValueError, match=rf"{d / 'train.csv'}: empty split"): read_imdb(d)
    (d / 'train.csv').unlink()
    with pytest.raises(FileNotFoundError, match=r'no train.csv\[.gz\].*expected an aclImdb folder'): read_imdb(d)
    e = tmp_path / 'acl'; (e / 'train' / 'neg').mkdir(parents=True); (e / 'train' / 'pos').mkdir()
    (e / 'test' / 'neg').mkdir(parents=True); (e / 'test' / 'pos').mkdir()
    with pytest.raises(ValueError, match='empty split'): read_imdb(e)
    with pytest.raises(FileNotFoundError, match='does not exist'): load_task('imdb', tmp_path / 'nowhere', cache_dir=False)


def test_empty_split_after_carving(tmp_path):
    d = tmp_path / 'one'; d.mkdir()
    for s in ('train', 'test'): (d / f'{s}.csv').write_text('label,text\n0,"the movie"\n')
    with pytest.raises(ValueError, match=r'cannot carve a stratified part of size 0.1 from 1 examples with class counts \{0: 1\}'): load_task('charimdb', d, cache_dir=False)


def test_offline_without_source_names_the_layout(monkeypatch):
    monkeypatch.undo()  # restore the real _fetch, but make fastai's download fail as offline
    import fastai.data.external as fe
    def offline(url, *a, **k): raise OSError('Name or service not known')
    monkeypatch.setattr(fe, 'untar_data', offline)
    monkeypatch.setattr(TZ, '_hub_vocab', lambda: None)
    with pytest.raises(FileNotFoundError, match=r"untar_data\(URLs.IMDB\).*pass source= a local path: an aclImdb folder"):
        load_task('imdb', cache_dir=False)
    with pytest.raises(FileNotFoundError, match=r"URLs.AG_NEWS.*train.csv\[.gz\] and test.csv\[.gz\]"):
        load_task('agnews', cache_dir=False)


# ---------------------------------------------------------------- AG News
def write_agnews(d: Path, splits=('train', 'test'), n=40):
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(2)
    for s in splits:
        rows = [f'"{i % 4 + 1}","Title {i}","{review(rng, i % 2)} \\$5 #39;s"' for i in range(n)]
        (d / f'{s}.csv').write_text('\n'.join(rows) + '\n')
    return d


def test_agnews_classes_and_text(tmp_path):
    d = write_agnews(tmp_path / 'ag')
    raw = read_agnews(d)
    assert sorted(set(raw['train'].labels)) == [0, 1, 2, 3]
    assert raw['test'].texts[0].startswith('Title 0 ') and raw['test'].labels[0] == 0
    td = load_task('agnews', d, vocab=tiny_vocab(tmp_path / 'v.txt'), max_len=16, cache_dir=False)
    assert td.n_classes == 4 and len(td.test) == 40 and td.classes[3] == 'Sci/Tech'
    assert td.notes == ()


def test_agnews_only_test_csv_carves_with_a_loud_warning(tmp_path):
    d = write_agnews(tmp_path / 'ag', splits=('test',), n=100)
    kw = dict(vocab=tiny_vocab(tmp_path / 'v.txt'), max_len=16, cache_dir=tmp_path / 'c')
    with pytest.warns(UserWarning, match='not comparable with published AG News results'):
        td = load_task('agnews', d, **kw)
    assert (len(td.train), len(td.valid), len(td.test)) == (72, 8, 20)
    assert td.test.label_counts().tolist() == [5, 5, 5, 5]
    with pytest.warns(UserWarning, match='carved from test.csv'):   # repeated on a cache hit
        load_task('agnews', d, **kw)


def test_agnews_errors(tmp_path):
    d = tmp_path / 'ag'; d.mkdir()
    with pytest.raises(FileNotFoundError, match=r'no test.csv\[.gz\]'): read_agnews(d)
    (d / 'test.csv').write_text('"1","a","b"\n"0","a","b"\n')
    with pytest.raises(ValueError, match=rf"{d / 'test.csv'}, line 2: unknown class '0'; expected 1, 2, 3 or 4"): read_agnews(d)
    (d / 'test.csv').write_text('"1","a","b"\n"2","a"\n')
    with pytest.raises(ValueError, match='line 2: expected 3 columns'): read_agnews(d)
    (d / 'test.csv').write_text('')
    with pytest.raises(ValueError, match='empty split'): read_agnews(d)


# ---------------------------------------------------------------- argument checks
def test_load_task_argument_errors(tmp_path):
    with pytest.raises(ValueError, match='valid tasks are: imdb, agnews, listops, charimdb'): load_task('sst2')
    with pytest.raises(TypeError, match="unknown keyword argument"): load_task('listops', max_len=30, foo=1)
    with pytest.raises(TypeError, match='vocab= applies'): load_task('charimdb', tmp_path, vocab='x')
    with pytest.raises(ValueError, match='max_len must be a positive int'): load_task('listops', max_len=0)
    with pytest.raises(ValueError, match='n_train must be a positive int'): load_task('listops', n_train=0)


def test_wordpiece_requires_pad_zero(tmp_path):
    p = tmp_path / 'v.txt'; p.write_text('[UNK]\n[PAD]\nthe\n')
    with pytest.raises(ValueError, match=r"'\[PAD\]' must be token 0"): WordPieceTokenizer.from_vocab(p)


# ---------------------------------------------------------------- IMDB_SAMPLE layout
def write_imdb_sample(d: Path, n=50):
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(3)
    rows = ['label,text,is_valid'] + [f'{"positive" if i % 2 else "negative"},"{review(rng, i % 2)}",{i % 5 == 0}' for i in range(n)]
    (d / 'texts.csv.gz').write_bytes(gzip.compress(('\n'.join(rows) + '\n').encode()))
    return d


def test_imdb_sample_layout(tmp_path):
    d = write_imdb_sample(tmp_path / 'imdb_sample')
    raw = read_imdb(d)
    assert (len(raw['train'].texts), len(raw['test'].texts)) == (40, 10)        # the is_valid rows are the test split
    assert raw['test'].labels == [i % 2 for i in range(0, 50, 5)]
    td = load_task('imdb', d, vocab=tiny_vocab(tmp_path / 'v.txt'), max_len=16, cache_dir=False)
    assert (len(td.train), len(td.valid), len(td.test)) == (36, 4, 10)
    (d / 'texts.csv.gz').write_bytes(gzip.compress(b'label,text,is_valid\npositive,"fine",maybe\n'))
    with pytest.raises(ValueError, match="line 2: is_valid is 'maybe'; expected True/False"): read_imdb(d)
    (d / 'texts.csv.gz').write_bytes(gzip.compress(b'label,text\npositive,"fine"\n'))
    with pytest.raises(ValueError, match="lacks the column 'is_valid'"): read_imdb(d)


# ---------------------------------------------------------------- fastai Datasets
def _tiny(task, tmp_path):
    if task == 'listops': return load_task('listops', max_len=30, n_train=40, n_valid=8, n_test=8, cache_dir=False, **SMALL)
    if task == 'imdb': return load_task('imdb', write_imdb_csv(tmp_path / 'imdb'), vocab=tiny_vocab(tmp_path / 'v.txt'), max_len=8, cache_dir=False)
    if task == 'agnews': return load_task('agnews', write_agnews(tmp_path / 'ag'), vocab=tiny_vocab(tmp_path / 'v.txt'), max_len=8, cache_dir=False)
    return load_task('charimdb', write_aclimdb(tmp_path / 'aclImdb'), max_len=20, cache_dir=False)


@pytest.mark.parametrize('task', ['listops', 'imdb', 'agnews', 'charimdb'])
def test_task_datasets_encode_and_decode(task, tmp_path):
    td = _tiny(task, tmp_path)
    ds = task_datasets(td)
    parts = [ds.train, ds.valid, ds.subset(2)]
    assert [len(p) for p in parts] == [len(td.train), len(td.valid), len(td.test)]
    assert list(ds.tls[1].vocab) == list(td.classes)                          # Categorize carries the class names
    for part, split in zip(parts, td.splits.values()):
        for i in (0, len(split) - 1):
            x, y = part[i]
            ids, label = split[i]
            assert type(x).__name__ == 'TensorText' and torch.equal(x, ids) and int(y) == label
            text, cat = part.decode((x, y))
            assert text == td.tokenizer.decode(ids) and cat == td.classes[label]
    # raw texts (fastai's test_set, as dls.test_dl makes): tokenised as the data were, cut to max_len; empty is refused
    raw = [td.tokenizer.decode(td.test[0][0]), ' '.join([td.tokenizer.decode(td.test[1][0])] * 20)]
    ts = fastai_test_set(ds.valid, raw)
    assert ts[0][0].tolist() == td.tokenizer.encode(raw[0])[:td.max_len]
    assert len(ts[1][0]) == td.max_len and ts[1][0].tolist() == td.tokenizer.encode(raw[1])[:td.max_len]
    with pytest.raises(ValueError, match='empty text'): fastai_test_set(ds.valid, [' \t'])[0]
    with pytest.raises(ValueError, match='empty text'): encode_text(td.tokenizer, '')
    with pytest.raises(TypeError, match='expected a text'): encode_text(td.tokenizer, 5)


def test_task_items_batches_and_pickling(tmp_path):
    td = _tiny('listops', tmp_path)
    items = TaskItems([td.train, td.valid, td.test])
    assert len(items) == 56 and [len(r) for r in items.ranges] == [40, 8, 8]
    gidx = [55, 3, 41, 40, 0, 47]                                             # test, train, valid, valid, train, valid
    want = [td.test[7], td.train[3], td.valid[1], td.valid[0], td.train[0], td.valid[7]]
    for g, (ids, y) in zip(gidx, want): assert torch.equal(items[g][0], ids) and items.label(g) == y
    x, y = items.batch(gidx, max_len=12)                                      # across splits, one padded batch
    assert torch.equal(x, pad_batch([ids[:12] for ids, _ in want])) and y.tolist() == [lab for _, lab in want]
    assert torch.equal(items.batch([4, 9])[0], td.train.batch([4, 9])[0])    # one split
    assert items.lengths.tolist() == torch.cat([td.train.lengths, td.valid.lengths, td.test.lengths]).tolist()
    with pytest.raises(IndexError, match='example 56 is out of range: the task has 56 examples'): items.batch([1, 56])
    with pytest.raises(TypeError, match='needs a non-empty sequence of TokenSplit'): TaskItems([[1, 2]])
    # pickled (as learn.export does), the transforms keep the tokenizer and drop the data
    ds = task_datasets(td)
    tfm = pickle.loads(pickle.dumps(ds.tls[0].tfms.fs[0]))
    assert isinstance(tfm, TokenIds) and tfm.items is None and tfm.max_len == 30
    assert tfm('[MAX 1 2 ]').tolist() == td.tokenizer.encode('[MAX 1 2 ]')
    with pytest.raises(ValueError, match='carries no examples'): tfm(3)
    blob = pickle.dumps(ds.new_empty())                                       # what learn.export pickles of the data
    assert b'TaskItems' not in blob and b'TokenSplit' not in blob
    with pytest.raises(TypeError, match='needs a TaskData'): task_datasets(td.train)
