"""The contract every registered variant keeps, through the public door `create_model`."""
import pytest, torch
from hypothesis import given, settings, strategies as st
from transject_nb.models import VARIANTS, create_model, check_contract, preset_config, variants_table
from transject_nb.utils import TASKS


def test_variants_come_from_one_table():
    "VARIANTS, BASELINES and the variants table are read from the entries `models` registers, in its table's order."
    from transject_nb.core import registered_variants, variant_spec
    from transject_nb.models import BASELINES
    assert registered_variants()[:len(VARIANTS)] == VARIANTS
    assert BASELINES == tuple(v for v in VARIANTS if variant_spec(v).family == 'softmax') == registered_variants('softmax')
    assert VARIANTS == registered_variants('transject') + BASELINES                       # TransJect's first
    assert 'transformer-prenorm' in BASELINES and variant_spec('transformer-prenorm').fixed['norm'] == 'pre'
    t = variants_table()
    assert list(t.index[:len(VARIANTS)]) == list(VARIANTS) and list(t.knob[:len(VARIANTS)]) == [variant_spec(v).knob or '' for v in VARIANTS]


def test_registration_is_explicit():
    "Importing the model modules registers nothing; `import transject_nb.models` registers the table, whatever was imported before."
    import subprocess, sys
    probe = ("import transject_nb.baselines, transject_nb.transject, transject_nb.core as c\n"
             "try: c.variant_spec('transject')\nexcept ValueError as e: print(e)\n"
             "print(c.registered_variants())\n"
             "import transject_nb.models as m\nprint(c.registered_variants() == m.VARIANTS)")
    out = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith("unknown variant 'transject'; valid variants are: ") and 'import transject_nb.models' in out[0]
    assert out[1:] == ['()', 'True']


@pytest.mark.parametrize('variant', VARIANTS)
def test_contract(variant):
    r = check_contract(variant)
    assert r['padding_dev'] < 1e-5 and r['eval_dev'] == 0


@pytest.mark.parametrize('variant', VARIANTS)
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), pad=st.integers(1, 6), pooling=st.sampled_from(['mean', 'max']))
def test_padding_never_changes_logits(variant, seed, pad, pooling):
    torch.manual_seed(seed)
    m = create_model(variant, 30, 2, d_model=16, n_layers=2, max_len=20, pooling=pooling).eval()
    x = torch.randint(1, 30, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(m(x), m(torch.cat([x, x.new_zeros(2, pad)], 1)), atol=1e-5, rtol=1e-5)


def test_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match='valid variants are: .*transject'): create_model('bert', 10, 2)
    with pytest.raises(TypeError, match='valid fields are: .*d_model'): create_model('transformer', 10, 2, dmodel=8)
    with pytest.raises(ValueError, match='fixes'): create_model('neutreno', 10, 2, norm='pre')


@pytest.mark.parametrize('task', TASKS)
def test_presets_build_every_variant_config(task):
    for v in VARIANTS:
        cfg = preset_config(v, task)
        assert cfg['d_model'] == 512 and cfg['n_layers'] == 6
        small = preset_config(v, task, "cpu")
        create_model(v, 100, 4, **small)   # the CPU presets build quickly


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('variant', VARIANTS)
def test_contract_cuda(variant):
    check_contract(variant, device='cuda')


def test_building_a_model_imports_nothing_heavy():
    "`import transject_nb.models` and `create_model` load neither matplotlib, pandas, fastai nor fastprogress."
    import subprocess, sys
    probe = ("import sys, transject_nb.models as m; [m.create_model(v, 10, 2) for v in m.VARIANTS]; "
             "print(sorted({k.split('.')[0] for k in sys.modules} & {'matplotlib', 'pandas', 'fastai', 'fastprogress', 'sklearn'}))")
    out = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == '[]', f"building models imported {out}"
