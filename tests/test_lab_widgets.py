"""The explorers (nbs/20a_explorers.ipynb) as their users meet them: in a real JupyterLab, in headless Chromium.

The test starts JupyterLab on 127.0.0.1 at a free port with a random token, in a private Jupyter config,
runtime and settings folder, on a copy of the notebook (Lab saves what it runs; the repository's copy must
not change). Chromium (Debian's `chromium` and `chromium-driver`, driven by Selenium) opens the notebook and
runs every cell from the Run menu. Then, for each explorer, it drags a slider and waits for the figure in the
widget's output to be redrawn (the image data differs, and the slider's readout moved), and checks that no
error shows anywhere in the notebook: no error output, no traceback, no widget that failed to display.
Every wait is bounded, the whole test is bounded by `BUDGET_S`, and the server, its kernels and the browser
are stopped at the end, also on failure. Screenshots of the notebook go to `_docs_html/shots/lab-*.png`,
the server's log to `_docs_html/shots/lab.log`.

It needs jupyterlab and selenium (the `dev` extra) and Chromium with its driver; without them it is skipped,
unless TRANSJECT_NB_REQUIRE_TOOLS=1 (as `.ci/run` sets), when it fails.
"""
import json, os, secrets, shutil, socket, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT/'.ci'))
NOTEBOOK = ROOT/'nbs'/'20a_explorers.ipynb'
SHOTS = ROOT/'_docs_html'/'shots'
BUDGET_S = 420               # the whole test: server start, run-all, two explorers, shutdown
REQUIRED = os.environ.get('TRANSJECT_NB_REQUIRE_TOOLS') == '1'


def _missing()->str|None:
    "What this test needs and cannot find, or None."
    try:
        import jupyterlab, selenium  # noqa: F401
        from browser import chromium_paths
        chromium_paths()
    except Exception as e: return str(e)
    return None


pytestmark = pytest.mark.skipif(not REQUIRED and _missing() is not None, reason=f"needs JupyterLab and Chromium: {_missing()}")


class Deadline:
    "The test's time budget; `left(cap)` is the time a wait may take."
    def __init__(self, seconds): self.end = time.monotonic() + seconds
    def left(self, cap=None):
        s = self.end - time.monotonic()
        if s <= 0: pytest.fail(f"the JupyterLab widget test ran past its {BUDGET_S} s budget")
        return min(s, cap) if cap else s


def _free_port()->int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


def _settings(folder:Path):
    "User settings for this Lab: every cell in the DOM (no windowing), no news or update checks (offline)."
    for ext, plugin, value in (('@jupyterlab/notebook-extension', 'tracker', {'windowingMode': 'none'}),
                               ('@jupyterlab/apputils-extension', 'notification', {'fetchNews': 'false', 'checkForUpdates': False})):
        f = folder/ext/f'{plugin}.jupyterlab-settings'
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(value))


