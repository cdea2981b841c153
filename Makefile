# The two commands of the README. Each creates .venv when missing and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DATA ?= $(abspath ../shared/data)
TORCH_PINS := torch==2.14.1 torchvision==0.29.1

.PHONY: demo test lint bench bench-quick bench-scale install clean docs kill-trials

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

# make lint: ruff's full rule set (complexity <= 10) and ruff format on src/, tests/, benchmarks/
# and examples/, and mypy on src/, all configured in pyproject.toml; zero findings expected. CI runs
# it before the tests.
lint: install
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m ruff format --check src tests benchmarks examples
	$(PY) -m mypy

# make bench: about 40 minutes on 2 CPUs (5 interleaved rounds per goal) (benchmarks/README.md); every script writes its raw
# results into benchmarks/results/, and tables.py then writes the README tables from them.
RESULTS := benchmarks/results
bench: install
	$(PY) benchmarks/bench_jobs.py --data-dir $(DATA) --no-one-worker --results-dir $(RESULTS)
	$(PY) benchmarks/checkpoint_bench.py --results-dir $(RESULTS)
	$(PY) benchmarks/checkpoint_throughput.py --results-dir $(RESULTS)
	$(PY) benchmarks/ray_bench.py --data-dir $(DATA) --results-dir $(RESULTS)
	$(PY) benchmarks/step_bench.py --data-dir $(DATA) --results-dir $(RESULTS)
	$(PY) benchmarks/payload_bench.py --repeats 3 --results-dir $(RESULTS)
	$(PY) benchmarks/timeline.py --data-dir $(DATA) --results-dir $(RESULTS)
	$(PY) benchmarks/dashboard_bench.py --data-dir $(DATA) --results-dir $(RESULTS)
	$(PY) benchmarks/scale_bench.py --ranks 64 256 --rounds 5 --output-s 10 --results-dir $(RESULTS)
	$(PY) benchmarks/tables.py

# make bench-quick: a few minutes; checks that every script works (results marked quick, which
# tables.py leaves out unless given --include-quick; benchmarks/results/.gitignore keeps them
# out of git).
bench-quick: install
	$(PY) benchmarks/bench_jobs.py --quick --data-dir $(DATA) --results-dir $(RESULTS)
	$(PY) benchmarks/checkpoint_bench.py --quick --results-dir $(RESULTS)
	$(PY) benchmarks/checkpoint_throughput.py --quick --results-dir $(RESULTS)
	$(PY) benchmarks/ray_bench.py --quick --data-dir $(DATA) --results-dir $(RESULTS)
	$(PY) benchmarks/step_bench.py --quick --data-dir $(DATA) --results-dir $(RESULTS)
	$(PY) benchmarks/payload_bench.py --quick --sizes-mb 0 64 --results-dir $(RESULTS)
	$(PY) benchmarks/timeline.py --quick --data-dir $(DATA) --results-dir $(RESULTS)
	$(PY) benchmarks/dashboard_bench.py --quick --data-dir $(DATA) --results-dir $(RESULTS)
	$(PY) benchmarks/scale_bench.py --quick --results-dir $(RESULTS)
	$(PY) benchmarks/many_ranks_bench.py --quick --results-dir $(RESULTS)
	$(PY) benchmarks/tables.py

# make bench-scale: many ranks (benchmarks/README.md, "Many ranks"): the real driver with 64, 256 and
# 1,024 scripted ranks, then 32 real ranks against torchrun; 5 rounds each, about 45 minutes on 2 CPUs.
bench-scale: install
	$(PY) benchmarks/scale_bench.py --ranks 64 256 1024 --rounds 5 --results-dir $(RESULTS)
	$(PY) benchmarks/many_ranks_bench.py --ranks 32 --rounds 5 --results-dir $(RESULTS)
	$(PY) benchmarks/tables.py

# make kill-trials: 1,000 SIGKILLs (driver, a rank, the whole job) at random moments of runs that
# checkpoint at every step, on local disk and the S3 test server, each followed by a rerun and the
# checks of benchmarks/kill_trials.py (about 50 minutes on 2 CPUs). Resumable: trials accumulate in
# benchmarks/results/kill_trials.jsonl, and a second call adds only the missing ones.
kill-trials: install
	$(PY) benchmarks/kill_trials.py --trials 1000 --results $(RESULTS)/kill_trials.jsonl

# make docs: the documentation site (mkdocs.yml, docs/*.md, the API reference from the docstrings)
# into build/site, with --strict. Installs the docs extra into .venv when it is missing.
docs: install
	$(PY) -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || $(PY) -m pip install --quiet -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
