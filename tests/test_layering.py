"""The three parts: the lesson (`transject_nb`), training (`transject_nb.training`) and the lab (`transject_nb.lab`).
The lesson imports neither of the others and stays light (no fastai, Optuna, pandas or matplotlib); the lab uses the
lesson through its public names; `core` is the encoder contract alone; every old path names its new home."""
import ast, importlib, json, re, statistics, subprocess, sys
from pathlib import Path
import pytest
import transject_nb

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT/'transject_nb'
HEAVY = ('fastai', 'optuna', 'pandas', 'matplotlib')
LESSON = sorted(p.stem for p in PKG.glob('*.py') if not p.stem.startswith('_'))
TRAINING = sorted(p.stem for p in (PKG/'training').glob('*.py') if p.stem != '__init__')
LAB = sorted(p.stem for p in (PKG/'lab').glob('*.py') if p.stem != '__init__')
CONTRACT = {'PAD_ID', 'POOLINGS', 'EncoderClassifier', 'BatchContext', 'Trace', 'check_tokens', 'sinusoidal_pe',
            'masked_pool', 'check_choice', 'check_fields', 'EncoderConfig', 'unwrap', 'VariantSpec', 'register_variant',
            'registered_variants', 'variant_spec', 'config_fields', 'build_config'}


def _imports(path:Path)->list:
    "`(module, names)` of every import in `path`, module absolute ('transject_nb.x.y')."
    pkg = path.relative_to(ROOT).with_suffix('').parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else ()
            mod = '.'.join([*base, *([node.module] if node.module else [])])
            out.append((mod, [a.name for a in node.names]))
        elif isinstance(node, ast.Import): out += [(a.name, []) for a in node.names]
    return out


def test_the_three_parts_are_there():
    assert {'core', 'presets', 'models', 'transject', 'baselines'} <= set(LESSON)
    assert {'learner', 'data', 'cli', 'config'} <= set(TRAINING)
    assert {'protocol', 'stats', 'ledger', 'claims'} <= set(LAB)


@pytest.mark.parametrize('mod', LESSON)
def test_the_lesson_imports_neither_training_nor_the_lab(mod):
    bad = [m for m, _ in _imports(PKG/f'{mod}.py') if m.startswith(('transject_nb.training', 'transject_nb.lab'))]
    assert bad == [], f"transject_nb.{mod} imports {bad}"


@pytest.mark.parametrize('mod', [m for m in TRAINING if m != 'cli'])
def test_training_imports_the_lab_only_in_the_cli(mod):
    bad = [m for m, _ in _imports(PKG/'training'/f'{mod}.py') if m.startswith('transject_nb.lab')]
    assert bad == [], f"transject_nb.training.{mod} imports {bad}"


@pytest.mark.parametrize('mod', [f'lab/{m}' for m in LAB] + [f'training/{m}' for m in TRAINING])
def test_the_lesson_is_used_through_its_public_names(mod):
    lesson = {f'transject_nb.{m}' for m in LESSON}
    private = [(m, n) for m, names in _imports(PKG/f'{mod}.py') if m in lesson for n in names if n.startswith('_')]
    assert private == [], f"{mod} imports private names of the lesson: {private}"


@pytest.mark.parametrize('mod', LESSON + ['training.utils'])
def test_the_lesson_imports_nothing_heavy(mod):
    probe = f"import sys, transject_nb.{mod}\nprint([m for m in {HEAVY!r} if m in sys.modules])"
    r = subprocess.run([sys.executable, '-c', probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == '[]', f"importing transject_nb.{mod} loads {r.stdout.strip()}"


def test_core_is_the_contract_alone():
    import transject_nb.core as core, transject_nb.training.utils as utils, transject_nb.presets as presets
    assert set(core.__all__) == CONTRACT
    assert [n for n in utils.__all__ + presets.__all__ if hasattr(core, n)] == []   # no file, preset or progress helper
    assert not {'configparser', 'shutil', 'tempfile', 'os', 'signal', 'errno'} & set(vars(core))   # nor their tools


@pytest.mark.parametrize('name,home', [('atomic_write', 'training.utils'), ('copy_new', 'training.utils'),
                                       ('load_preset', 'presets'), ('TASKS', 'presets'),
                                       ('progress_iter', 'training.utils'), ('error_line', 'training.utils'),
                                       ('Stopped', 'training.utils')])
def test_an_old_name_names_the_new_home(name, home):
    import transject_nb.core as core
    moved = f"transject_nb.core.{name} moved to transject_nb.{home}.{name}"
    with pytest.raises(AttributeError, match=moved): getattr(core, name)
    with pytest.raises(ImportError, match=moved): exec(f"from transject_nb.core import {name}", {})
    assert hasattr(importlib.import_module(f'transject_nb.{home}'), name)


def test_an_unknown_name_is_the_usual_error():
    import transject_nb.core as core
    with pytest.raises(AttributeError, match="module 'transject_nb.core' has no attribute 'nothing'"): core.nothing
    with pytest.raises(ImportError, match="cannot import name 'nothing'"): exec("from transject_nb.core import nothing", {})


@pytest.mark.parametrize('old', sorted(transject_nb.MOVED))
def test_an_old_module_path_names_the_new_home(old):
    new = transject_nb.MOVED[old]
    assert importlib.import_module(new).__name__ == new
    probe = f"import {old}"
    r = subprocess.run([sys.executable, '-c', probe], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and f"ModuleNotFoundError: {old} moved to {new}; import it from there" in r.stderr
    assert not (PKG/f"{old.split('.')[-1]}.py").exists()


def test_an_unknown_module_is_the_usual_error():
    with pytest.raises(ModuleNotFoundError, match="No module named 'transject_nb.nothing'"):
        importlib.import_module('transject_nb.nothing')


# --- sizes at the anchors' (issue 59): miniai, nbdev's own notebooks, nanoGPT ------------------------------------

def _export_cells()->list:
    "`(notebook, first line, non-blank lines without `#|` directives)` of every export cell."
    out = []
    for nb in sorted((ROOT/'nbs').glob('*.ipynb')):
        for c in json.loads(nb.read_text())['cells']:
            src = ''.join(c['source'])
            if c['cell_type'] != 'code' or not re.search(r'^#\|\s*export', src, re.M): continue
            lines = [l for l in src.splitlines() if l.strip() and not l.startswith('#|')]
            out.append((nb.name, lines[0][:60] if lines else '', len(lines)))
    return out


def _modules()->list: return [p for p in PKG.rglob('*.py') if p.name != '_modidx.py']


def test_no_module_over_600_lines():
    big = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > 600}
    assert big == {}


def test_export_cells_are_small():
    cells = _export_cells()
    assert [c for c in cells if c[2] > 40] == []
    assert statistics.median(c[2] for c in cells) <= 12


def test_few_code_lines_over_100_characters():
    code = [l for p in _modules() for l in p.read_text().splitlines() if l.strip()]
    long = sum(len(l) > 100 for l in code)
    assert long <= 0.05*len(code), f"{long} of {len(code)} lines ({long/len(code):.1%}) are over 100 characters"
