"""`transject_nb.lab.stats`: Welch's t-test and its verdicts against scipy, the zero-spread and one-seed cases, the 2-SE rule it replaces, and bad input."""
import math

import numpy as np
import pytest
from scipy import stats as st

from transject_nb.lab.stats import ALPHA, VERDICTS, spread_test, verdict_of, welch, welch_from_stats, welch_from_var


def test_constants():
    assert ALPHA == 0.05 and VERDICTS == ('reproduced', 'contradicted', 'not shown', 'not tested')


def test_verdicts():
    assert [verdict_of(0.01, 0.02, 3, 3), verdict_of(0.01, -0.02, 3, 3), verdict_of(0.3, 0.02, 3, 3), verdict_of(0.01, 0.02, 3, 1)] == list(VERDICTS)
    assert welch([0.80, 0.81, 0.82], [0.70, 0.71, 0.72])['verdict'] == 'reproduced'
    assert welch([0.70, 0.71, 0.72], [0.80, 0.81, 0.82])['verdict'] == 'contradicted'
    assert welch([0.80, 0.70, 0.75], [0.76, 0.71, 0.74])['verdict'] == 'not shown'
    assert welch([0.9], [0.70, 0.71])['verdict'] == 'not tested' and math.isnan(welch([0.9], [0.70, 0.71])['p'])


def test_welch_matches_scipy():
    rng = np.random.default_rng(0)
    for na, nb in ((2, 2), (3, 3), (3, 5), (10, 4)):
        a, b = rng.normal(0.8, 0.02, na), rng.normal(0.78, 0.05, nb)
        r, ref = welch(a, b), st.ttest_ind(a, b, equal_var=False)
        assert r['t'] == pytest.approx(ref.statistic) and r['p'] == pytest.approx(ref.pvalue) and r['df'] == pytest.approx(ref.df)
        assert (r['lo'], r['hi']) == pytest.approx(tuple(ref.confidence_interval(1 - ALPHA)))
        s = welch_from_stats(a.mean(), a.std(ddof=1), na, b.mean(), b.std(ddof=1), nb)
        v = welch_from_var(a.mean() - b.mean(), a.var(ddof=1), na, b.var(ddof=1), nb)
        assert s['p'] == pytest.approx(r['p']) and v['p'] == pytest.approx(r['p']) and v['df'] == pytest.approx(r['df'])


def test_pooled_degrees_of_freedom():
    r, pooled = welch_from_var(0.03, 1e-4, 2, 1e-4, 2), welch_from_var(0.03, 1e-4, 2, 1e-4, 2, df_a=10, df_b=10)
    assert r['df'] == pytest.approx(2.0) and pooled['df'] == pytest.approx(20.0) and pooled['se'] == pytest.approx(r['se'])
    assert pooled['p'] < ALPHA < r['p']
    assert welch_from_var(0.03, float('nan'), 2, 1e-4, 2, df_a=0)['verdict'] == 'not tested'
    assert welch_from_var(0.06, 1e-4, 1, 1e-4, 2, df_a=4)['verdict'] == 'reproduced'     # one value behind the mean, a spread pooled from elsewhere


def test_zero_spread_on_both_sides():
    assert welch([0.8, 0.8, 0.8], [0.8, 0.8])['verdict'] == 'not shown' and welch([0.8, 0.8, 0.8], [0.8, 0.8])['p'] == 1.0
    r = welch([0.8, 0.8, 0.8], [0.7, 0.7, 0.7])
    assert (r['verdict'], r['p'], r['t'], r['lo'], r['hi']) == ('reproduced', 0.0, math.inf, pytest.approx(0.1), pytest.approx(0.1)) and math.isnan(r['df'])
    assert welch([0.7, 0.7], [0.8, 0.8])['verdict'] == 'contradicted'
    assert welch_from_stats(0.8, 0.0, 3, 0.7, 0.01, 3)['df'] == pytest.approx(2.0)   # one side without spread: the other's df


