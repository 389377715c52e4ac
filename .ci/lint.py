"""`make lint`: ruff on the library with the rules of pyproject.toml's [tool.ruff], and its line length on every line
that a notebook can change.

nbdev writes two lines of every module that no notebook edit can wrap: the module's docstring, whose first line is
the page's `> description` (the site's subtitle, which nbdev reads from that one line), and the first line of
`__all__` (nbdev wraps the list of names at 120 columns, then puts `__all__ = ` in front of it); it also writes `_modidx.py` whole. ruff cannot exempt
single lines of a file, so pyproject.toml leaves E501 out of ruff and this script checks `line-length` itself on
every other line. Plain `ruff check` then passes too.

Usage: python .ci/lint.py [RUFF [PATH ...]]   (default: the `ruff` beside this Python, on transject_nb)
"""
import os, subprocess, sys, tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def generated(lines:list)->set:
    "The numbers of the lines nbdev writes itself: the module docstring's first line, and `__all__`'s first."
    first = {1} if lines and lines[0].startswith(('"""', 'r"""')) else set()
    return first | {i for i, line in enumerate(lines, 1) if line.startswith('__all__ = ')}

def long_lines(ruff:str, paths:list, limit:int)->list:
    "`path:row:col: E501 ...` for every line over `limit` characters that nbdev does not write itself."
    shown = subprocess.run([ruff, 'check', '--show-files', *paths], capture_output=True, text=True, check=True)
    files = [Path(l.strip()) for l in shown.stdout.splitlines()             # ruff's own choice of files, but the index
             if l.strip().endswith('.py') and Path(l.strip()).name != '_modidx.py']   # that nbdev writes whole
    out = []
    for f in files:
        lines = f.read_text(encoding='utf-8').splitlines()
        skip = generated(lines)
        out += [f"{os.path.relpath(f)}:{i}:{limit + 1}: E501 Line too long ({len(l)} > {limit})"
                for i, l in enumerate(lines, 1) if len(l) > limit and i not in skip]
    return out

def main(ruff:str, paths:list)->int:
    "Run ruff on `paths`, then the line length; print the findings; 1 if there are any, else 0."
    limit = tomllib.loads((ROOT/'pyproject.toml').read_text())['tool']['ruff']['line-length']
    r = subprocess.run([ruff, 'check', '--quiet', *paths], capture_output=True, text=True)
    if r.stdout.strip(): print(r.stdout.rstrip())
    if r.stderr.strip(): sys.stderr.write(r.stderr)
    long = long_lines(ruff, paths, limit)
    for x in long: print(x)
    print(f"ruff: {'clean' if r.returncode == 0 else 'findings above'}; line length {limit}: {len(long)} line(s) over "
          "(nbdev's generated docstring and __all__ lines left out)")
    return 1 if r.returncode or long else 0

if __name__ == '__main__':
    ruff = sys.argv[1] if len(sys.argv) > 1 else str(Path(sys.executable).parent/'ruff')
    sys.exit(main(ruff, sys.argv[2:] or ['transject_nb']))
