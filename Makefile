# One-command entry points. `make quickstart` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU build of torch (a plain `torch` requirement may pull a multi-GB CUDA build).
TORCH  ?= torch==2.13.0

.PHONY: setup quickstart test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml environments/arithmetic/pyproject.toml \
		environments/actor_verifier/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]" -e environments/arithmetic \
		-e environments/actor_verifier
	touch $@

# Runs the quickstart notebook headless; the executed notebook and its figure land in results/.
quickstart: setup
	mkdir -p results
	$(BIN)/papermill notebooks/01_quickstart.ipynb results/01_quickstart.ipynb \
		-p results_dir ../results -p run_dir ../runs/quickstart --cwd notebooks
	@$(BIN)/python -c "import json; print(json.load(open('results/quickstart.json')))"

# The whole test suite (CPU, no network), notebooks included (run small via nbmake).
test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/async_vs_sync.py
	$(BIN)/python bench/delta.py
	$(BIN)/python bench/services.py
	$(BIN)/python bench/multipolicy.py
	$(BIN)/python bench/multipolicy_sim.py

clean:
	rm -rf $(VENV) results runs .pytest_cache
