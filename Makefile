# Two commands on a fresh machine:  `make demo`  and  `make test`  (each creates .venv and installs what it needs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is only needed by the tests (the transformers reference). The default takes the CPU wheel that this
# project's machines keep on disk; elsewhere use e.g.
#   make test TORCH_SPEC=torch TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=

.PHONY: install install-test test demo clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The editable install reruns only when pyproject.toml changes (the stamp); the build backend's chatter goes to
# $(VENV)/install.log and is shown only if the install fails.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e . 2> $(VENV)/install.log || { cat $(VENV)/install.log >&2; exit 1; }
	touch $@

install: $(VENV)/.installed

install-test: $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,serve]" 2> $(VENV)/install.log || { cat $(VENV)/install.log >&2; exit 1; }

test: install-test
	$(PY) -m pytest -q -n auto --dist worksteal --durations=15 tests $(PYTEST_ARGS)

demo: install
	$(PY) -m diffspec_jax.generate

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
