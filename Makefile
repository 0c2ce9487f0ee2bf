# make train:       set up .venv and train the built-in debug config (synthetic data, CPU if no GPU)
# make test:        set up .venv and run the test suite: two workers, each taking whole test files (most of the
#                   suite's time is single-threaded process starts; a file's tests share its fixtures)
# make lint:        ruff's checks and its formatter's (the settings are in pyproject.toml)
# make data:        write the debug config's synthetic LCDM boxes to data/synthetic/lcdm/ (the trainer also does it on first use)
# make tensorboard: serve the runs' TensorBoard events (RUNS=runs, PORT=6006)
#
# torch is installed first, on its own (tools/install_torch.py): the CUDA build where an NVIDIA GPU is present,
# else the CPU build from PyTorch's CPU index (the default index where that cannot be reached).
# TORCH_INDEX=URL installs torch from that index whatever the machine has.

PYTHON ?= python3
VENV ?= .venv
RUNS ?= runs
PORT ?= 6006
BIN := $(VENV)/bin
TORCH_PIN := $(shell grep -E '^torch==' requirements.txt)

.PHONY: setup train test lint data tensorboard
setup: $(VENV)/.installed

# torch goes in first and alone, so that nothing resolves it to another build.
$(VENV)/.installed: requirements.txt requirements-dev.txt constraints.txt tools/install_torch.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python tools/install_torch.py $(TORCH_PIN)
	$(BIN)/pip install --quiet -c constraints.txt -r requirements-dev.txt
	touch $@

train: setup
	$(BIN)/python ds_train.py --config debug

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

data: setup
	$(BIN)/python -m pipeline.synthetic --out_dir data/synthetic/lcdm --universe lcdm

tensorboard: setup
	$(BIN)/tensorboard --logdir $(RUNS) --port $(PORT) --load_fast false
