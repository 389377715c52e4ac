"""Headless Chromium for the page check and the JupyterLab widget test: Debian's `chromium` and
`chromium-driver` driven by Selenium, offline (no downloads by Selenium Manager, no background networking),
and a quiet static file server on 127.0.0.1 that records the requests it answers with an error status.
"""
import functools, http.server, os, shutil, threading

# Chromium: headless, offline, no GPU; the sandbox needs user namespaces that containers (and root) lack
CHROMIUM_FLAGS = ['--headless=new', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--disable-quic',
                  '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync',
                  '--disable-extensions', '--disable-default-apps', '--mute-audio', '--hide-scrollbars']
# In every page, before its own scripts: keep uncaught exceptions, failed resources and console errors
ERROR_HOOK = """
window.__pageErrors = [];
window.addEventListener('error', e => {
  const t = e.target;
  if (t && t !== window && (t.src || t.href)) window.__pageErrors.push('resource failed to load: ' + (t.src || t.href));
  else window.__pageErrors.push('uncaught: ' + (e.message || e) + ' at ' + (e.filename || '?') + ':' + (e.lineno || '?'));
}, true);
window.addEventListener('unhandledrejection', e => window.__pageErrors.push('unhandled rejection: ' + (e.reason && (e.reason.stack || e.reason))));
const _ce = console.error;
console.error = function(...a) { window.__pageErrors.push('console.error: ' + a.map(String).join(' ')); return _ce.apply(console, a); };
"""


def find_binary(*names, env=None)->str|None:
    "The first of `$env` and `names` found on PATH."
    for c in ((os.environ.get(env),) if env else ()) + names:
        if c and (p := shutil.which(c)): return p
    return None


def chromium_paths()->tuple:
    "(chromium, chromedriver), or raise with how to install them (Debian: apt-get install -y chromium chromium-driver)."
    chromium = find_binary('chromium', 'chromium-browser', 'google-chrome', env='CHROMIUM')
    driver = find_binary('chromedriver', env='CHROMEDRIVER')
    if not chromium or not driver:
        raise RuntimeError("Chromium and its driver are needed: apt-get install -y chromium chromium-driver "
                           f"(found chromium={chromium}, chromedriver={driver})")
    return chromium, driver


def make_driver(size=(1280, 1800)):
    "A Selenium Chrome driver on Debian's headless Chromium, with `ERROR_HOOK` in every page."
    os.environ.setdefault('SE_OFFLINE', 'true')          # Selenium Manager must not try to download anything
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    chromium, driver = chromium_paths()
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for f in CHROMIUM_FLAGS + [f'--window-size={size[0]},{size[1]}']: opts.add_argument(f)
    opts.set_capability('goog:loggingPrefs', {'browser': 'ALL'})
    d = webdriver.Chrome(options=opts, service=Service(executable_path=driver))
    d.execute_cdp_cmd('Page.addScriptToEvaluateOnNewDocument', {'source': ERROR_HOOK})
    return d


def severe_console(driver)->list:
    "Console messages of level SEVERE since the last call (uncaught exceptions, failed loads)."
    try: return [e['message'] for e in driver.get_log('browser') if e.get('level') == 'SEVERE']
    except Exception: return []


class _Recorder(http.server.SimpleHTTPRequestHandler):
    "Serves files quietly, recording every request answered with an error status."
    def log_message(self, *a): pass
    def log_request(self, code='-', size='-'):
        code = getattr(code, 'value', code)
        if str(code).isdigit() and int(code) >= 400: self.server.failed.append(f"{code} {self.path}")


def serve(folder)->tuple:
    "Serve `folder` on 127.0.0.1 at a free port in a background thread; returns (server, base url). `server.failed` lists error answers."
    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), functools.partial(_Recorder, directory=str(folder)))
    srv.failed = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/"
