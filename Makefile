# make train: set up .venv and train the built-in debug config (synthetic data, CPU if no GPU)
# make test:  set up .venv and run the test suite
# make data:  write the synthetic train/val boxes to data/synthetic/ (the trainer also does it on first use)
#
# TORCH_INDEX=https://download.pytorch.org/whl/cpu  installs torch's CPU build from PyTorch's index
# (for CPU machines whose pip would otherwise fetch the multi-GB CUDA build).

PYTHON ?= python3
VENV ?= .venv
TORCH_INDEX ?=
BIN := $(VENV)/bin
TORCH_PIN := $(shell grep -E '^torch==' requirements.txt)

.PHONY: setup train test data
setup: $(VENV)/.installed

# torch goes in first and alone, so that nothing resolves it to another build.
$(VENV)/.installed: requirements.txt requirements-dev.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH_PIN) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -c constraints.txt -r requirements-dev.txt
	touch $@

train: setup
	$(BIN)/python ds_train.py --config debug

test: setup
	$(BIN)/python -m pytest -q tests

data: setup
	$(BIN)/python -m pipeline.synthetic --out_dir data/synthetic
