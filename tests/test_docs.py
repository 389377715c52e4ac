"""The documentation site, checked without Quarto.

Quarto cannot be installed on our build machines, so this runs the part of `nbdev-docs` that is nbdev's
own (`nbdev.serve.proc_nbs`: front matter, `show_doc` pages, hidden cells removed) over every notebook,
renders each processed notebook to HTML with nbconvert, and checks what a reader would see: the page
title, a documentation entry for every exported name, the committed figures, and no error output.
The HTML pages are written to `_docs_html/` (git-ignored) for `.ci/screenshots.py`.
"""
import ast, re
from pathlib import Path

import nbformat, pytest, yaml
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
NBS = sorted(p.name for p in (ROOT/'nbs').glob('*.ipynb'))
OUT = ROOT/'_docs_html'


@pytest.fixture(scope='module')
def proc():
    from nbdev.serve import proc_nbs
    return Path(proc_nbs(str(ROOT/'nbs'), force=True))


def _front(nb):
    c = nb.cells[0]
    assert c.cell_type == 'raw' and c.source.startswith('---'), "processed notebook has no front matter"
    return yaml.safe_load(c.source.strip().strip('-'))


def _exports(src_nb):
    "Module and the functions and classes it exports (constants have no `show_doc` entry), from the source notebook."
    mod = next((re.search(r'#\|\s*default_exp\s+(\S+)', c.source)[1] for c in src_nb.cells
                if c.cell_type == 'code' and re.search(r'#\|\s*default_exp', c.source)), None)
    if mod is None: return None, []
    tree = ast.parse((ROOT/'transject_nb'/f'{mod.replace(".", "/")}.py').read_text())
    defs = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, 'id', '') == '__all__' for t in node.targets):
            return mod, [n for n in map(ast.literal_eval, node.value.elts) if n in defs]
    return mod, []


def _figure_cells(src_nb):
    "Visible code cells that are one-line calls of a `plot_*` function: each must have a committed figure."
    out = []
    for c in src_nb.cells:
        if c.cell_type != 'code': continue
        lines = [l for l in c.source.splitlines() if l.strip() and not l.lstrip().startswith('#')]
        flags = ' '.join(l for l in c.source.splitlines() if l.startswith('#|'))
        if any(f in flags for f in ('hide', 'slow', 'gpu', 'notest', 'eval: false')): continue
        if len(lines) == 1 and re.match(r'\s*(\w+\.)?plot_\w+\(', lines[0]): out.append(c)
    return out


@pytest.mark.parametrize('name', NBS)
def test_page(proc, name):
    src = nbformat.read(ROOT/'nbs'/name, as_version=4)
    nb = nbformat.read(proc/name, as_version=4)
    front = _front(nb)
    assert front.get('title'), f"{name}: the page has no title (first cell must be '# Title')"
    # no cell output is an error
    for c in src.cells + nb.cells:
        for o in c.get('outputs', []):
            assert o.output_type != 'error', f"{name}: a committed output is an error: {o.get('ename')}: {o.get('evalue')}"
            assert not (o.output_type == 'stream' and 'Traceback' in o.get('text', '')), f"{name}: a traceback in a cell output"
    for c in nb.cells:                      # nbdev's processing keys that nbformat's schema does not know
        c.pop('has_sd', None); c.metadata.pop('execution', None)
    nb.metadata.pop('execution', None)
    html, _ = HTMLExporter(template_name='classic').from_notebook_node(nb, resources={'metadata': {'name': front['title']}})
    assert f"<title>{front['title']}</title>" in html
    # every exported name has its show_doc entry, rendered as a heading
    mod, names = _exports(src)
    for n in names:
        assert re.search(rf'<h[2-4][^>]*>[^<]*{re.escape(n)}\b', html), f"{name}: no documentation entry for {mod}.{n}"
    # every figure cell has its committed figure, and the page shows it
    for c in _figure_cells(src):
        assert any('image/png' in o.get('data', {}) for o in c.get('outputs', [])), \
            f"{name}: figure cell `{c.source.strip()}` has no committed figure (run nbdev-test --save)"
    n_png = sum('image/png' in o.get('data', {}) for c in nb.cells for o in c.get('outputs', []))
    assert len(re.findall(r'<img[^>]*src="data:image/png', html)) >= n_png, f"{name}: the page lost figures"
    OUT.mkdir(exist_ok=True)
    (OUT/name.replace('.ipynb', '.html')).write_text(html)
