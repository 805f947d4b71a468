# opband: `make demo` runs the whole pipeline on embedded defaults; `make test` passes the tests.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.opband-installed
PYTEST_ARGS ?=

.PHONY: demo test sweep bench lint venv clean serve kernels chromium gpu-wheels

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch first, pinned (a CPU wheel on this machine), so the unpinned torch>=2.3 in pyproject adds nothing; then
# opband without build isolation, so setup.py compiles hooks._observer against that torch (~40 s, once)
$(STAMP): pyproject.toml setup.py hooks/native/observer.cpp hooks/native/stats_cuda.cu hooks/native/stats_cuda.h | $(PY)
	$(PIP) install --quiet "$(TORCH)" "setuptools>=77"
	$(PIP) install --quiet --no-build-isolation -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP) kernels
	$(VENV)/bin/opband demo

serve: $(STAMP)
	$(VENV)/bin/opband serve

chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q chromium) >/dev/null

# numba compiles the metric and statistics kernels once and caches them (accuracy/__pycache__): done here, not
# inside the first test or the first upload (a cold compile takes about a minute on a 2-core machine)
kernels: $(STAMP)
	@$(PY) -c "from accuracy import fused; fused.warm_up(errors=True)"

# for a session lent the GPU: the wheels benchmarks/gpu_session.sh installs there (pydantic and its needs, for
# the device image's Python 3.12), kept out of git
gpu-wheels: $(STAMP)
	@grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		"pydantic==$$($(PY) -c 'import pydantic; print(pydantic.VERSION)')" \
		"pydantic-core==$$($(PY) -c 'import pydantic_core; print(pydantic_core.__version__)')" \
		annotated-types typing-inspection "typing-extensions>=4.16"

test: $(STAMP) chromium kernels
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -m "not sweep" -q -ra $(PYTEST_ARGS)

sweep: $(STAMP)
	$(PY) -m pytest -m sweep -q -ra $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/capture.py --model llama-small
	$(PY) benchmarks/capture.py --model llama-mid
	$(PY) benchmarks/dispatch_floor.py
	$(PY) benchmarks/compare.py
	$(PY) benchmarks/generation.py --model llama-small
	$(PY) benchmarks/generation.py --model llama-mid
	$(PY) benchmarks/prescribe.py --model llama-small
	$(PY) benchmarks/prescribe.py --model llama-mid
	$(PY) benchmarks/compare_pair.py
	$(PY) benchmarks/compare_records.py --records 10000,50000
	$(PY) benchmarks/service.py

clean:
	rm -rf $(VENV) .opband test-artifacts .pytest_cache
