"""Screenshots of the documentation pages in headless Chromium, failing on a page error.

`tests/test_docs.py` writes one HTML page per notebook to `_docs_html/`. This script serves that folder on
127.0.0.1 with `http.server`, loads some pages in headless Chromium (Debian's `chromium` package:
`apt-get install -y chromium`), saves a screenshot of each to `_docs_html/shots/`, and fails when a page
does not load or throws a JavaScript error.

For each page Chromium runs twice, offline-safe (no background networking, no component updates, no QUIC):
  1. `--dump-dom`: the page must load and its DOM must hold its `<title>`;
  2. `--screenshot`: the PNG must be written and not be blank.
Both runs log the page's console to stderr (`--enable-logging=stderr --v=0`): an uncaught JavaScript
exception fails the page, and so does any file of the page (image, script, style) that the local server
answers with an error status. Resources from other hosts (the nbconvert template's CDN scripts) cannot be
loaded offline; Chromium fails them silently, and they are not checked.

    .venv/bin/python .ci/screenshots.py                       # the default pages
    .venv/bin/python .ci/screenshots.py 09_analysis.html index.html --size 1280,2400
    .venv/bin/python .ci/screenshots.py --all                 # every page in _docs_html/
"""
import argparse, functools, http.server, os, re, shutil, socket, subprocess, sys, tempfile, threading, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PAGES = ('index.html', '02_transject.html', '09_analysis.html', '09a_explorers.html', '10_bench.html')
FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
         '--disable-component-update', '--disable-sync', '--disable-extensions', '--disable-default-apps', '--mute-audio',
         '--hide-scrollbars', '--enable-logging=stderr', '--v=0']
CONSOLE = re.compile(r':(INFO|WARNING|ERROR|FATAL):CONSOLE[:(]?\d*\)?\]\s*"(?P<msg>.*)", source: (?P<src>\S*)')


def find_chromium(explicit=None):
    "Path of the Chromium binary: `--chromium`, `$CHROMIUM`, or the first of chromium/chromium-browser/google-chrome on PATH."
    for c in (explicit, os.environ.get('CHROMIUM'), 'chromium', 'chromium-browser', 'google-chrome', 'google-chrome-stable'):
        if c and (p := shutil.which(c)): return p
    sys.exit("no Chromium found: install it (Debian: apt-get install -y chromium) or pass --chromium PATH")


class _Recorder(http.server.SimpleHTTPRequestHandler):
    "Serves files quietly, recording every request answered with an error status (a missing image, script or style)."
    failed:list = []
    def log_message(self, *a): pass
    def log_request(self, code='-', size='-'):
        if isinstance(code, int) and code >= 400 or str(code).isdigit() and int(code) >= 400: self.failed.append(f"{code} {self.path}")


def serve(folder:Path):
    "Serve `folder` on 127.0.0.1 at a free port in a background thread; returns (server, base url)."
    handler = functools.partial(_Recorder, directory=str(folder))
    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/"


