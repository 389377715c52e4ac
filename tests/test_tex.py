"""Every formula in the notebooks' prose parses as TeX.

Each `$…$` and `$$…$$` of every markdown cell of every notebook in `nbs/` is extracted with pandoc's rules for
`tex_math_dollars` (the docs are built by pandoc/Quarto) and handed to KaTeX, the renderer of the docs, in one node
process. A formula KaTeX cannot parse fails the test with its notebook, cell and message (an unbalanced brace, an
unknown command). A `\\rho` whose `\\r` became a line break leaves `$` + newline + `ho`, which is no formula at all for
pandoc; `test_no_lost_escapes_in_prose` catches that. Needs node and the KaTeX npm package (`make katex`); without them the test
is skipped, unless TRANSJECT_NB_REQUIRE_TOOLS=1 (as `.ci/run` sets after `make katex`), when it fails.
"""
import json, os, re, shutil, subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KATEX = ROOT/'.cache'/'npm'/'node_modules'/'katex'
REQUIRED = os.environ.get('TRANSJECT_NB_REQUIRE_TOOLS') == '1'

_FENCE = re.compile(r'^(```|~~~).*?^\1[^\n]*$', re.M | re.S)      # fenced code blocks
_CODE = re.compile(r'(`+)(?!`).*?(?<!`)\1(?!`)', re.S)              # inline code spans
_DISPLAY = re.compile(r'(?<!\\)\$\$(.+?)(?<!\\)\$\$', re.S)
# pandoc: an opening $ has a non-space on its right, a closing $ a non-space on its left and no digit after it
_INLINE = re.compile(r'(?<![\\$])\$(?![\s$])((?:\\.|[^$\\])*?)(?<![\s\\])\$(?![\d$])', re.S)


def formulas(md:str)->list:
    "`(tex, display)` for every dollar-delimited formula of a markdown text, code blocks and code spans left out."
    md = _CODE.sub(lambda m: ' ' * len(m.group(0)), _FENCE.sub('', md))
    out = [(m.group(1), True) for m in _DISPLAY.finditer(md)]
    rest = _DISPLAY.sub(' ', md)
    return out + [(m.group(1), False) for m in _INLINE.finditer(rest)]


def notebook_formulas(nbs:Path=ROOT/'nbs')->list:
    "`(notebook, cell index, tex, display)` for every formula of every markdown cell of every notebook in `nbs`."
    rows = []
    for nb in sorted(nbs.glob('*.ipynb')):
        for i, cell in enumerate(json.loads(nb.read_text())['cells']):
            if cell['cell_type'] != 'markdown': continue
            src = ''.join(cell['source'])
            rows += [(nb.name, i, tex, disp) for tex, disp in formulas(src)]
    return rows


_NODE = """
const katex = require(process.argv[1]);
let data = '';
process.stdin.on('data', c => data += c);
process.stdin.on('end', () => {
  const out = JSON.parse(data).map(([tex, display]) => {
    try { katex.renderToString(tex, {displayMode: display, throwOnError: true, strict: 'ignore'}); return null; }
    catch (e) { return String(e.message || e); }
  });
  process.stdout.write(JSON.stringify(out));
});
"""


def katex_errors(items:list)->list:
    "KaTeX's error message (or None) for every `(tex, display)`, all parsed in one node process."
    r = subprocess.run(['node', '-e', _NODE, str(KATEX)], input=json.dumps(items), capture_output=True, text=True, timeout=300)
    if r.returncode: raise RuntimeError(f"node failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def test_extraction_follows_pandoc():
    md = ("Cost $5 and $6, a formula $x^2$, `code $y$`, display\n$$\\frac{a}{b}$$\nand $\\rho$ then $ not math $.\n"
          "```python\nz = '$w$'\n```\nEscaped \\$ sign, and $a$3 is not closed.")
    assert formulas(md) == [('\\frac{a}{b}', True), ('x^2', False), ('\\rho', False)]


need_katex = pytest.mark.skipif(not REQUIRED and (shutil.which('node') is None or not (KATEX/'package.json').is_file()),
                                reason='needs node and the KaTeX npm package: run `make katex`')


@need_katex
def test_katex_catches_a_broken_formula():
    "The check can fail: an unclosed brace and an unknown command are reported, valid formulas are not."
    errs = katex_errors([['\\rho(P)', False], ['\\frac{1}{', True], ['\\operatorname{spec}(P)', False], ['\\lamda_2', False]])
    assert errs[0] is None and errs[2] is None
    assert errs[1] is not None and 'KaTeX parse error' in errs[1]
    assert errs[3] is not None and 'lamda' in errs[3]


@need_katex
def test_every_notebook_formula_parses():
    rows = notebook_formulas()
    assert len(rows) > 500, f"only {len(rows)} formulas found: the extraction is broken"
    errs = katex_errors([[tex, disp] for _, _, tex, disp in rows])
    bad = [f"{nb} cell {i}: {'$$' if disp else '$'}{tex[:80]!r}: {e}" for (nb, i, tex, disp), e in zip(rows, errs) if e]
    assert not bad, f"{len(bad)} formulas KaTeX cannot parse:\n" + '\n'.join(bad)


_LOST = re.compile(r'[\r\t\x08\x0b\x0c]|(?<!\$)\$\n(?=[A-Za-z])')   # control characters; a single `$` + newline + letters


def test_lost_escape_detector():
    assert _LOST.search('and $' + '\n' + 'ho(P)$') and _LOST.search('a $' + '\t' + 'au$') and _LOST.search('$' + '\x0c' + 'rac12$')
    assert not _LOST.search('and $\\rho(P)$,\nho hum') and not _LOST.search('cost $\n5')
    assert not _LOST.search('$$x^2$$\nwith')                                       # the end of a display formula


def test_no_lost_escapes_in_prose():
    "A backslash sequence read as a string escape (\\r in \\rho, \\t in \\tau, \\b in \\beta, \\f in \\frac) leaves a control character or a line break."
    bad = []
    for nb in sorted((ROOT/'nbs').glob('*.ipynb')):
        for i, cell in enumerate(json.loads(nb.read_text())['cells']):
            if cell['cell_type'] != 'markdown': continue
            src = ''.join(cell['source'])
            for m in _LOST.finditer(src):
                bad.append(f"{nb.name} cell {i}: {src[max(0, m.start() - 30):m.end() + 10]!r}")
    assert not bad, "control characters (a lost backslash escape) in markdown:\n" + '\n'.join(bad)
