# The two commands of the README. Each creates .venv when missing and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DATA ?= $(abspath ../shared/data)
TORCH_PINS := torch==2.14.1 torchvision==0.29.1

.PHONY: demo test bench install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PINS)
	$(PY) -m pip install --quiet -e '.[dev,examples]'
	touch $@

install: $(VENV)/.installed

demo: install
	LOCKSTEP_DATA=$(DATA) $(PY) examples/fashion_mnist_mlp.py --num-workers 2 --epochs 2 --lr 0.01 --momentum 0.9 --plot fashion_mnist_mlp.png

test: install
	LOCKSTEP_DATA=$(DATA) $(PY) -m pytest

bench: install
	$(PY) benchmarks/bench_jobs.py --data-dir $(DATA) --json benchmarks/results_jobs.json
	$(PY) benchmarks/checkpoint_bench.py --json benchmarks/results_checkpoint.json
	$(PY) benchmarks/ray_bench.py --data-dir $(DATA) --json benchmarks/results_ray.json
	$(PY) benchmarks/step_bench.py --data-dir $(DATA) --json benchmarks/results_step.json

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
