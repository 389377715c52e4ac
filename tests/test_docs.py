"""The documentation site and its local preview (`.ci/docs_preview.py`, `.ci/check_pages.py`).

Three layers, each run where its tools are:
1. pure Python: every notebook as nbdev processes it for the docs (`nbdev.serve.proc_nbs`) has a title, a
   `show_doc` entry for every exported name, its committed figures and no error output, and the preview turns
   it into the markdown Quarto would read (cell options honoured, outputs chosen as Quarto does);
2. with pandoc and KaTeX (`apt-get install pandoc`, `make katex`): a small site rendered end to end;
3. with Chromium and its driver (`apt-get install chromium chromium-driver`): the page check passes that
   site, and catches each kind of broken page.
`.ci/run` installs all of them and sets TRANSJECT_NB_REQUIRE_TOOLS=1, under which a missing tool fails these
tests; elsewhere the tests of 2 and 3 are skipped with the reason.
"""
import ast, json, os, re, shutil, sys
from pathlib import Path

import nbformat, pytest, yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT/'.ci'))
import docs_preview as dp

NBS = sorted(p.name for p in (ROOT/'nbs').glob('*.ipynb'))
PNG = 'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=='  # 1x1 PNG
REQUIRED = os.environ.get('TRANSJECT_NB_REQUIRE_TOOLS') == '1'      # .ci/run: no skipping
need_pandoc = pytest.mark.skipif(not REQUIRED and (not shutil.which('pandoc') or not (dp.KATEX_DIST/'katex.min.js').is_file()),
                                 reason='needs pandoc (apt-get install pandoc) and KaTeX (make katex)')


def _has_chromium():
    try:
        from browser import chromium_paths; import selenium  # noqa: F401
        chromium_paths(); return True
    except Exception: return False
need_chromium = pytest.mark.skipif(not REQUIRED and not _has_chromium(), reason='needs chromium, chromium-driver and selenium')


# ---- 1. the notebooks as nbdev processes them, and their markdown

@pytest.fixture(scope='module')
def proc():
    from nbdev.serve import proc_nbs
    return Path(proc_nbs(str(ROOT/'nbs'), force=True))


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
def test_page(proc, name, tmp_path):
    src = nbformat.read(ROOT/'nbs'/name, as_version=4)
    nb = json.loads((proc/name).read_text())
    front = dp.front_matter(nb)
    assert front.get('title'), f"{name}: the page has no title (first cell must be '# Title')"
    for c in src.cells + nbformat.from_dict(nb).cells:
        for o in c.get('outputs', []):
            assert o.output_type != 'error', f"{name}: a committed output is an error: {o.get('ename')}: {o.get('evalue')}"
            assert not (o.output_type == 'stream' and 'Traceback' in o.get('text', '')), f"{name}: a traceback in a cell output"
    page = dp.Page(nb, tmp_path, 'page')
    md = page.markdown()
    # every exported name has its show_doc entry, a heading of the page
    mod, names = _exports(src)
    for n in names:
        assert re.search(rf'^#{{2,4}} {re.escape(n)}\s*$', md, re.M), f"{name}: no documentation entry for {mod}.{n}"
    # every figure cell has its committed figure, and the page shows every figure of the processed notebook
    for c in _figure_cells(src):
        assert any('image/png' in o.get('data', {}) for o in c.get('outputs', [])), \
            f"{name}: figure cell `{c.source.strip()}` has no committed figure (run nbdev-test --save)"
    shown = [c for c in nb['cells'] if c['cell_type'] == 'code' and dp.cell_options(dp._text(c['source']))[0].get('output', True) is not False]
    n_png = sum('image/png' in o.get('data', {}) for c in shown for o in c.get('outputs', []))
    test_figs = [f for f in page.figures if f.endswith('.png')]
    assert len(test_figs) == n_png and all((tmp_path/f).stat().st_size > 0 for f in test_figs), f"{name}: the page lost figures"


def test_sidebar_lists_every_notebook_once():
    "The site's navigation (nbs/sidebar.yml) has every notebook exactly once, and nothing else."
    def flat(items):
        for it in items:
            if isinstance(it, str): yield it
            elif 'section' in it: yield from flat(it.get('contents', []))
            else: yield it['href']
    listed = list(flat(dp.sidebar_items(ROOT/'nbs'/'sidebar.yml')))
    assert sorted(listed) == NBS, f"sidebar.yml and nbs/ differ: {set(listed) ^ set(NBS)}"
    assert len(listed) == len(set(listed))


