# One-command entry points. `make quickstart` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU build of torch (a plain `torch` requirement may pull a multi-GB CUDA build).
TORCH  ?= torch==2.13.0

.PHONY: setup browser quickstart test bench clean

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

# Debian's chromium for the real-browser test (never a downloaded browser build). Without apt
# as root (or passwordless sudo) it only says so, and that test skips.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
	    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "note: chromium is not installed and apt needs root; the browser test will skip"; fi; }

# The whole test suite (CPU, no network), notebooks and the JupyterLab browser test included.
test: setup browser
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/async_vs_sync.py
	$(BIN)/python bench/delta.py
	$(BIN)/python bench/services.py
	$(BIN)/python bench/multipolicy.py
	$(BIN)/python bench/multipolicy_sim.py
	$(BIN)/python bench/dashboard.py

clean:
	rm -rf $(VENV) results runs .pytest_cache