class Lab:
    "JupyterLab on 127.0.0.1, a free port and a random token, serving `root`; `stop()` ends it and its kernels."
    def __init__(self, root:Path, home:Path, deadline:Deadline):
        self.port, self.token, self.log = _free_port(), secrets.token_hex(16), home/'lab.log'
        _settings(home/'settings')
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home/'config'), JUPYTER_RUNTIME_DIR=str(home/'runtime'),
                   JUPYTERLAB_SETTINGS_DIR=str(home/'settings'), JUPYTERLAB_WORKSPACES_DIR=str(home/'workspaces'),
                   IPYTHONDIR=str(home/'ipython'), MPLBACKEND='module://matplotlib_inline.backend_inline',
                   PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]),
                   PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get('PATH', '')]),
                   OMP_NUM_THREADS='1')
        cmd = [sys.executable, '-m', 'jupyterlab', '--no-browser', '--ServerApp.ip=127.0.0.1', f'--ServerApp.port={self.port}',
               '--ServerApp.port_retries=0', f'--IdentityProvider.token={self.token}', f'--ServerApp.root_dir={root}',
               '--LabApp.news_url=', '--LabApp.extension_manager=readonly', '--ServerApp.terminals_enabled=False',
               '--ServerApp.allow_remote_access=False'] + (['--allow-root'] if os.geteuid() == 0 else [])  # .ci/run runs as root
        self.proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=self.log.open('w'), stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"
        end = time.monotonic() + deadline.left(90)
        while True:
            if self.proc.poll() is not None: pytest.fail(f"JupyterLab exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.base}/api/status?token={self.token}", timeout=2) as r:
                    if r.status == 200: break
            except OSError: pass
            if time.monotonic() > end: pytest.fail(f"JupyterLab did not answer within 90 s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def url(self, path): return f"{self.base}/{path}?token={self.token}"

    def stop(self):
        "Ask the server to shut down (it stops its kernels); then end whatever of it is left, by process id."
        import psutil
        try: procs = [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess: procs = []
        try:
            req = urllib.request.Request(f"{self.base}/api/shutdown", method='POST', headers={'Authorization': f'token {self.token}'})
            urllib.request.urlopen(req, timeout=5).close()
        except OSError: pass
        try: self.proc.wait(15)
        except subprocess.TimeoutExpired: self.proc.terminate()
        gone, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try: p.kill()
            except psutil.NoSuchProcess: pass
        psutil.wait_procs(alive, timeout=5)
        return [p.pid for p in alive]


@pytest.fixture
def lab():
    deadline = Deadline(BUDGET_S)
    with tempfile.TemporaryDirectory(prefix='lab-widgets-') as tmp:
        home = Path(tmp)
        root = home/'work'
        root.mkdir()
        shutil.copy(NOTEBOOK, root/NOTEBOOK.name)
        server = Lab(root, home, deadline)
        from browser import make_driver
        driver = None
        try:
            driver = make_driver((1400, 1100))
            yield server, driver, deadline
        finally:
            if driver is not None: driver.quit()
            server.stop()
            SHOTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(server.log, SHOTS/'lab.log')                 # the server's log, beside the screenshots
            assert server.proc.poll() is not None, "the JupyterLab server is still running"


# ---- helpers in the page

def _wait(driver, deadline, cond, what, cap=120, poll=0.5):
    "Wait (at most `cap` s, within the budget) until `cond(driver)` is truthy; returns it."
    end = time.monotonic() + deadline.left(cap)
    while True:
        try:
            if v := cond(driver): return v
        except Exception: pass
        if time.monotonic() > end:
            _shot(driver, 'timeout')
            pytest.fail(f"timed out waiting for {what} (screenshot: {SHOTS/'lab-timeout.png'})")
        time.sleep(poll)


PROBLEMS_JS = r"""
const out = [];
for (const o of document.querySelectorAll('.jp-OutputArea-output')) {
  if (o.querySelector('.jp-OutputArea-output')) continue;        // the innermost output only (a widget holds its own)
  const mime = o.getAttribute('data-mime-type') || '';
  const text = o.innerText || '';
  if (mime.includes('stderr') || mime.includes('error') || /Traceback|Error displaying widget|Exception/.test(text))
    out.push(mime + ': ' + text.slice(0, 600));
}
return out;
"""
INTERACTS_JS = r"""
return [...document.querySelectorAll('.widget-interact')].map(w => {
  const img = w.querySelector('.widget-output img');
  return {labels: [...w.querySelectorAll('.widget-label')].map(l => l.innerText),
          img: img ? img.getAttribute('src') : null};
});
"""


def _run_all(driver, deadline):
    "Kernel ready, then Run > Run All Cells, then wait until every code cell has run."
    _wait(driver, deadline, lambda d: d.execute_script(
        "const s = document.querySelector('.jp-Notebook-ExecutionIndicator'); return s && s.getAttribute('data-status') === 'idle'"),
        'the kernel to start', cap=120)
    from selenium.webdriver.common.by import By
    menu = _wait(driver, deadline, lambda d: next((m for m in d.find_elements(By.CSS_SELECTOR, '.lm-MenuBar-item')
                                                   if m.text.strip() == 'Run'), None), 'the Run menu', cap=30)
    menu.click()
    _wait(driver, deadline, lambda d: next((i for i in d.find_elements(By.CSS_SELECTOR, '.lm-Menu-item .lm-Menu-itemLabel')
                                            if i.text.strip() == 'Run All Cells'), None),
          'Run All Cells in the Run menu', cap=15).click()
    n_code = driver.execute_script("return document.querySelectorAll('.jp-CodeCell').length")
    def done(d):
        prompts = d.execute_script("return [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.innerText.trim())")
        return len(prompts) == n_code and all(p.startswith('[') and p[1:-2].isdigit() for p in prompts) and prompts
    _wait(driver, deadline, done, f'all {n_code} code cells to run', cap=300, poll=1)


def _drag_slider(driver, interact_index:int, label:str, dx:int)->tuple:
    "Drag the handle of the slider labelled `label` in the `interact_index`-th explorer by `dx` px; (readout before, after)."
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    box = driver.find_elements(By.CSS_SELECTOR, '.widget-interact')[interact_index]
    slider = next(s for s in box.find_elements(By.CSS_SELECTOR, '.widget-slider')
                  if s.find_element(By.CSS_SELECTOR, '.widget-label').text.strip() == label)
    readout = lambda: slider.find_element(By.CSS_SELECTOR, '.widget-readout').text.strip()
    handle = slider.find_element(By.CSS_SELECTOR, '.noUi-handle')
    before = readout()
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", slider)
    ActionChains(driver).click_and_hold(handle).move_by_offset(dx, 0).pause(0.2).release().perform()
    return before, readout()


def _shot(driver, name):
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS/f'lab-{name}.png'))


