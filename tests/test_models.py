"""The contract every registered variant keeps, through the public door `create_model`."""
import pytest, torch
from hypothesis import given, settings, strategies as st
from transject_nb.models import VARIANTS, create_model, check_contract, preset_config, variants_table
from transject_nb.presets import TASKS


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


# Logits of seeded models, recorded (12 significant digits) at main 1528971, before issue 59 moved `SoftmaxBlock`'s
# hooks and `TransJectLayer`'s `expert_weights`, `weights` and `uses_fused` from `@patch` cells into their class
# bodies: moving code changes no number. In float64, so another CPU's BLAS moves them by ~1e-15, far below `atol`.
# Each case: the variant, config fields, training mode (dropout and the entropic cases drawn after `manual_seed(1)`).
SEEDED_LOGITS = {
    ('transject', (), False): [-0.267271368259, -0.341909566936, 0.0916596061612, -0.730978338262, -0.461658288147, -0.44636512704, -0.923109275439, -0.569213306723, -0.805583595702],
    ('entropic-transject', (), False): [-0.267271368259, -0.341909566936, 0.0916596061612, -0.730978338262, -0.461658288147, -0.44636512704, -0.923109275439, -0.569213306723, -0.805583595702],
    ('random-transject', (), False): [-0.383217265434, -0.693679699314, -0.72835325063, -0.145744963243, -0.833504657277, -0.589405261867, -0.241964382384, -0.860289793149, -0.338471826668],
    ('random-entropic-transject', (), False): [-0.383217265434, -0.693679699314, -0.72835325063, -0.145744963243, -0.833504657277, -0.589405261867, -0.241964382384, -0.860289793149, -0.338471826668],
    ('transformer', (), False): [0.508161636899, -1.72227868388, -0.844816855566, 0.701337864911, -2.0502327446, -0.528210422692, 0.423696355016, -2.14733422415, -1.0621488845],
    ('transformer-prenorm', (), False): [5.97742155126, 0.325546149559, 0.819603626735, 1.44503789613, -1.8792344853, 1.3876733137, 3.59675230086, -1.473494223, -3.39907866245],
    ('transformer-rezero', (), False): [-4.7684039965, -8.94788988217, -6.96465739253, -1.06140711552, 3.14662439502, -11.0586339626, 3.31492785595, 0.403586273703, -0.992449494749],
    ('neutreno', (), False): [0.304011294971, -1.76110517797, -1.56239386591, 0.330397046648, -1.50032421463, -1.39746825332, 0.365188811107, -1.67171563709, -1.43518436075],
    ('similarity-removal', (), False): [0.154670282275, -1.67334080621, 0.162405938819, 0.26045117189, -1.82935802202, -0.48949018725, -0.0267687956386, -1.84762919508, -0.567458621254],
    ('transject', (('kernel', 'readable'),), False): [-0.267271368259, -0.341909566936, 0.0916596061612, -0.730978338262, -0.461658288147, -0.44636512704, -0.923109275439, -0.569213306723, -0.805583595702],
    ('transject', (('gate', 'input'),), False): [-0.606743894805, -0.0252434558442, -0.45318228789, -0.275112292153, -0.691051196237, -0.345191964728, -0.544600685966, -0.753001738601, -0.638034351376],
    ('entropic-transject', (('kernel', 'readable'),), True): [-0.470390373477, -1.58549430055, 0.185580232222, -0.803601051248, -1.01019948328, -0.391224315613, -0.897249338108, -0.871847855816, -0.771712093182],
    ('entropic-transject', (), True): [-0.470390373477, -1.58549430055, 0.185580232222, -0.803601051248, -1.01019948328, -0.391224315613, -0.897249338108, -0.871847855816, -0.771712093182],
    ('transformer', (('sym', True),), False): [-0.376494911108, -0.140527816302, 0.263841729169, 0.172024731423, -0.857787286446, -1.00203817646, 0.493832003837, -0.503496196849, -1.33698332471],
    ('similarity-removal', (('causal', True),), False): [0.245755809, -1.78949338801, 0.157747704018, 0.177218279903, -2.16041169906, -0.17246769316, 0.231371577227, -1.82036093978, -0.0299121039508],
    ('neutreno', (('causal', True), ('dropout', 0.1)), True): [0.28111364497, -1.68132370341, -1.01649412142, 0.524689090378, -1.61938970089, -1.09775896687, 0.503186351964, -1.64844427887, -1.13569347116],
    ('transformer-rezero', (('dropout', 0.1),), True): [-2.98987956657, -11.8715957482, -10.9628189742, -1.86382943228, 4.28334094209, -13.2970331364, 3.56095114478, 4.96668112956, 1.99034830194],
}


@pytest.mark.parametrize('case', list(SEEDED_LOGITS), ids=lambda c: f"{c[0]}-{'-'.join(str(v) for _, v in c[1])}-{'train' if c[2] else 'eval'}")
def test_seeded_logits_are_unchanged(case):
    "Seeded models, their weights moved off the zero init (α, gates, biases), give the logits recorded above."
    variant, kw, train = case[0], dict(case[1]), case[2]
    torch.manual_seed(0)
    m = create_model(variant, 50, 3, d_model=16, n_layers=2, max_len=12, **kw)
    with torch.no_grad():
        for p in m.parameters(): p.add_(0.3 * torch.randn_like(p))
    m = m.double().train(train)
    x = torch.randint(1, 50, (3, 10)); x[0, 6:] = 0                                       # row 0 padded
    torch.manual_seed(1)
    with torch.no_grad(): out = m(x)
    want = torch.tensor(SEEDED_LOGITS[case], dtype=torch.float64).view(3, 3)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-9)
