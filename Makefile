# Two commands do all set-up: `make run` and `make test` bootstrap .venv on first use.
# torch comes first, pinned to the CPU build (2.13.0) so that nothing later pulls a CUDA wheel;
# on a GPU machine: make TORCH="torch==2.13.0 --index-url <your CUDA wheel index>" ...
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

PYTEST := $(PY) -m pytest -p no:cacheprovider
# two workers, one per core; --dist loadfile keeps each notebook's cells in one kernel, in order
XDIST := -n 2 --dist loadfile

.PHONY: run test test-other-cpu test-fast test-own-model gpu-check zoo chromium book lab list new clean-notebooks clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

run: zoo  ## every notebook at smoke scale, then the report
	$(VENV)/bin/workbench run --all --out runs/main

# the backbones the notebooks load and the LoRA pool: copied from the shipped data/zoo (about 10 s);
# a recipe whose key moved builds here (`workbench zoo build --all` builds every recipe)
ZOO_MODELS ?= lm-tiny lm-base lm-instruct lm-reasoning lm-qbed lm-gpt2 lm-qwen2 lora-pool/lm-base clip-mini

zoo: $(STAMP)  ## the zoo models the notebooks use, copied (or built) once into the cache
	$(VENV)/bin/workbench zoo build $(ZOO_MODELS) --jobs 2

test: zoo  ## unit tests, batch tests, every notebook under nbval with strict claims, then test-other-cpu
	$(PYTEST) $(XDIST) tests notebooks --nbval-lax --nbval-current-env -m "not architectures"
	$(MAKE) test-other-cpu
	$(MAKE) gpu-check DEVICE=cpu

# Every user's CPU rounds differently: torch picks its kernels by the CPU's vector width and MKL
# its own code path. The fast suite and the shipped-card rebuild run again on torch's portable
# kernels and MKL's reproducible path, so a float compared as if every CPU rounded alike fails
# here, on one machine, as it would on another (docs/benchmarks.md: what each path moves)
OTHER_CPU := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
test-other-cpu: zoo  ## the fast suite and the lm-tiny rebuild on another CPU code path
	$(OTHER_CPU) $(PYTEST) $(XDIST) tests -m "not slow"
	$(OTHER_CPU) $(PYTEST) tests/test_shipped.py::test_lm_tiny_rebuilds_to_its_shipped_card

# 14, 16, 07 and 19 on Llama, Qwen2, GPT-2 and Mistral checkpoints that the cache has never seen:
# each builds its fine-tunes and pool first, so this takes hours on 2 cores (not in CI)
test-own-model: zoo  ## the four-architecture runs of tests/test_own_model.py
	$(PYTEST) tests/test_own_model.py -m architectures

# every notebook at smoke on the GPU, then 07 and 13 at full, measured against `workbench plan`
# (benchmarks/gpu_check.py; WRITE=--write records the table in docs/benchmarks.md). DEVICE=cpu:
# 13 at smoke under the device audit, against the plan's CPU figure (in `make test`)
DEVICE ?=
WRITE ?=
gpu-check: zoo  ## notebooks on the GPU against the plan's estimate, with the device audit
	$(PY) benchmarks/gpu_check.py $(if $(DEVICE),--device $(DEVICE)) $(WRITE)

test-fast: $(STAMP)  ## unit tests only: no notebooks, nothing marked slow (under a minute)
	$(PYTEST) $(XDIST) tests -m "not slow"

# tests/test_browser.py drives JupyterLab in this Chromium; without it that one test is skipped
chromium: $(STAMP)  ## Playwright and a headless Chromium (npm registry) for the explorers' browser test
	$(PY) -m pip install --quiet playwright
	.ci/chromium $(VENV)/chromium

# the book of a run's executed notebooks (docs/book.md): RUN=runs/rec for another run folder
RUN ?= runs/main
book: $(STAMP)  ## a static site of $(RUN)'s executed notebooks: $(RUN)/book/html/index.html
	$(VENV)/bin/workbench book $(RUN)

lab: $(STAMP)  ## JupyterLab on notebooks/ with this environment's kernel
	$(VENV)/bin/jupyter lab notebooks/

list: $(STAMP)
	$(VENV)/bin/workbench list

new: $(STAMP)  ## a new notebook from the template: make new NB=08-htfm
	$(VENV)/bin/workbench new $(NB)

clean-notebooks: $(STAMP)  ## strip outputs and volatile metadata before committing a notebook
	$(PY) -c "from workbench.notebooks import clean, discover; [print('cleaned', i.path) for i in discover() if clean(i.path)]"

clean:
	rm -rf runs/interactive .pytest_cache
