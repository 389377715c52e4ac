"""A faithful local preview of the documentation site, rendered without Quarto and offline.

`nbdev-docs` is nbdev's notebook processing (`nbdev.serve.proc_nbs`: front matter from the title cell,
`show_doc` entries for exported names, `#| hide` cells dropped, doc links) followed by Quarto, which is
pandoc with Quarto's filters and template. Quarto cannot be installed here, so this script runs the same
nbdev processing and then does Quarto's part with Debian's pandoc:

1. every processed notebook (`_proc/*.ipynb`) becomes one pandoc-markdown document the way Quarto's
   Jupyter engine writes it: the front matter first, markdown cells as they are, each code cell a
   `::: {.cell}` block with its source (leading `#|` option lines removed) and its outputs. The cell
   options Quarto acts on are honoured: `echo: false` (no source), `output: false` (no outputs),
   `output: asis` (outputs as raw markdown: nbdev's `show_doc` entries), `include: false` (nothing),
   `warning: false` (no stderr). Outputs are chosen by Quarto's preference (markdown, images, HTML,
   plain text); figures are written as files next to the page, as Quarto does;
2. pandoc renders each document to `<output-file>` (the page name nbdev sets, e.g. `analysis.html`) with
   `.ci/preview/template.html` (navbar, the sidebar of `nbs/sidebar.yml`, title and description, table of
   contents), `.ci/preview/quarto.lua` (callout boxes; links to notebooks and into the published site made
   local) and KaTeX for the formulas, served from `katex/` next to the pages (copied from the npm package,
   `make docs-preview` installs it), so the preview needs no network. The style sheets and the table of
   contents follow `nbs/_quarto.yml` (`format: html`: `css`, `toc`, `toc-depth`).

`_docs_html/manifest.json` lists the pages with their notebooks, titles and figures, for `.ci/check_pages.py`;
`_docs_html/_src/` keeps the markdown pandoc read.

    .venv/bin/python .ci/docs_preview.py                 # all notebooks, into _docs_html/
    .venv/bin/python .ci/docs_preview.py --force         # reprocess every notebook (ignore nbdev's cache)
"""
import argparse, base64, json, os, re, shutil, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent/'preview'
KATEX_DIST = ROOT/'.cache'/'npm'/'node_modules'/'katex'/'dist'
# Quarto's preference among the representations of one output, for HTML pages
MIME_ORDER = ('text/markdown', 'image/svg+xml', 'image/png', 'image/jpeg', 'text/html', 'text/latex', 'text/plain')
IMAGE_EXT = {'image/png': 'png', 'image/jpeg': 'jpg', 'image/svg+xml': 'svg'}
ANSI = re.compile(r'\x1b\[[0-9;]*[A-Za-z]')


def _text(v)->str: return ''.join(v) if isinstance(v, list) else str(v)


def cell_options(source:str)->tuple:
    "The cell's leading `#|` options as a dict (`#| hide` gives `hide: True`), and the source without them."
    lines, opts = source.splitlines(), {}
    i = 0
    while i < len(lines) and lines[i].startswith('#|'):
        body = lines[i][2:].strip()
        if ':' in body:
            try: opts.update(yaml.safe_load(body) or {})
            except yaml.YAMLError: opts[body.split(':', 1)[0].strip()] = body.split(':', 1)[1].strip()
        elif body: opts[body] = True
        i += 1
    return opts, '\n'.join(lines[i:]).strip('\n')


def fence(text:str, info:str='')->str:
    "A fenced block holding `text`, its fence longer than any backtick fence inside."
    n = max([3] + [len(m) + 1 for m in re.findall(r'^[ \t]*(`{3,})', text, re.M)])
    return f"{'`' * n}{info}\n{text.rstrip()}\n{'`' * n}"


def div(classes:str, body:str)->str: return f"::: {{{classes}}}\n{body.strip()}\n:::"