def test_cell_options():
    assert dp.cell_options('#| echo: false\n#| output: asis\nshow_doc(f)') == ({'echo': False, 'output': 'asis'}, 'show_doc(f)')
    assert dp.cell_options('#| hide\n#|slow: true\nx = 1\n#| later: 1') == ({'hide': True, 'slow': True}, 'x = 1\n#| later: 1')
    assert dp.cell_options('x = 1') == ({}, 'x = 1')
    assert dp.fence('a\n````\nb').startswith('`````\n')     # a fence longer than any inside


def _cell(source, *outputs): return dict(cell_type='code', source=source, outputs=list(outputs), metadata={})
def _res(**data): return dict(output_type='execute_result', data=data, metadata={})
def _stream(name, text): return dict(output_type='stream', name=name, text=text)


def test_cell_markdown(tmp_path):
    "Cell options and output choice as Quarto applies them."
    page = dp.Page(dict(cells=[]), tmp_path, 'p')
    md = page.code_cell(0, _cell('#| slow: true\nx = 1\nx', _res(**{'text/plain': '1'})))
    assert '#|' not in md and '``` {.python .cell-code}\nx = 1\nx\n```' in md and '.cell-output-display' in md
    md = page.code_cell(1, _cell('#| echo: false\nx', _res(**{'text/plain': '1'})))
    assert 'cell-code' not in md and '```\n1\n```' in md
    assert page.code_cell(2, _cell('#| include: false\nx', _res(**{'text/plain': '1'}))) is None
    md = page.code_cell(3, _cell('#| output: false\nx', _res(**{'text/plain': '1'})))
    assert 'cell-output' not in md and 'cell-code' in md
    md = page.code_cell(4, _cell('#| echo: false\n#| output: asis\nshow_doc(f)', _res(**{'text/markdown': '### f\n\n*Doc.*', 'text/plain': 'f'})))
    assert md == '::: {.cell}\n### f\n\n*Doc.*\n:::'          # raw markdown, not wrapped in an output block
    md = page.code_cell(5, _cell('df', _res(**{'text/html': '<table></table>', 'text/plain': 'df'})))
    assert '```{=html}\n<table></table>\n```' in md
    md = page.code_cell(6, _cell('plot()', _res(**{'image/png': PNG, 'text/plain': '<Figure>'})))
    assert '![](p_files/figure-html/cell-6-output-0.png)' in md and (tmp_path/'p_files/figure-html/cell-6-output-0.png').is_file()
    md = page.code_cell(7, _cell('#| warning: false\nwarn()', _stream('stderr', 'W'), _stream('stdout', 'hi')))
    assert 'cell-output-stderr' not in md and '.cell-output-stdout' in md
    md = page.code_cell(8, _cell('p', _res(**{'text/markdown': '| a |\n|---|\n| 1 |', 'text/html': '<div>p</div>'})))
    assert '| a |' in md and '<div>' not in md              # markdown first, as Quarto prefers it


# ---- 2. a small site through pandoc

SITE_URL = 'https://transject-nb.github.io/transject_nb/'


def _nb(title, output_file, *cells, description='What this page teaches.'):
    fm = yaml.safe_dump({'title': title, 'description': description, 'output-file': output_file})
    return dict(cells=[dict(cell_type='raw', source=f'---\n{fm}---\n', metadata={})] + list(cells), metadata={}, nbformat=4, nbformat_minor=5)


def _md(s): return dict(cell_type='markdown', source=s, metadata={})


def small_site(tmp_path, extra_cells=()):
    "A processed index and one lesson page, with the nbs/ files the build reads; returns (nbs, proc)."
    nbs, proc = tmp_path/'nbs', tmp_path/'_proc'
    nbs.mkdir(); proc.mkdir()
    for f in ('styles.css', '_quarto.yml'): shutil.copy(ROOT/'nbs'/f, nbs)
    (nbs/'sidebar.yml').write_text(yaml.safe_dump({'website': {'sidebar': {'contents': ['index.ipynb', {'section': 'Lessons', 'contents': ['01_lesson.ipynb']}]}}}))
    index = _nb('site', 'index.html', _md('Read [the lesson](01_lesson.ipynb#the-flow) first.'))
    lesson = _nb('A lesson', 'lesson.html',
                 _md('## The flow\n\n::: {.callout-note}\n## Theorem (the flow)\nFor $x\\in\\mathbb{R}^n$,\n$$\\rho(x) = \\sum_i x_i^2.$$\n:::\n\n'
                     f'See [`lesson_fn`]({SITE_URL}lesson.html#lesson_fn) and [the index]({SITE_URL}).'),
                 _cell('#| echo: false\n#| output: asis\nshow_doc(lesson_fn)', _res(**{
                     'text/markdown': '---\n\n[source](https://github.com/x/y){target="_blank" style="float:right; font-size:smaller"}\n\n### lesson_fn\n\n*Doc.*',
                     'text/plain': 'lesson_fn'})),
                 _cell('plot()', _res(**{'image/png': PNG, 'text/plain': '<Figure>'})),
                 *extra_cells)
    for name, nb in (('index.ipynb', index), ('01_lesson.ipynb', lesson)):
        (proc/name).write_text(json.dumps(nb)); (nbs/name).write_text(json.dumps(nb))
    return nbs, proc


