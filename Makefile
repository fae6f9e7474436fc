# `make demo` and `make test` each bootstrap .venv from the pinned requirements on their own.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
MINISTACK_VENV := .venv-ministack
COLDSTART_VENV := .venv-coldstart
PYTEST_ARGS ?=
SHELL := /bin/bash
# Benchmarks print a report and end with one JSON line, which is kept in bench/results/.
LAST_LINE_TO = | tee /dev/stderr | tail -n 1 | python3 -m json.tool >

GPU_VENV := .venv-gpu
.PHONY: demo test test-fast generate check-generated bench-loader bench-loader-schemes bench-runtime bench-serve bench-cluster bench-cluster-fault bench-scale bench-coldstart gpu-check lock clean

$(STAMP): requirements.lock pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements.lock
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# ministack pins its own botocore, so it lives in a venv of its own (benchmarks only). Its Python
# sets how much CPU it spends per byte served (3.11's asyncio moves a large response's unsent
# rest down after every partial send; 3.12's does not: the README's single-node section), and
# the benchmarks record it; `make .venv-ministack/.installed MINISTACK_PYTHON=python3.12`.
MINISTACK_PYTHON ?= $(PYTHON)
$(MINISTACK_VENV)/.installed: requirements-ministack.lock
	@test -x $(MINISTACK_VENV)/bin/python || $(MINISTACK_PYTHON) -m venv $(MINISTACK_VENV)
	$(MINISTACK_VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements-ministack.lock
	@touch $@

# The cold-start benchmark's peers (accelerate, runai-model-streamer) layered over .venv: its
# packages (torch, diffusers, boto3, dlo) stay one copy, seen through a .pth file.
$(COLDSTART_VENV)/.installed: requirements-coldstart.lock $(STAMP)
	@test -x $(COLDSTART_VENV)/bin/python || $(PYTHON) -m venv $(COLDSTART_VENV)
	echo "import site; site.addsitedir('$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> $$($(COLDSTART_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_dlo_venv.pth
	$(COLDSTART_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -r requirements-coldstart.lock
	@touch $@

# Azurite, the Azure Blob emulator of the az:// source tests, pinned by tools/azurite's lock file.
AZURITE := tools/azurite/node_modules/.installed
$(AZURITE): tools/azurite/package-lock.json
	cd tools/azurite && npm ci --no-audit --no-fund --ignore-scripts
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/dlo demo

# The benchmarks' real runs (tests/bench) need ministack's and the cold start's venvs; the
# cluster runs also need root.
test: $(STAMP) $(AZURITE) $(MINISTACK_VENV)/.installed $(COLDSTART_VENV)/.installed
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP) $(AZURITE)
	$(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The CRD (and the chart's copy) and the README reference, from contract/dlo_contract's settings
# declarations, the README's metric list from the planes' metric definitions, and the golden `dlo render` files of the examples (checked by the test suite).
# check-generated renders into a temporary directory and fails with the diff.
generate: $(STAMP)
	$(VENV)/bin/python -m dlo_contract.generate
	$(VENV)/bin/python -m dlo_cli.metrics_reference
	cd tests && ../$(VENV)/bin/python -m support.golden

check-generated: $(STAMP)
	$(VENV)/bin/python -m dlo_contract.generate --check
	$(VENV)/bin/python -m dlo_cli.metrics_reference --check

bench-runtime: $(STAMP)
	set -o pipefail; $(VENV)/bin/dlo bench runtime --json $(LAST_LINE_TO) bench/results/runtime.json
	set -o pipefail; $(VENV)/bin/dlo bench runtime --host-memory --json $(LAST_LINE_TO) bench/results/host_memory.json
	set -o pipefail; $(VENV)/bin/dlo bench runtime --compiled --layers 4 --head-dim 32 --json $(LAST_LINE_TO) bench/results/runtime_compiled.json

# dlo serve offloaded (AllGather, 2 ranks) against the same server resident and the resident
# pipeline called directly, on the CPU.
bench-serve: $(STAMP)
	set -o pipefail; $(VENV)/bin/dlo bench serve --json $(LAST_LINE_TO) bench/results/serve.json

bench-loader: $(STAMP) $(MINISTACK_VENV)/.installed
	set -o pipefail; $(VENV)/bin/dlo bench loader --json --ministack $(MINISTACK_VENV)/bin/ministack $(LAST_LINE_TO) bench/results/loader.json

# One checkpoint through every source scheme's local server in one run (ministack, a directory,
# fake-gcs-server, Azurite, the https and hf test servers): fill against each server's ceiling.
bench-loader-schemes: $(STAMP) $(MINISTACK_VENV)/.installed $(AZURITE)
	set -o pipefail; $(VENV)/bin/dlo bench loader --json --schemes s3,file,gs,az,https,hf --size-mib 512 --repeats 3 --ministack $(MINISTACK_VENV)/bin/ministack $(LAST_LINE_TO) bench/results/loader_schemes.json

# Namespaces and shaped links (root, iproute2): N = 2..8 at peer/store 10x and 40x; then the scale
# model, fed with what this run and bench-loader measured.
bench-cluster: $(STAMP) $(MINISTACK_VENV)/.installed
	$(VENV)/bin/dlo bench cluster --json --ministack $(MINISTACK_VENV)/bin/ministack --modes multi-reader --head-dim 768 --out bench/results
	$(MAKE) bench-scale

# One of 8 loaders SIGKILLed at half of the fill (its progress read from the loaders' /metrics)
# against a fill without fault in the same run: the survivors' publication time and the store's
# bytes (peer/store 10x, the configuration clusters have).
bench-cluster-fault: $(STAMP) $(MINISTACK_VENV)/.installed
	$(VENV)/bin/dlo bench cluster --json --ministack $(MINISTACK_VENV)/bin/ministack --nodes 8 --peer-ratios 10 --head-dim 768 --kill-at 0.5 --kill-rank 3 --out bench/results

bench-scale: $(STAMP)
	$(VENV)/bin/python -m dlo_bench.scale_model --results bench/results

# Cold start from S3 to the first forward against the plain diffusers path and runai-model-streamer.
bench-coldstart: $(STAMP) $(MINISTACK_VENV)/.installed $(COLDSTART_VENV)/.installed
	set -o pipefail; $(COLDSTART_VENV)/bin/python -m dlo_cli.main bench coldstart --json --ministack $(MINISTACK_VENV)/bin/ministack $(LAST_LINE_TO) bench/results/coldstart.json

# The CUDA build of the pinned torch (PyPI's Linux wheel) and the rest of the lock, in a venv of
# its own: the lock pins the CPU build that CI uses.
$(GPU_VENV)/.installed: requirements.lock pyproject.toml
	@test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	grep -v '^torch==' requirements.lock > $(GPU_VENV)/requirements.txt
	$(GPU_VENV)/bin/pip install --quiet --disable-pip-version-check -r $(GPU_VENV)/requirements.txt \
		"torch==$$(sed -n 's/^torch==\([0-9.]*\).*/\1/p' requirements.lock)"
	$(GPU_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $@

# tests/gpu, the CUDA step-time benchmark and the compiled comparison (compiled resident vs
# compiled DLO vs compiled group offloading); JSON into $$OUT when set, else bench/results/.
# Without a GPU it says so and succeeds, before installing anything.
gpu-check:
	@if ! nvidia-smi -L >/dev/null 2>&1; then \
		echo "gpu-check: skipped: no CUDA device on this machine (nvidia-smi lists none)"; \
	else \
		$(MAKE) --no-print-directory $(GPU_VENV)/.installed && \
		$(GPU_VENV)/bin/dlo bench gpu-check --out "$${OUT:-bench/results}" && \
		$(GPU_VENV)/bin/dlo bench runtime --compiled --json | tail -n 1 \
			> "$${OUT:-bench/results}/runtime_compiled_cuda.json"; \
	fi

# Re-pin after changing requirements.in: resolves in a scratch venv and writes the lock.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install --quiet -r requirements.in
	.venv-lock/bin/pip freeze --exclude-editable | grep -v '^dlo' > requirements.lock
	rm -rf .venv-lock

clean:
	rm -rf $(VENV) $(MINISTACK_VENV) $(COLDSTART_VENV) $(GPU_VENV)
