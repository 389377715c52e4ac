"""Importing the package prints nothing. fastai's import calls `torch.jit.script`, whose FutureWarning each module
that imports fastai hides where it imports it (`utils.fastai_quietly`), and only there: the user's filters stay theirs."""
import re, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
IMPORTS_FASTAI = re.compile(r'^\s*(import fastai|from fastai|from optuna_integration)', re.M)

def fastai_modules()->list:
    "The library's modules that import fastai themselves, as dotted names."
    pkg = ROOT/'transject_nb'
    return sorted('.'.join(('transject_nb',) + p.relative_to(pkg).with_suffix('').parts)
                  for p in pkg.rglob('*.py') if IMPORTS_FASTAI.search(p.read_text(encoding='utf-8')))

def python(code:str, *flags)->subprocess.CompletedProcess:
    "Run `code` in a fresh interpreter, from the repository's root, as a user would."
    return subprocess.run([sys.executable, *flags, '-c', code], cwd=ROOT, capture_output=True, text=True)


def test_the_modules_that_import_fastai_are_found():
    assert {'transject_nb.training.learner', 'transject_nb.training.items', 'transject_nb.training.cli', 'transject_nb.training.lm'} <= set(fastai_modules())


@pytest.mark.parametrize('mod', fastai_modules())
def test_import_prints_nothing(mod):
    r = python(f'import {mod}')
    assert (r.returncode, r.stderr, r.stdout) == (0, '', '')


def test_import_passes_with_future_warnings_as_errors_and_leaves_the_filters_alone():
    probe = ("import re, warnings\nimport transject_nb.training.learner\n"
             "assert not [f for f in warnings.filters if isinstance(f[1], re.Pattern) and 'jit' in f[1].pattern"
             " and f[2] is FutureWarning], 'a filter of ours is left'\n"
             "try: warnings.warn('mine', FutureWarning)\nexcept FutureWarning as e: print('still an error:', e)")
    r = python(probe, '-W', 'error::FutureWarning')
    assert (r.returncode, r.stderr, r.stdout) == (0, '', 'still an error: mine\n')
