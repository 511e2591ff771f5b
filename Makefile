VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch: a plain `torch` would pull a multi-GB CUDA build.
TORCH_SPEC := torch==2.13.0
WHEELS := $(wildcard /opt/wheels)
FIND_LINKS := $(if $(WHEELS),--find-links $(WHEELS),--extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: demo test test-torch-kernels bench sanitize clean

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install --quiet $(FIND_LINKS) "$(TORCH_SPEC)"
	$(PIP) install --quiet $(FIND_LINKS) -e ".[dev]" "$(TORCH_SPEC)"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/latentserve generate --prompt "And God said" --max-tokens 64 --temperature 0.5 --seed 0

test: $(VENV)/.installed
	$(PY) -m pytest -q

# The suite as the engine runs where latentserve's kernels do not (no C compiler, no AVX2): on PyTorch's kernels.
test-torch-kernels: $(VENV)/.installed
	LATENTSERVE_NATIVE_KERNELS=0 $(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/attention.py

# The kernels built with AddressSanitizer and UBSan (own cache dir), then the tests that run them: python is not
# instrumented, so libasan is preloaded; python's own allocations are never freed by design (no leak checks).
SANITIZE_CC := gcc -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
SANITIZE_TESTS := tests/kernels tests/attention/test_native_decode.py tests/attention/test_native_decode_lanes.py \
	tests/attention/test_native_prefill.py \
	tests/layers/test_quant_native.py tests/layers/test_linear.py tests/layers/test_moe.py \
	tests/models/test_attention_block.py tests/models/test_moe_block.py
sanitize: $(VENV)/.installed
	CC="$(SANITIZE_CC)" LATENTSERVE_CACHE_DIR="$${XDG_CACHE_HOME:-$$HOME/.cache}/latentserve-sanitize" \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0 \
	$(PY) -m pytest -q -p no:cacheprovider --timeout=1800 $(SANITIZE_TESTS)  # a sanitized build takes minutes

clean:
	rm -rf $(VENV)
