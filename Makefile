# `make test` is the test command of the README and of .ci/run.
# It mirrors nbdev's own CI: notebooks clean, library exported, README in sync, then every test.
VENV ?= .venv
BIN := $(VENV)/bin
export OMP_NUM_THREADS ?= 1
export HYPOTHESIS_PROFILE ?= ci

.PHONY: test check-clean check-export check-readme nbtest pytest readme docs-html

test: check-clean check-export check-readme nbtest pytest

check-clean:
	$(BIN)/nbdev-clean
	@git diff --exit-code --stat -- nbs || (echo "nbdev-clean changed notebooks: run nbdev-clean and commit" && exit 1)

check-export:
	$(BIN)/nbdev-export
	@git diff --exit-code --stat -- transject_nb pyproject.toml || (echo "nbdev-export changed the library: the .py files are out of sync with the notebooks" && exit 1)
	@test -z "$$(git status --porcelain --untracked-files=all -- transject_nb)" || (git status --porcelain -- transject_nb && echo "nbdev-export created files that are not committed" && exit 1)

readme:
	$(BIN)/python .ci/readme.py

check-readme: readme
	@git diff --exit-code --stat -- README.md || (echo "README.md is out of sync with nbs/index.ipynb: run make readme and commit" && exit 1)

nbtest:
	$(BIN)/nbdev-test --n-workers 2

pytest:
	$(BIN)/pytest tests/ -q -p no:cacheprovider
