"""The page check of the docs preview: every page of `_docs_html/` (written by `.ci/docs_preview.py`) loaded in
headless Chromium (Debian's `chromium` and `chromium-driver`, driven by Selenium), as a reader meets it.

A page fails on any of:
  * visible raw markup: `:::`, `$$`, inline TeX left between `$`s, pandoc attributes (`{target=...}`,
    `{.callout-note}`), front-matter keys (`title:`, `description:`) in the text, or a `#|` line in a code cell;
  * math that KaTeX did not render: an error span (`.katex-error`, with KaTeX's message) or a formula left as text;
  * a missing figure: a figure the notebook has (listed in `manifest.json`) that the page does not show,
    or any image that did not load;
  * a JavaScript error: an uncaught exception, a failed script or style, a `console.error`;
  * a local 404: a file of the page the server could not answer, or a link to a local page or anchor
    that does not exist.
Screenshots of some pages (the first 1800 px at 1280 px wide) go to `_docs_html/shots/`.

    .venv/bin/python .ci/check_pages.py                              # every page; default screenshots
    .venv/bin/python .ci/check_pages.py --shots analysis.html --full # a full-length screenshot
"""
import argparse, json, re, sys, time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urldefrag, urlparse, unquote

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser import make_driver, serve, severe_console

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ('index.html', 'transject.html', 'gradflow.html', 'analysis.html', 'explorers.html', 'bench.html')

# What the page shows, gathered in the browser after load (KaTeX renders on DOMContentLoaded)
PROBE = r"""
const skip = 'pre, code, script, style, .katex, .katex-error, .math';
const texts = [];
const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
for (let n = walker.nextNode(); n; n = walker.nextNode()) {
  const p = n.parentElement;
  if (p && !p.closest(skip) && n.data.trim()) texts.push(n.data);
}
const prose = [...document.querySelectorAll('p, li, td, th, h1, h2, h3, h4, h5, h6, dt, dd, figcaption, blockquote')]
  .filter(e => !e.closest('pre')).map(e => e.innerText);
return {
  texts: texts, prose: prose,
  cellCode: [...document.querySelectorAll('pre.cell-code')].map(e => e.textContent),
  katexErrors: [...document.querySelectorAll('.katex-error')].map(e => [e.textContent.slice(0, 120), e.title]),
  unrendered: [...document.querySelectorAll('span.math')].filter(m => !m.querySelector('.katex, .katex-error'))
                .map(m => m.textContent.slice(0, 120)),
  images: [...document.querySelectorAll('img')].map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0]),
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  errors: window.__pageErrors || [],
  title: document.title,
};
"""
RAW = [(re.compile(r':::'), 'a fenced div (:::)'),
       (re.compile(r'\$\$'), 'display math ($$)'),
       (re.compile(r'\$[^$\s][^$]*?(\\[A-Za-z]+|[_^]\{?)[^$]*\$'), 'inline TeX between $ signs'),
       (re.compile(r'\{(?:[.#=][A-Za-z]|[A-Za-z-]+=)[^}]*\}'), 'a pandoc attribute block ({...})'),
       (re.compile(r'^\s*#\|', re.M), 'a #| line')]
FRONT = re.compile(r'^\s*(title|description|output-file|skip_exec|skip_showdoc|sidebar|execute)\s*:', re.M)


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__(); self.ids = set()
    def handle_starttag(self, tag, attrs):
        self.ids.update(v for k, v in attrs if k in ('id', 'name') and v)


def page_ids(path:Path)->set:
    p = _Ids(); p.feed(path.read_text(errors='replace')); return p.ids