@need_pandoc
def test_render_small_site(tmp_path):
    nbs, proc = small_site(tmp_path)
    out = tmp_path/'html'
    man = dp.build(out, proc=proc, nbs=nbs)
    assert set(man) == {'index.html', 'lesson.html'} and man['lesson.html']['figures'] == ['lesson_files/figure-html/cell-3-output-0.png']
    html = (out/'lesson.html').read_text()
    assert '<h1 class="title">A lesson</h1>' in html and 'What this page teaches.' in html
    assert re.search(r'<div class="callout callout-note callout-titled">\s*<div class="callout-header">\s*Theorem \(the flow\)', html)
    assert re.search(r'<span\s+class="math display">', html) and 'katex/katex.min.js' in html and (out/'katex'/'katex.min.js').is_file()
    assert 'href="lesson.html#lesson_fn"' in html and '<a href="index.html">the index</a>' in html  # doc links made local
    assert 'href="lesson.html#the-flow"' in (out/'index.html').read_text()              # notebook links go to pages
    assert '<a href="lesson.html" class="active" aria-current="page">A lesson</a>' in html
    assert 'id="lesson_fn"' in html and 'target="_blank"' in html and '{target=' not in html
    text = re.sub(r'<pre.*?</pre>|<script.*?</script>', '', html, flags=re.S)
    assert ':::' not in text and '$$' not in text and 'output-file' not in text


# ---- 3. the page check in Chromium

@need_chromium
@need_pandoc
def test_page_check_passes_small_site(tmp_path, capsys):
    import check_pages
    nbs, proc = small_site(tmp_path)
    dp.build(tmp_path/'html', proc=proc, nbs=nbs)
    assert check_pages.main(['--docs', str(tmp_path/'html'), '--shots', 'lesson.html']) == 0, capsys.readouterr().out
    assert (tmp_path/'html'/'shots'/'lesson.png').stat().st_size > 1000


BROKEN = {   # page: (markdown cell or code cell, what the check must say)
    'div.html': (_md('::: {.callout-note}\nNever closed.\n\n:::: wrong'), 'raw markup, a fenced div'),
    'dollars.html': (_md('Inline $ x$ and $$ broken math'), 'display math ($$)'),
    'katex.html': (_md('Bad TeX: $\\frac{1}{$ here.'), 'KaTeX error'),
    'attr.html': (_md('A link {target="_blank" style="float:right"} left as text.'), 'pandoc attribute block'),
    'option.html': (_cell('x = 1\n#| echo: false\nx', _res(**{'text/plain': '1'})), 'a #| line in a code cell'),
    'script.html': (_md('<script>undefined_function()</script>'), 'JavaScript'),
    'image.html': (_md('![](no_such_figure.png)'), 'an image did not load'),
    'link.html': (_md('[gone](no_such_page.html) and [here](#no-such-anchor)'), 'link to a missing'),
}


@need_chromium
@need_pandoc
def test_page_check_catches_broken_pages(tmp_path, capsys):
    import check_pages
    nbs, proc = small_site(tmp_path)
    for page, (cell, _) in BROKEN.items():
        nb = _nb(page, page, cell)
        (proc/f'{page}.ipynb').write_text(json.dumps(nb)); (nbs/f'{page}.ipynb').write_text(json.dumps(nb))
    side = yaml.safe_load((nbs/'sidebar.yml').read_text())
    side['website']['sidebar']['contents'] += [f'{p}.ipynb' for p in BROKEN]
    (nbs/'sidebar.yml').write_text(yaml.safe_dump(side))
    out = tmp_path/'html'
    dp.build(out, proc=proc, nbs=nbs)
    man = json.loads((out/'manifest.json').read_text())
    man['pages']['lesson.html']['figures'].append('lesson_files/figure-html/lost.png')   # a figure the page lacks
    (out/'manifest.json').write_text(json.dumps(man))
    assert check_pages.main(['--docs', str(out), '--shots']) == 1
    report = capsys.readouterr().out
    blocks = dict(re.findall(r'^(?:ok  |FAIL) (\S+) .*?\n((?:     .*\n)*)', report, re.M))
    for page, (_, expected) in BROKEN.items():
        assert expected in blocks.get(page, ''), f"{page}: the check did not report {expected!r}:\n{report}"
    assert 'missing figure: lesson_files/figure-html/lost.png' in blocks['lesson.html']
    assert blocks['index.html'] == '', report
