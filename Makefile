# `make demo` and `make test` each bootstrap .venv from the pinned requirements on their own.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
MINISTACK_VENV := .venv-ministack
PYTEST_ARGS ?=
SHELL := /bin/bash
# Benchmarks print a report and end with one JSON line, which is kept in bench/results/.
LAST_LINE_TO = | tee /dev/stderr | tail -n 1 | python3 -m json.tool >

.PHONY: demo test test-fast generate check-generated bench-loader bench-runtime bench-cluster lock clean

$(STAMP): requirements.lock pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements.lock
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# ministack pins its own botocore, so it lives in a venv of its own (benchmarks only).
$(MINISTACK_VENV)/.installed: requirements-ministack.lock
	@test -x $(MINISTACK_VENV)/bin/python || $(PYTHON) -m venv $(MINISTACK_VENV)
	$(MINISTACK_VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements-ministack.lock
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/dlo demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The CRD (and the chart's copy) and the README reference, from contract/dlo_contract's settings
# declarations, and the golden `dlo render` files of the examples (checked by the test suite).
# check-generated renders into a temporary directory and fails with the diff.
generate: $(STAMP)
	$(VENV)/bin/python -m dlo_contract.generate
	cd tests && ../$(VENV)/bin/python -m support.golden

check-generated: $(STAMP)
	$(VENV)/bin/python -m dlo_contract.generate --check

bench-runtime: $(STAMP)
	set -o pipefail; $(VENV)/bin/dlo bench runtime --json $(LAST_LINE_TO) bench/results/runtime.json
	set -o pipefail; $(VENV)/bin/dlo bench runtime --host-memory --json $(LAST_LINE_TO) bench/results/host_memory.json

bench-loader: $(STAMP) $(MINISTACK_VENV)/.installed
	set -o pipefail; $(VENV)/bin/dlo bench loader --json --ministack $(MINISTACK_VENV)/bin/ministack $(LAST_LINE_TO) bench/results/loader.json

bench-cluster: $(STAMP) $(MINISTACK_VENV)/.installed
	$(VENV)/bin/dlo bench cluster --json --ministack $(MINISTACK_VENV)/bin/ministack --out bench/results

# Re-pin after changing requirements.in: resolves in a scratch venv and writes the lock.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install --quiet -r requirements.in
	.venv-lock/bin/pip freeze --exclude-editable | grep -v '^dlo' > requirements.lock
	rm -rf .venv-lock

clean:
	rm -rf $(VENV) $(MINISTACK_VENV)