def test_two_standard_errors_holds_where_welch_is_within_noise():
    a, b = [0.80, 0.82, 0.84], [0.76, 0.78, 0.80]
    r = welch(a, b)
    assert r['diff'] > 2 * r['se'] and r['verdict'] == 'not shown' and r['p'] == pytest.approx(0.0705, abs=1e-4)


def test_two_standard_errors_is_anti_conservative_at_three_seeds():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(20_000, 3)), rng.normal(size=(20_000, 3))
    r = welch_from_stats(x.mean(1), x.std(1, ddof=1), 3, y.mean(1), y.std(1, ddof=1), 3)
    assert (np.abs(r['diff']) > 2 * r['se']).mean() > 0.1 and (r['p'] < ALPHA).mean() < ALPHA + 0.005
    assert st.t.ppf(0.975, 2) == pytest.approx(4.303, abs=1e-3)


def test_large_samples_agree():
    rng = np.random.default_rng(1)
    rs = [welch(rng.normal(d, 1, 300), rng.normal(0, 1, 300)) for d in rng.uniform(-0.4, 0.4, 200)]
    two_se = ['not shown' if abs(r['diff']) <= 2 * r['se'] else 'reproduced' if r['diff'] > 0 else 'contradicted' for r in rs]
    assert np.mean([a == r['verdict'] for a, r in zip(two_se, rs)]) > 0.97


def test_vectorised_from_stats():
    r = welch_from_stats([0.80, 0.80, 0.80], [0.01, 0.05, np.nan], [3, 3, 1], 0.77, 0.01, 3)
    assert r['verdict'].tolist() == ['reproduced', 'not shown', 'not tested'] and r['n_a'].tolist() == [3, 3, 1]


def test_spread_test():
    assert spread_test(0.002, 4, 0.02, 4)['verdict'] == 'reproduced'
    assert spread_test(0.02, 4, 0.002, 4)['verdict'] == 'contradicted'
    assert spread_test(0.01, 4, 0.02, 4)['verdict'] == 'not shown'
    assert spread_test(0.0, 4, 0.0, 4)['verdict'] == 'not shown' and spread_test(0.01, 0, 0.02, 4)['verdict'] == 'not tested'
    assert spread_test(0.01, 4, 0.02, 4)['p'] == pytest.approx(2 * st.f.cdf(0.25, 4, 4))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match='a is empty'): welch([], [0.7, 0.8])
    with pytest.raises(ValueError, match=r'b holds NaN or inf at positions \[1\]'): welch([0.7, 0.8], [0.7, float('nan')])
    with pytest.raises(ValueError, match='1-D array of per-seed values'): welch([[0.7, 0.8]], [0.7, 0.8])
    with pytest.raises(ValueError, match='mismatched lengths: mean_a has 2, std_a has 3'): welch_from_stats([0.8, 0.7], [0.01] * 3, 3, 0.7, 0.01, 3)
    with pytest.raises(ValueError, match='mismatched lengths'): welch_from_var([0.1, 0.2], 1e-4, [3, 3, 3], 1e-4, 3)
    with pytest.raises(ValueError, match='mean_b holds NaN'): welch_from_stats(0.8, 0.01, 3, float('nan'), 0.01, 3)
    with pytest.raises(ValueError, match='std_a holds NaN or inf at positions \\[0\\] where its side has a spread'): welch_from_stats(0.8, float('nan'), 3, 0.7, 0.01, 3)
    with pytest.raises(ValueError, match='n_b must hold whole numbers'): welch_from_stats(0.8, 0.01, 3, 0.7, 0.01, 0)
    with pytest.raises(ValueError, match='diff is empty'): welch_from_var([], 1e-4, 3, 1e-4, 3)
    with pytest.raises(ValueError, match='alpha must be a level'): welch([0.7, 0.8], [0.7, 0.8], alpha=1.5)
    with pytest.raises(ValueError, match='NaN: with zero spread on both sides'): verdict_of(float('nan'), 0.1, 3, 3)
    with pytest.raises(ValueError, match='n_a must be a whole number'): verdict_of(0.01, 0.1, 0, 3)
    with pytest.raises(ValueError, match='std_b must be a finite standard deviation'): spread_test(0.01, 4, -0.01, 4)