def run_chromium(chromium, args, url, timeout):
    "Run one headless Chromium command on `url` with a fresh profile; returns (returncode, stdout, stderr, seconds)."
    with tempfile.TemporaryDirectory(prefix='chromium-profile-') as prof:
        t = time.time()
        try:
            p = subprocess.run([chromium, *FLAGS, f'--user-data-dir={prof}', *args, url], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return 124, e.stdout or '', (e.stderr or '') + f'\n(timed out after {timeout} s)', time.time() - t
        return p.returncode, p.stdout, p.stderr, time.time() - t


def page_errors(stderr:str, base:str, strict:bool):
    "Failures and warnings from Chromium's console log: uncaught exceptions and console errors of local scripts."
    errors, warnings = [], []
    for line in stderr.splitlines():
        m = CONSOLE.search(line)
        if not m: continue
        msg, src = m['msg'], m['src']
        if 'Uncaught' in msg or m[1] in ('ERROR', 'FATAL'):
            external = src and not src.startswith(base)
            netfail = 'Failed to load resource' in msg or 'net::ERR_' in msg
            (warnings if (external or netfail) and not strict and 'Uncaught' not in msg else errors).append(f"{msg} ({src})")
    return errors, warnings


def check_png(path:Path)->str|None:
    "None if `path` is a non-blank PNG, else what is wrong."
    if not path.is_file() or path.stat().st_size == 0: return 'no screenshot written'
    data = path.read_bytes()
    if data[:8] != b'\x89PNG\r\n\x1a\n': return 'screenshot is not a PNG'
    try:
        from PIL import Image
        im = Image.open(path).convert('L')
        lo, hi = im.getextrema()
        if hi - lo < 10: return f'screenshot is blank (grey levels {lo}..{hi})'
    except ImportError: pass
    return None


def shoot(chromium, base, docs:Path, page, out:Path, size, timeout, strict, budget_ms):
    "Load one page twice (DOM, screenshot); returns (ok, report lines)."
    url = base + page
    title = re.search(r'<title>(.*?)</title>', (docs/page).read_text(errors='replace'), re.S)
    title = title[1].strip() if title else None
    _Recorder.failed.clear()
    rc, dom, err1, t1 = run_chromium(chromium, [f'--virtual-time-budget={budget_ms}', '--dump-dom'], url, timeout)
    png = out/page.replace('.html', '.png')
    png.unlink(missing_ok=True)
    rc2, _, err2, t2 = run_chromium(chromium, [f'--virtual-time-budget={budget_ms}', f'--window-size={size}', f'--screenshot={png}'], url, timeout)
    problems = []
    if rc != 0: problems.append(f'--dump-dom exited with {rc}: {err1.strip().splitlines()[-1:] }')
    if '<html' not in dom.lower(): problems.append('--dump-dom returned no document')
    elif title and f'<title>{title}</title>' not in dom: problems.append(f'the loaded DOM has no <title>{title}</title>')
    if rc2 != 0: problems.append(f'--screenshot exited with {rc2}')
    if (p := check_png(png)): problems.append(p)
    errors, warnings = page_errors(err1 + '\n' + err2, base, strict)
    errors += [f'local resource not served: {f}' for f in _Recorder.failed if not f.endswith('/favicon.ico')]
    _Recorder.failed.clear()
    problems += [f'page error: {e}' for e in dict.fromkeys(errors)]
    lines = [f"{'ok  ' if not problems else 'FAIL'} {page}: {t1:.1f} s + {t2:.1f} s, {png if png.exists() else 'no png'}"]
    lines += [f'     - {p}' for p in problems] + [f'     (warning) {w}' for w in dict.fromkeys(warnings)]
    return not problems, lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('pages', nargs='*', help=f"pages in _docs_html/ (default: {', '.join(DEFAULT_PAGES)}, those present)")
    ap.add_argument('--all', action='store_true', help='every page in _docs_html/')
    ap.add_argument('--docs', default=str(ROOT/'_docs_html'), help='folder of HTML pages (default _docs_html/)')
    ap.add_argument('--out', default=None, help='screenshot folder (default <docs>/shots)')
    ap.add_argument('--size', default='1280,1800', help='window size W,H (default 1280,1800)')
    ap.add_argument('--timeout', type=int, default=90, help='seconds per Chromium run (default 90)')
    ap.add_argument('--budget', type=int, default=4000, help='virtual time budget per page in ms (default 4000)')
    ap.add_argument('--chromium', default=None, help='Chromium binary (default: found on PATH)')
    ap.add_argument('--strict', action='store_true', help='also fail on console errors about resources of other hosts')
    a = ap.parse_args(argv)
    docs = Path(a.docs)
    if not docs.is_dir(): sys.exit(f"{docs} does not exist: run `.venv/bin/pytest tests/test_docs.py` first, it writes the pages")
    pages = sorted(p.name for p in docs.glob('*.html')) if a.all else (a.pages or [p for p in DEFAULT_PAGES if (docs/p).is_file()])
    if missing := [p for p in pages if not (docs/p).is_file()]: sys.exit(f"no such page(s) in {docs}: {', '.join(missing)}")
    if not pages: sys.exit(f"no pages to load in {docs}")
    out = Path(a.out) if a.out else docs/'shots'
    out.mkdir(parents=True, exist_ok=True)
    chromium = find_chromium(a.chromium)
    srv, base = serve(docs)
    print(f"serving {docs} at {base}; {chromium}")
    ok_all = True
    try:
        for page in pages:
            ok, lines = shoot(chromium, base, docs, page, out, a.size, a.timeout, a.strict, a.budget)
            ok_all &= ok
            print('\n'.join(lines), flush=True)
    finally: srv.shutdown()
    print('all pages loaded without errors' if ok_all else 'some pages failed')
    return 0 if ok_all else 1


if __name__ == '__main__':
    sys.exit(main())
