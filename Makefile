# Two commands do all set-up: `make run` and `make test` bootstrap .venv on first use.
# torch comes first, pinned to the CPU build (2.13.0) so that nothing later pulls a CUDA wheel;
# on a GPU machine: make TORCH="torch==2.13.0 --index-url <your CUDA wheel index>" ...
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lab list clean-notebooks clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)  ## every notebook at smoke scale, then the report
	$(VENV)/bin/workbench run --all --out runs/main

test: $(STAMP)  ## unit tests, batch tests, and every notebook under nbval with strict claims
	$(PY) -m pytest -p no:cacheprovider tests notebooks --nbval-lax --nbval-current-env

lab: $(STAMP)  ## JupyterLab on notebooks/ with this environment's kernel
	$(VENV)/bin/jupyter lab notebooks/

list: $(STAMP)
	$(VENV)/bin/workbench list

clean-notebooks: $(STAMP)  ## strip outputs and volatile metadata before committing a notebook
	$(PY) -c "from workbench.notebooks import clean, discover; [print('cleaned', i.path) for i in discover() if clean(i.path)]"

clean:
	rm -rf runs/interactive .pytest_cache
