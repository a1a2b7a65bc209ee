# Quickstart targets. Each creates .venv on first use; nothing else is needed but Python 3.11.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# pytest processes (pytest-xdist): one per core (the suite is CPU-bound: the training workers, servers and
# flows it starts keep both cores busy); `make test TEST_WORKERS=0` runs it in one process. Work
# stealing: the flow and chaos tests take a minute or two each, and a process left alone with the
# last of them would set the suite's end.
TEST_WORKERS ?= 2

export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED = false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS = 120
export PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW = ignore

.PHONY: run test test-fast test-under-load lint bench clean

-include mk/deploy.mk

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=python3 ...'"; exit 1; }
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[aws,gcp,dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/sailor demo

# --durations: CI's output names the slowest tests, where the suite's time goes.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

# The pure core in a few minutes: planner, simulator, store, formats, the decisions and the replay, and the
# house checks (dependency rule, import circles, function length, waits, docs). No flow, worker or testbed:
# `make test` runs those too, and the tests marked e2e (they start worker processes). The brute-force
# optimality checks (test_planner_optimality.py) are left to it.
FAST_TESTS ?= tests/test_planner.py tests/test_planner_crosszone.py tests/test_planner_goodput.py \
	tests/test_planner_kernel.py tests/test_planner_markets.py tests/test_planner_shapes.py tests/test_planner_stages.py \
	tests/test_simulator.py tests/test_simulator_network_fit.py tests/test_simulator_pipeline.py \
	tests/test_simulator_schedule.py tests/test_simulator_validation.py \
	tests/test_store_contract.py tests/test_store_backends.py tests/test_store_cli.py \
	tests/test_domain.py tests/test_catalog.py tests/test_scenario.py \
	tests/test_replay.py tests/test_decision_core.py tests/test_monitor_decisions.py tests/test_checkpoint_interval.py \
	tests/test_errors.py tests/test_architecture.py tests/test_import_cycles.py tests/test_function_length.py \
	tests/test_waits.py tests/test_docs.py
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not e2e" $(FAST_TESTS)

# The suite beside load: HOGS CPU-burning processes for the whole time, RUNS full `make test` runs in a row;
# each run's wall time and the load average are printed. The hogs end with the target, however it ends.
HOGS ?= 2
RUNS ?= 3
test-under-load: $(STAMP)
	@pids=; for i in $$(seq $(HOGS)); do $(BIN)/python -c 'while True: pass' & pids="$$pids $$!"; done; \
	trap 'kill $$pids 2>/dev/null' EXIT INT TERM; \
	for r in $$(seq $(RUNS)); do t0=$$(date +%s); $(MAKE) --no-print-directory test || exit 1; \
	  echo "make test run $$r of $(RUNS) passed in $$(( $$(date +%s) - t0 )) s beside $(HOGS) CPU hogs" \
	       "(load average $$(cut -d' ' -f1-3 /proc/loadavg))"; done

lint: $(STAMP)
	$(BIN)/ruff check .

# Every script under bench/ (or BENCHES="bench_store validate_testbed"), one after the other; those that need
# root or a GPU this machine lacks are listed as skipped. Writes RESULTS: the machine, each bench's output.
BENCHES ?=
RESULTS ?= docs/results.md
BENCH_TIMEOUT ?= 3600
bench: $(STAMP)
	$(BIN)/python bench/results.py --out $(RESULTS) --timeout $(BENCH_TIMEOUT) $(BENCHES)

clean:
	rm -rf $(VENV) .prefect .pytest_cache