def front_matter(nb:dict)->dict:
    "The YAML front matter nbdev put in the first (raw) cell, or {}."
    c = nb['cells'][0] if nb['cells'] else None
    if not c or c['cell_type'] != 'raw' or not _text(c['source']).startswith('---'): return {}
    return yaml.safe_load(_text(c['source']).strip().strip('-')) or {}


class Page:
    "One notebook rendered to pandoc markdown; figures written under `<out>/<stem>_files/figure-html/`."
    def __init__(self, nb:dict, out:Path, stem:str):
        self.nb, self.out, self.stem, self.figures = nb, out, stem, []

    def figure(self, ci:int, oi:int, mime:str, data)->str:
        ext = IMAGE_EXT[mime]
        rel = f"{self.stem}_files/figure-html/cell-{ci}-output-{oi}.{ext}"
        path = self.out/rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if ext == 'svg': path.write_text(_text(data))
        else: path.write_bytes(base64.b64decode(_text(data)))
        self.figures.append(rel)
        return f"![]({rel})"

    def output(self, ci:int, oi:int, o:dict, opts:dict)->str|None:
        "Markdown for one output of cell `ci`, or None when the options leave it out."
        asis = opts.get('output') == 'asis'
        kind = o['output_type']
        if kind == 'stream':
            if o.get('name') == 'stderr' and opts.get('warning') is False: return None
            text = ANSI.sub('', _text(o.get('text', '')))
            return text if asis else div(f".cell-output .cell-output-{o.get('name', 'stdout')}", fence(text))
        if kind == 'error':
            tb = ANSI.sub('', '\n'.join(o.get('traceback', [])) or f"{o.get('ename')}: {o.get('evalue')}")
            return div('.cell-output .cell-output-error', fence(tb))
        data = o.get('data', {})
        mime = next((m for m in MIME_ORDER if m in data), None)
        if mime is None: return None
        if asis and mime in ('text/markdown', 'text/html', 'text/plain'): return _text(data[mime])
        if mime == 'text/markdown': body = _text(data[mime])
        elif mime in IMAGE_EXT: body = self.figure(ci, oi, mime, data[mime])
        elif mime == 'text/html': body = fence(_text(data[mime]), '{=html}')
        elif mime == 'text/latex': body = fence(_text(data[mime]), '{=latex}')
        else: body = fence(ANSI.sub('', _text(data[mime])))
        return div('.cell-output .cell-output-display', body)

    def code_cell(self, ci:int, cell:dict)->str|None:
        opts, code = cell_options(_text(cell['source']))
        if opts.get('include') is False: return None
        parts = []
        if opts.get('echo', True) is not False and code.strip(): parts.append(fence(code, ' {.python .cell-code}'))
        if opts.get('output', True) is not False:
            parts += [md for oi, o in enumerate(cell.get('outputs', [])) if (md := self.output(ci, oi, o, opts)) is not None]
        if not parts: return None
        return div('.cell', '\n\n'.join(parts))

    def markdown(self)->str:
        "The whole page as one pandoc-markdown document, front matter first."
        blocks = []
        for ci, c in enumerate(self.nb['cells']):
            src = _text(c['source'])
            if c['cell_type'] == 'raw': blocks.append(src.strip())
            elif c['cell_type'] == 'markdown': blocks.append(src.strip())
            elif c['cell_type'] == 'code' and (md := self.code_cell(ci, c)) is not None: blocks.append(md)
        return '\n\n'.join(b for b in blocks if b) + '\n'


LOCAL_IMAGE = re.compile(r'!\[[^\]]*\]\((?!https?:|/)([^)\s]+)\)')

def copy_images(nb:dict, nbs:Path, out:Path)->list:
    "Copy the local images the markdown cells show (e.g. `results/claims.png`) next to the pages, as Quarto does."
    refs = [r for c in nb['cells'] if c['cell_type'] == 'markdown' for r in LOCAL_IMAGE.findall(_text(c['source']))]
    refs = [r for r in refs if (nbs/r).is_file()]   # a missing one stays missing: the page check reports it
    for r in refs:
        (out/r).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(nbs/r, out/r)
    return refs


