# `make test` is the test command of the README and of .ci/run.
# It mirrors nbdev's own CI: notebooks clean, library exported, README in sync, then every test.
VENV ?= .venv
BIN := $(VENV)/bin
export OMP_NUM_THREADS ?= 1
export HYPOTHESIS_PROFILE ?= ci
# KaTeX for the docs preview, from npm (Quarto loads KaTeX from a CDN; the preview serves it from local files)
KATEX_VERSION ?= 0.19.1
KATEX_STAMP := .cache/npm/katex-$(KATEX_VERSION).installed

.PHONY: test lint check-clean check-export check-readme nbtest pytest readme katex docs-preview docs-check docs-serve lab-test

test: lint check-clean check-export check-readme nbtest pytest

# ruff on the library (rules in pyproject.toml [tool.ruff]), then its line length, which .ci/lint.py checks itself
# on every line but those nbdev writes (each module's docstring and `__all__` line, `_modidx.py`); plain `ruff check` passes too
lint:
	$(BIN)/python .ci/lint.py $(BIN)/ruff transject_nb

check-clean:
	$(BIN)/nbdev-clean
	@git diff --exit-code --stat -- nbs || (echo "nbdev-clean changed notebooks: run nbdev-clean and commit" && exit 1)

check-export:
	$(BIN)/nbdev-export
	@git diff --exit-code --stat -- transject_nb pyproject.toml || (echo "nbdev-export changed the library: the .py files are out of sync with the notebooks" && exit 1)
	@test -z "$$(git status --porcelain --untracked-files=all -- transject_nb)" || (git status --porcelain -- transject_nb && echo "nbdev-export created files that are not committed" && exit 1)

readme:
	$(BIN)/nbdev-clean --fname nbs/index.ipynb   # the README is read from the clean notebook, as committed
	$(BIN)/python .ci/readme.py

check-readme: readme
	@git diff --exit-code --stat -- README.md || (echo "README.md is out of sync with nbs/index.ipynb: run make readme and commit" && exit 1)

nbtest:
	$(BIN)/nbdev-test --n-workers 2

pytest:
	$(BIN)/pytest tests/ -q -p no:cacheprovider

# The docs as their readers see them: needs pandoc, chromium and chromium-driver (Debian packages) and npm.
katex: $(KATEX_STAMP)

$(KATEX_STAMP):
	npm install --prefix .cache/npm --no-save --no-audit --no-fund --ignore-scripts --loglevel=error katex@$(KATEX_VERSION)
	@touch $@

docs-preview: katex
	$(BIN)/python .ci/docs_preview.py

docs-check:
	$(BIN)/python .ci/check_pages.py

docs-serve:
	@echo "the preview at http://127.0.0.1:8000/ (Ctrl-C stops it)"
	$(BIN)/python -m http.server --bind 127.0.0.1 --directory _docs_html 8000

lab-test:
	$(BIN)/pytest tests/test_lab_widgets.py -q -p no:cacheprovider
