import os
from hypothesis import settings, HealthCheck

# `make test` sets HYPOTHESIS_PROFILE=ci: fewer examples, no deadline (the CI machine is shared and noisy).
settings.register_profile('ci', max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile('dev', max_examples=100, deadline=None)
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'dev'))


# --- faults, injected cheaply (issue 60) -------------------------------------------------------------------------
import builtins, errno, io
from pathlib import Path
import pytest


@pytest.fixture
def disk_full(monkeypatch):
    "`disk_full(after)`: from now on, files written through `os.fdopen` (every `utils.atomic_write`) take `after` more bytes in all, then fail part-way through a write as a full disk does (ENOSPC)."
    real = os.fdopen
    def start(after:int=0):
        left = [after]
        class Full:
            def __init__(self, f): self._f = f
            def write(self, b):
                n = min(len(b), left[0]); left[0] -= n
                if n < len(b):
                    self._f.write(bytes(memoryview(b)[:n]))
                    raise OSError(errno.ENOSPC, 'No space left on device')
                return self._f.write(b)
            def __getattr__(self, k): return getattr(self._f, k)
            def __enter__(self): return self
            def __exit__(self, *a): self._f.close()
        monkeypatch.setattr(os, 'fdopen', lambda *a, **k: Full(real(*a, **k)))
    return start


@pytest.fixture
def read_only(monkeypatch):
    "`read_only(folder)`: the folder and what it holds made read-only. chmod does it; for root, whom chmod does not stop, every write that could reach the folder is refused as the kernel refuses a user's (EACCES)."
    blocked, modes = [], {}
    def inside(p):
        try: p = Path(os.fsdecode(p)).absolute()
        except TypeError: return False                                   # a file descriptor
        return any(p == b or b in p.parents for b in blocked)
    def deny(p): raise PermissionError(errno.EACCES, 'Permission denied', os.fsdecode(p))
    def guard(fn, writes=lambda *a, **k: True):
        def guarded(path, *a, **k):
            if inside(path) and writes(*a, **k): deny(path)
            return fn(path, *a, **k)
        return guarded
    flags_write = lambda flags, *a, **k: bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | getattr(os, 'O_TMPFILE', 0)))
    mode_write = lambda mode='r', *a, **k: any(c in mode for c in 'wax+')
    def make(folder):
        folder = Path(folder).absolute()
        for p in [folder, *folder.rglob('*')]:
            modes[p] = p.stat().st_mode; p.chmod(modes[p] & ~0o222)
        if os.geteuid() == 0 and not blocked:
            monkeypatch.setattr(os, 'open', guard(os.open, flags_write))
            for name in ('mkdir', 'replace', 'rename', 'unlink', 'remove', 'rmdir', 'link'):
                monkeypatch.setattr(os, name, guard(getattr(os, name)))
            monkeypatch.setattr(builtins, 'open', guard(builtins.open, mode_write))
            monkeypatch.setattr(io, 'open', guard(io.open, mode_write))
        blocked.append(folder)
        return folder
    yield make
    for p, m in modes.items(): p.chmod(m)                               # so that pytest can remove its folders