def test_explorers_in_jupyterlab(lab):
    server, driver, deadline = lab
    driver.get(server.url(f'lab/tree/{NOTEBOOK.name}'))
    _wait(driver, deadline, lambda d: d.execute_script("return document.querySelectorAll('.jp-Notebook .jp-Cell').length > 10"),
          'the notebook to open in JupyterLab', cap=120)
    time.sleep(2)
    _shot(driver, 'opened')
    opened = driver.execute_script(PROBLEMS_JS)
    _run_all(driver, deadline)
    # both explorers are shown live, each with its first figure drawn
    views = _wait(driver, deadline, lambda d: (v := d.execute_script(INTERACTS_JS)) and len(v) == 2 and all(x['img'] for x in v) and v,
                  'both explorers to draw their first figure', cap=120)
    assert 'layers' in views[0]['labels'] and 'step' in views[1]['labels'], views
    _shot(driver, 'explorers-run')
    # move a control of each explorer and watch its figure change
    for i, label, dx in ((0, 'layers', 25), (1, 'step', -40)):
        before_img = driver.execute_script(INTERACTS_JS)[i]['img']
        before, after = _drag_slider(driver, i, label, dx)
        assert after != before, f"explorer {i}: dragging the {label!r} slider did not move it ({before} -> {after})"
        def redrawn_or_failed(d):       # the new figure, or an error shown instead of it
            img = d.execute_script(INTERACTS_JS)[i]['img']
            return (img and img != before_img) or d.execute_script(PROBLEMS_JS)
        _wait(driver, deadline, redrawn_or_failed, f"explorer {i}'s figure to change after {label} {before} -> {after}", cap=90)
        problems = driver.execute_script(PROBLEMS_JS)
        assert not problems, f"explorer {i}, after {label} {before} -> {after}: errors in the notebook:\n" + '\n'.join(problems)
        _shot(driver, f'explorer-{i}-moved')
    assert not opened, "errors in the notebook as it opens, before running:\n" + '\n'.join(opened)
    problems = driver.execute_script(PROBLEMS_JS)
    assert not problems, "errors in the notebook:\n" + '\n'.join(problems)
