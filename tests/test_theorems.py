"""`transject_nb.lab.theorems`: the ledger of the papers' theorems, its columns and verdicts, its determinism, and its
links to the theory pages."""
import json, re
from pathlib import Path

import pandas as pd
import pytest

from transject_nb.lab.theorems import COLUMNS, PAPERS, CHECKS, check_row, notebook_anchors, quarto_id, theorem_checks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def tbl():
    return theorem_checks()


def test_columns_and_dtypes(tbl):
    assert list(tbl.columns) == list(COLUMNS) == ['paper', 'claim', 'test', 'value', 'claimed', 'unit', 'holds', 'section', 'note']
    assert tbl.value.dtype == 'float64' and tbl.claimed.dtype == 'float64' and tbl.holds.dtype == bool
    for col in ('paper', 'claim', 'test', 'unit', 'section', 'note'):
        assert all(isinstance(v, str) and v for v in tbl[col]), col
    assert len(tbl) == len(CHECKS) and 12 <= len(tbl) <= 16 and tbl.claim.is_unique
    assert (tbl.claim.str.len() <= 70).all() and (tbl.note.str.len() <= 200).all()
    assert tbl.value.notna().all()                                      # every check measures something


def test_holds_is_a_bool(tbl):
    assert all(type(h) is bool for h in tbl.holds.tolist())
    assert all(type(check()['holds']) is bool for check in CHECKS[:3])


def test_deterministic(tbl):
    pd.testing.assert_frame_equal(theorem_checks(), tbl)               # NaN == NaN here


def test_every_paper_has_a_row(tbl):
    assert list(dict.fromkeys(tbl.paper)) == list(PAPERS)              # every paper, in the ledger's order
    assert tbl.paper.value_counts().min() >= 1


def test_contradictions(tbl):
    "The rows where a theory page shows a counterexample to the paper's statement, and only those."
    failed = tbl.loc[~tbl.holds, 'claim'].str.split(':').str[0].tolist()
    assert failed == ['Corollary 1 as used', 'Theorem 1', '§3.4', 'Theorem 2', '§3.5']
    lower = tbl[tbl.claim.str.contains('at least 0.25')].iloc[0]
    assert lower.value < 0.25 == lower.claimed


def test_sections_are_headings(tbl):
    "Every `section` anchor is a heading of its notebook, as Quarto names it."
    for s in tbl.section:
        nb, anchor = s.split('#')
        assert (ROOT/'nbs'/nb).is_file(), s
        assert anchor in notebook_anchors(ROOT/'nbs'/nb), f'{s}: no heading of {nb} has this anchor'


def test_quarto_id():
    assert quarto_id("Maître d'hôtel") == 'maître-dhôtel' and quarto_id('*Dogs*?--in *my* house?') == 'dogs--in-my-house'
    assert quarto_id('3. Applications') == 'applications' and quarto_id('[HTML], [S5], or [RTF]?') == 'html-s5-or-rtf'
    assert quarto_id('the ∞-norm, not [the 2-norm](x.ipynb)') == 'the--norm-not-the-2-norm'


def test_notebook_anchors(tmp_path):
    md = lambda s: {'cell_type': 'markdown', 'metadata': {}, 'source': s}
    nb = {'cells': [md('# Title\n\n## A section\n\n```python\n# not a heading\n```'),
                    md('::: {.callout-note}\n## Theorem (in a callout)\n:::\n\n## A section'),
                    {'cell_type': 'code', 'metadata': {}, 'source': '## code', 'outputs': [], 'execution_count': None}]}
    p = tmp_path/'x.ipynb'; p.write_text(json.dumps(nb))
    assert notebook_anchors(p) == {'title', 'a-section', 'a-section-1'}


def test_claim_row_refuses_bad_rows():
    ok = dict(paper='NeuTRENO', claim='c', test='t', value=1, claimed=float('nan'), unit='u', holds=1,
              section='03_gradflow.ipynb#a', note='n')
    r = check_row(**ok)
    assert list(r) == list(COLUMNS) and r['holds'] is True and r['value'] == 1.0
    for bad in (dict(paper='BERT'), dict(claim='x' * 71), dict(note='x' * 201), dict(section='03_gradflow#a')):
        with pytest.raises(ValueError): check_row(**(ok | bad))


def test_lessons_do_not_import_the_lab():
    for mod in ('bounds', 'transject', 'gradflow', 'similarity', 'baselines', 'core', 'cpu'):
        src = (ROOT/'transject_nb'/f'{mod}.py').read_text()
        assert not re.search(r'^\s*(from|import)\s+(transject_nb)?\.?theorems\b', src, re.M), mod