def check_page(driver, srv, base:str, docs:Path, page:str, expected:dict, ids:dict)->list:
    "Problems of one page, as lines of text (empty: the page is fine)."
    srv.failed.clear()
    severe_console(driver)
    driver.get(base + page)
    info = driver.execute_script(PROBE)
    problems = []
    if expected.get('title') and expected['title'] not in info['title']:
        problems.append(f"the page title is {info['title']!r}, expected it to hold {expected['title']!r}")
    for chunk in dict.fromkeys(info['texts'] + info['prose']):
        for rx, what in RAW:
            if m := rx.search(chunk): problems.append(f"raw markup, {what}: {chunk[max(0, m.start() - 40):m.end() + 40].strip()!r}")
        if m := FRONT.search(chunk): problems.append(f"a front-matter key in the text: {chunk[m.start():m.start() + 80].strip()!r}")
    for code in info['cellCode']:
        for line in code.splitlines():
            if line.lstrip().startswith('#|'): problems.append(f"a #| line in a code cell: {line.strip()!r}")
    for tex, msg in info['katexErrors']: problems.append(f"KaTeX error: {msg or '?'} in {tex!r}")
    for tex in info['unrendered']: problems.append(f"math not rendered by KaTeX: {tex!r}")
    shown = {src for src, ok in info['images'] if ok}
    for src, ok in info['images']:
        if not ok: problems.append(f"an image did not load: {src}")
    for fig in expected.get('figures', []):
        if fig not in shown: problems.append(f"missing figure: {fig} (from {expected.get('notebook')})")
    for e in info['errors']: problems.append(f"JavaScript: {e}")
    for e in severe_console(driver):
        if not any(e in p for p in problems): problems.append(f"console: {e}")
    problems += [f"local 404: {f}" for f in srv.failed]
    for href in dict.fromkeys(info['links']):
        if not href.startswith(base): continue
        url, frag = urldefrag(href)
        target = unquote(urlparse(url).path.lstrip('/')) or 'index.html'
        f = docs/target
        if not f.is_file(): problems.append(f"link to a missing local page: {href[len(base):]}")
        elif frag and f.suffix == '.html':
            if target not in ids: ids[target] = page_ids(f)
            if unquote(frag) not in ids[target]: problems.append(f"link to a missing anchor: {href[len(base):]}")
    return list(dict.fromkeys(problems))


def screenshot(driver, path:Path, full:bool):
    "The first screen (the window), or with `full` the whole page."
    if not full: return driver.save_screenshot(str(path))
    import base64
    h = driver.execute_script('return document.documentElement.scrollHeight')
    w = driver.execute_script('return document.documentElement.scrollWidth')
    shot = driver.execute_cdp_cmd('Page.captureScreenshot', {'format': 'png', 'captureBeyondViewport': True,
                                                              'clip': {'x': 0, 'y': 0, 'width': w, 'height': h, 'scale': 1}})
    path.write_bytes(base64.b64decode(shot['data']))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('pages', nargs='*', help='pages to check (default: every page in the manifest)')
    ap.add_argument('--docs', default=str(ROOT/'_docs_html'), help='the preview folder (default _docs_html/)')
    ap.add_argument('--shots', nargs='*', default=list(SHOTS), help=f"pages to screenshot (default: {' '.join(SHOTS)})")
    ap.add_argument('--full', action='store_true', help='screenshots of whole pages, not only the first screen')
    ap.add_argument('--size', default='1280,1800', help='window size W,H (default 1280,1800)')
    a = ap.parse_args(argv)
    docs = Path(a.docs)
    if not (docs/'manifest.json').is_file(): sys.exit(f"no preview in {docs}: run `make docs-preview` first")
    manifest = json.loads((docs/'manifest.json').read_text())['pages']
    pages = a.pages or sorted(manifest, key=lambda p: (p != 'index.html', manifest[p]['notebook']))
    if missing := [p for p in pages if not (docs/p).is_file()]: sys.exit(f"no such page(s) in {docs}: {', '.join(missing)}")
    shots = docs/'shots'
    shots.mkdir(exist_ok=True)
    srv, base = serve(docs)
    driver = make_driver(tuple(int(x) for x in a.size.split(',')))
    n_bad, ids, t0 = 0, {}, time.time()
    try:
        for page in pages:
            t = time.time()
            problems = check_page(driver, srv, base, docs, page, manifest.get(page, {}), ids)
            shot = ''
            if page in a.shots:
                screenshot(driver, shots/page.replace('.html', '.png'), a.full)
                shot = f", {shots/page.replace('.html', '.png')}"
            n_bad += bool(problems)
            print(f"{'FAIL' if problems else 'ok  '} {page} ({manifest.get(page, {}).get('notebook', '?')}): "
                  f"{time.time() - t:.1f} s{shot}", flush=True)
            for p in problems[:40]: print(f"     - {p}")
            if len(problems) > 40: print(f"     ... and {len(problems) - 40} more")
    finally:
        driver.quit(); srv.shutdown()
    print(f"{len(pages) - n_bad} of {len(pages)} pages passed the page check ({time.time() - t0:.0f} s)")
    return 1 if n_bad else 0


if __name__ == '__main__':
    sys.exit(main())