def sidebar_items(sidebar_yml:Path)->list:
    "The `website.sidebar.contents` of Quarto's sidebar file."
    d = yaml.safe_load(sidebar_yml.read_text())
    sb = d['website']['sidebar']
    return sb['contents'] if isinstance(sb, dict) else sb[0]['contents']


def sidebar_html(items, pages:dict, current:str)->str:
    "The sidebar as nested lists; `pages` maps a notebook to (page, title); `current` is highlighted."
    def esc(s): return str(s).replace('&', '&amp;').replace('<', '&lt;').replace('>', '&gt;')
    def entry(it):
        if isinstance(it, str) or 'href' in it:
            nb = it if isinstance(it, str) else it['href']
            if nb not in pages: raise SystemExit(f"the sidebar (sidebar.yml) lists {nb}, which is not a notebook of the site")
            page, title = pages[nb]
            text = title if isinstance(it, str) else it.get('text', title)
            active = ' class="active" aria-current="page"' if page == current else ''
            return f'<li><a href="{page}"{active}>{esc(text)}</a></li>'
        inner = ''.join(entry(x) for x in it.get('contents', []))
        return f'<li class="section"><div class="section-title">{esc(it["section"])}</div><ul>{inner}</ul></li>'
    return '<ul>' + ''.join(entry(it) for it in items) + '</ul>'


def html_options(nbs:Path)->dict:
    "The options of `_quarto.yml`'s `format: html` the preview follows: style sheets, table of contents, math."
    html = ((yaml.safe_load((nbs/'_quarto.yml').read_text()) or {}).get('format') or {}).get('html') or {}
    css = html.get('css') or []
    if html.get('html-math-method', 'katex') != 'katex':
        raise SystemExit(f"_quarto.yml sets html-math-method: {html['html-math-method']}; the preview renders math with KaTeX only")
    return dict(css=[css] if isinstance(css, str) else list(css), toc=html.get('toc', True), toc_depth=int(html.get('toc-depth', 3)))


def site_info()->dict:
    "Site title and published address, from nbdev's configuration (pyproject.toml [tool.nbdev] and [project])."
    from nbdev.config import get_config
    cfg = get_config()
    url = f"{cfg.doc_host.rstrip('/')}{cfg.doc_baseurl.rstrip('/')}/"
    return dict(title=cfg.title, url=url)


def render(md:Path, html:Path, meta:Path, sidebar:str, opts:dict)->subprocess.CompletedProcess:
    "Pandoc: one page's markdown to HTML with the preview's template and filter, and KaTeX from `katex/`."
    cmd = ['pandoc', str(md), '--from', 'markdown', '--to', 'html5', '--standalone', '--wrap=none',
           '--template', str(HERE/'template.html'), '--lua-filter', str(HERE/'quarto.lua'), '--katex=katex/',
           '--highlight-style=pygments', '--metadata-file', str(meta), '--variable', f'sidebar={sidebar}', '--output', str(html)]
    if opts['toc']: cmd += ['--toc', f"--toc-depth={opts['toc_depth']}"]
    cmd += [x for c in opts['css'] for x in ('--css', c)]
    return subprocess.run(cmd, capture_output=True, text=True)


def copy_katex(katex:Path, out:Path):
    "KaTeX's script, style and fonts into `out/katex/`."
    if not (katex/'katex.min.js').is_file():
        raise SystemExit(f"KaTeX not found in {katex}: run `make docs-preview` (it installs the npm package), "
                         "or pass --katex DIR (a KaTeX dist/ folder)")
    dst = out/'katex'
    dst.mkdir(parents=True, exist_ok=True)
    for f in ('katex.min.js', 'katex.min.css'): shutil.copy2(katex/f, dst/f)
    shutil.copytree(katex/'fonts', dst/'fonts', dirs_exist_ok=True)


