# make demo: install what is missing, build, and run flashmonoid-bench (standard vs flash).
# make test: install what is missing, build everything (CUDA too when nvcc is present), run the
#            C++ tests, the spill check, the installed-package consumer and the Python tests.
SHELL := /bin/bash
PYTHON ?= python3
JOBS ?= $(shell nproc)
BUILD ?= build
# The demo and the Python package need no CUDA kernels unless a GPU is there to run them.
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo ON || echo OFF)

.PHONY: setup build test demo test-cpp test-install test-python clean

setup:
	@scripts/setup.sh

# ptxas's per-kernel reports go to $(BUILD)/build.log (read by the spill check), not the terminal.
build: setup
	@set -eo pipefail; start=$$(date +%s); \
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null; \
	cmake --build $(BUILD) -j $(JOBS) 2>&1 | tee -a $(BUILD)/build.log | \
	  { grep -v -e "^ptxas info" -e "bytes stack frame" -e "^\s*$$" || true; }; \
	echo "build: $$(( $$(date +%s) - start )) s on $(JOBS) cores"

test-cpp: build
	cd $(BUILD) && ctest -j $(JOBS) --output-on-failure --timeout 900
	@if grep -q "FLASHMONOID_CUDA:BOOL=ON" $(BUILD)/CMakeCache.txt; then \
	  $(PYTHON) tools/check_spills.py $(BUILD)/build.log; fi

test-install: build
	cmake --install $(BUILD) --prefix $(BUILD)/install >/dev/null
	cmake -S examples/consumer -B $(BUILD)/consumer -G Ninja -DCMAKE_PREFIX_PATH=$(abspath $(BUILD))/install >/dev/null
	cmake --build $(BUILD)/consumer
	$(BUILD)/consumer/consumer

# Installs from a clean clone of HEAD (which doubles as the install-from-clone test); CUDA kernels
# only when a GPU is there to run them. Tests needing torch or a GPU skip with a reason otherwise.
test-python: setup
	rm -rf /tmp/flashmonoid-clone && git clone -q . /tmp/flashmonoid-clone
	cd /tmp/flashmonoid-clone && FLASHMONOID_CUDA=$(GPU) $(PYTHON) -m pip install -q --no-build-isolation .
	cd /tmp/flashmonoid-clone && $(PYTHON) -m pytest -q -rs tests/python

test: test-cpp test-install test-python

demo: setup
	cmake -S . -B build-demo -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMONOID_CUDA=$(GPU) -DFLASHMONOID_TESTS=OFF >/dev/null
	cmake --build build-demo -j $(JOBS) --target flashmonoid-bench
	build-demo/bench/flashmonoid-bench

clean:
	rm -rf $(BUILD) build-demo
