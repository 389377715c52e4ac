"The claims ledger (issue 57): its verdicts from made-up results, the committed claims.csv rebuilt, its links."
import io
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from transject_nb.lab.claims import FAMILIES, build_claims, load_claims
from transject_nb.lab.ledger import claim_row, diff_effect, ledger, untested
from transject_nb.lab.stats import VERDICTS
from transject_nb.lab.theorems import notebook_anchors

NBS = Path(__file__).resolve().parent.parent/'nbs'
S = 'made.ipynb#up'

def _row(claim, family, a, b, paper_effect=np.nan):
    return claim_row('P', claim, family, 'made-up', diff_effect(a, b), S, paper_effect=paper_effect)

def made_up():
    "A ledger from tiny made-up accuracies that reaches every verdict."
    hi, lo = [0.80, 0.81, 0.82], [0.70, 0.71, 0.72]
    return ledger([
        _row('clear win', 'one', hi, lo, paper_effect=10),
        _row('clear loss', 'one', lo, hi, paper_effect=10),
        _row('paper far off', 'one', [0.801, 0.802, 0.803], [0.800, 0.801, 0.802], paper_effect=20),
        _row('noise', 'one', [0.70, 0.75, 0.72], [0.71, 0.73, 0.72], paper_effect=1),
        # a family of four: one p just below 5% alone, far above it after Holm
        _row('marginal', 'four', [0.7225, 0.7300, 0.7375], [0.7025, 0.7100, 0.7175]),
        *(_row(f'nothing {i}', 'four', [0.7, 0.71, 0.72], [0.7, 0.71, 0.72 - 0.001 * i]) for i in range(3)),
        claim_row('P', 'beyond', 'one', 'not run', untested('needs ImageNet'), S),
    ]).set_index('claim')

def test_made_up_ledger_reaches_every_verdict():
    d = made_up()
    assert set(d.verdict) == set(VERDICTS)
    assert d.verdict['clear win'] == 'reproduced' and d.ci_low['clear win'] > 0
    assert d.verdict['clear loss'] == 'contradicted' and d.ci_high['clear loss'] < 0
    # contradicted though the interval holds 0: it excludes the paper's own 20 points
    r = d.loc['paper far off']
    assert r.verdict == 'contradicted' and r.ci_low < 0 < r.ci_high < 20
    assert d.verdict['noise'] == 'not shown' and d.ci_low['noise'] < 0 < d.ci_high['noise']
    assert d.detectable['noise'] > 0
    assert d.verdict['beyond'] == 'not tested' and 'ImageNet' in d.note['beyond']

def test_holm_turns_a_raw_rejection_into_not_shown():
    r = made_up().loc['marginal']
    assert r.p < 0.05 <= r.p_adj, (r.p, r.p_adj)
    assert r.ci_low > 0                       # the unadjusted interval excludes 0 ...
    assert r.verdict == 'not shown'           # ... but the family's adjusted test does not

@pytest.fixture(scope='module')
def committed(): return load_claims(NBS/'results'/'claims.csv')

def test_build_claims_equals_the_committed_ledger(committed):
    built = build_claims(NBS/'results').to_csv(index=False, float_format='%.6g')
    built = pd.read_csv(io.StringIO(built), keep_default_na=False, na_values=[''])
    pd.testing.assert_frame_equal(built, committed, check_exact=False, rtol=1e-5)

def test_ledger_covers_three_papers_and_its_links_exist(committed):
    assert len(committed) >= 30
    assert {'TransJect', 'NeuTRENO', 'Yu & Zhang'} <= set(committed.paper)
    assert set(committed.verdict) <= set(VERDICTS) and set(committed.family) <= set(FAMILIES)
    assert (committed.note[committed.verdict == 'not tested'].str.len() > 0).all()
    anchors = {}
    for s in committed.section.unique():
        page, anchor = s.split('#')
        if page not in anchors: anchors[page] = notebook_anchors(NBS/page)
        assert anchor in anchors[page], f"{s}: no such heading on {page}"