def build(out:Path, katex:Path=KATEX_DIST, force:bool=False, proc:Path|None=None, nbs:Path=ROOT/'nbs')->dict:
    "Render every notebook of `nbs` (processed by nbdev into `proc`, by default now) into `out`; returns the manifest."
    if not shutil.which('pandoc'): raise SystemExit("pandoc not found: apt-get install -y pandoc")
    t0 = time.time()
    if proc is None:
        from nbdev.serve import proc_nbs
        proc = Path(proc_nbs(str(nbs), force=force, n_workers=min(2, os.cpu_count() or 1)))
    t_proc = time.time() - t0
    if out.exists():      # a previous preview goes, except the screenshots (shots/: the page check and the Lab test write them)
        old = [p for p in out.iterdir() if p.name != 'shots']
        if old and not (out/'manifest.json').is_file():
            raise SystemExit(f"{out} holds files but no preview (manifest.json): not deleting them")
        for p in old: shutil.rmtree(p) if p.is_dir() else p.unlink()
    (out/'_src').mkdir(parents=True)
    copy_katex(katex, out)
    shutil.copy2(HERE/'preview.css', out/'preview.css')
    opts = html_options(nbs)
    for c in opts['css']: shutil.copy2(nbs/c, out/c)
    site = site_info()
    loaded = {p.name: json.loads(p.read_text()) for p in sorted(proc.glob('*.ipynb'))}
    pages = {}
    for name, nb in loaded.items():
        fm = front_matter(nb)
        if not fm.get('title'): raise SystemExit(f"{name}: no title in the processed front matter (its first cell must be '# Title')")
        pages[name] = (fm.get('output-file') or Path(name).stem + '.html', fm['title'])
    items = sidebar_items(nbs/'sidebar.yml')
    meta = out/'_src'/'site.yml'
    meta.write_text(yaml.safe_dump({'site-title': site['title'], 'preview-site-url': site['url'],
                                    'preview-pages': {nb: pg for nb, (pg, _) in pages.items()}}))
    manifest, jobs = {}, []
    for name, nb in loaded.items():
        page, title = pages[name]
        pg = Page(nb, out, Path(page).stem)
        md = out/'_src'/(Path(page).stem + '.md')
        md.write_text(pg.markdown())
        manifest[page] = dict(notebook=f'{nbs.name}/{name}', title=title, figures=pg.figures + copy_images(nb, nbs, out))
        jobs.append((name, md, out/page, sidebar_html(items, pages, page)))
    with ThreadPoolExecutor(min(2, os.cpu_count() or 1)) as ex:
        results = list(ex.map(lambda j: (j[0], render(j[1], j[2], meta, j[3], opts)), jobs))
    failed = [(n, r.stderr) for n, r in results if r.returncode != 0]
    for n, r in results:
        if r.returncode == 0 and r.stderr.strip(): print(f"pandoc on {n}: {r.stderr.strip()}", file=sys.stderr)
    if failed: raise SystemExit('\n'.join(f"pandoc failed on {n}:\n{e}" for n, e in failed))
    (out/'manifest.json').write_text(json.dumps(dict(site=site, pages=manifest), indent=1))
    print(f"{len(manifest)} pages in {out} ({t_proc:.0f} s nbdev processing, {time.time() - t0 - t_proc:.0f} s rendering)")
    return manifest


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--out', default=str(ROOT/'_docs_html'), help='output folder (default _docs_html/; emptied first, but for shots/)')
    ap.add_argument('--katex', default=str(KATEX_DIST), help='KaTeX dist/ folder (default: the npm package in .cache/npm)')
    ap.add_argument('--force', action='store_true', help="reprocess every notebook, ignoring nbdev's _proc cache")
    a = ap.parse_args(argv)
    build(Path(a.out), Path(a.katex), force=a.force)


if __name__ == '__main__':
    main()
