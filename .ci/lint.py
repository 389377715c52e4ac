"""`make lint`: ruff on the library, with the rules and the line length of pyproject.toml's [tool.ruff].

nbdev writes two lines of every module that no notebook edit can wrap: the module's docstring, whose first line is
the page's `> description` (nbdev joins it on one line), and the first line of `__all__` (nbdev wraps the list of
names at 120 columns, then puts `__all__ = ` in front of it). Line length (E501) is checked on every other line,
and every other rule on every line.

Usage: python .ci/lint.py [RUFF [PATH ...]]   (default: the `ruff` beside this Python, on transject_nb)
"""
import json, os, subprocess, sys
from pathlib import Path

def generated(path:Path)->set:
    "The numbers of the lines nbdev writes itself: the module docstring's first line, and `__all__`'s first."
    lines = path.read_text(encoding='utf-8').splitlines()
    first = {1} if lines and lines[0].startswith(('"""', 'r"""')) else set()
    return first | {i for i, line in enumerate(lines, 1) if line.startswith('__all__ = ')}

def main(ruff:str, paths:list)->int:
    "Run ruff on `paths`; print its findings but E501 on nbdev's own lines; 1 if any is left, else 0."
    r = subprocess.run([ruff, 'check', '--output-format', 'json', '--exit-zero', *paths], capture_output=True, text=True)
    if r.returncode: sys.stderr.write(r.stderr); return r.returncode
    found, skip = json.loads(r.stdout), {}
    keep = [d for d in found if not (d['code'] == 'E501' and d['location']['row'] in
                                     skip.setdefault(d['filename'], generated(Path(d['filename']))))]
    for d in keep:
        print(f"{os.path.relpath(d['filename'])}:{d['location']['row']}:{d['location']['column']}: "
              f"{d['code']} {d['message']}")
    print(f"ruff: {len(keep)} finding(s)" + (f" ({len(found) - len(keep)} on nbdev's generated lines left out)"
                                              if len(found) > len(keep) else ''))
    return 1 if keep else 0

if __name__ == '__main__':
    ruff = sys.argv[1] if len(sys.argv) > 1 else str(Path(sys.executable).parent/'ruff')
    sys.exit(main(ruff, sys.argv[2:] or ['transject_nb']))
