"""The layers: `core` is the encoder contract alone, and the lesson stays light. Importing `transject_nb.core`,
`transject_nb.utils` or `transject_nb.models` loads none of fastai, Optuna, pandas or matplotlib; the files, presets,
progress and error helpers live in `utils`, and asking `core` for one names its new home."""
import subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ('fastai', 'optuna', 'pandas', 'matplotlib')
CONTRACT = {'PAD_ID', 'POOLINGS', 'EncoderClassifier', 'BatchContext', 'Trace', 'check_tokens', 'sinusoidal_pe',
            'masked_pool', 'check_choice', 'check_fields', 'EncoderConfig', 'unwrap', 'VariantSpec', 'register_variant',
            'registered_variants', 'variant_spec', 'config_fields', 'build_config'}


@pytest.mark.parametrize('mod', ['core', 'utils', 'models'])
def test_the_lesson_imports_nothing_heavy(mod):
    probe = f"import sys, transject_nb.{mod}\nprint([m for m in {HEAVY!r} if m in sys.modules])"
    r = subprocess.run([sys.executable, '-c', probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == '[]', f"importing transject_nb.{mod} loads {r.stdout.strip()}"


def test_core_is_the_contract_alone():
    import transject_nb.core as core, transject_nb.utils as utils
    assert set(core.__all__) == CONTRACT
    assert [n for n in utils.__all__ if hasattr(core, n)] == []            # no file, preset, progress or error helper
    assert not {'configparser', 'shutil', 'tempfile', 'os', 'signal', 'errno'} & set(vars(core))   # nor their tools


@pytest.mark.parametrize('name', ['atomic_write', 'copy_new', 'load_preset', 'TASKS', 'progress_iter', 'error_line',
                                  'Stopped'])
def test_an_old_path_names_the_new_home(name):
    import transject_nb.core as core, transject_nb.utils as utils
    moved = f"transject_nb.core.{name} moved to transject_nb.utils.{name}"
    with pytest.raises(AttributeError, match=moved): getattr(core, name)
    with pytest.raises(ImportError, match=moved): exec(f"from transject_nb.core import {name}", {})
    assert hasattr(utils, name)


def test_an_unknown_name_is_the_usual_error():
    import transject_nb.core as core
    with pytest.raises(AttributeError, match="module 'transject_nb.core' has no attribute 'nothing'"): core.nothing
    with pytest.raises(ImportError, match="cannot import name 'nothing'"): exec("from transject_nb.core import nothing", {})
