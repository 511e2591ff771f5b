VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch: a plain `torch` would pull a multi-GB CUDA build.
TORCH_SPEC := torch==2.13.0
WHEELS := $(wildcard /opt/wheels)
FIND_LINKS := $(if $(WHEELS),--find-links $(WHEELS),--extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install --quiet $(FIND_LINKS) "$(TORCH_SPEC)"
	$(PIP) install --quiet $(FIND_LINKS) -e ".[dev]" "$(TORCH_SPEC)"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/latentserve generate --prompt "And God said" --max-tokens 64 --temperature 0.5 --seed 0

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV)
