# lakestream_iceberg — two commands do everything on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# make test runs the tests in this many pytest processes (pytest-xdist): most tests wait on services, subprocesses and
# storage, so two keep 2 cores busy; 0 runs them in this process. Ray's and Spark's tests each stay in one process.
TEST_PROCESSES ?= 2

BENCH_PKGS := benchmarks/.bench-packages/.installed-stamp

.PHONY: postgres-bin spark-bin install demo docs docs-serve test test-fast services-up services-down bench bench-packages lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch: the CPU wheel on disk; a loose pin would pull a multi-GB CUDA build.
	$(BIN)/pip install -q -c constraints.txt 'torch==2.13.0'
	$(BIN)/pip install -q -c constraints.txt -e '.[torch,duckdb,s3,postgres,notebook,metrics,dev,ray,interop,docs]'
	touch $(STAMP)

install: $(STAMP)

# PostgreSQL server binaries (Debian) for the catalog matrix; installed once per machine.
postgres-bin:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql)

# Java 17 and the SQLite JDBC driver (Debian) for the Spark interop tests (tests/interop); installed once per machine.
spark-bin:
	@(java -version >/dev/null 2>&1 && ls /usr/share/java/sqlite-jdbc.jar >/dev/null 2>&1) || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openjdk-17-jre-headless libxerial-sqlite-jdbc-java)

demo: $(STAMP)
	$(BIN)/lakestream demo

# The documentation site (README.md's guide, the API reference from docstrings) into site/ (gitignored).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	$(BIN)/mkdocs serve

# Every test, against the real services (the test fixtures start and stop them; services-down clears leftovers).
# tests/test_docs_blocks.py runs every python block of README.md and docs/ and builds this site with --strict.
test: $(STAMP) postgres-bin spark-bin
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check lakestream_iceberg tests benchmarks catalog
	$(BIN)/mypy lakestream_iceberg
	@set +e; $(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadgroup $(PYTEST_ARGS); rc=$$?; \
	$(BIN)/python -m catalog.services down >/dev/null 2>&1; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing on purpose"; exit 1; fi; exit $$rc

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadgroup -m "not services and not slow and not spark" $(PYTEST_ARGS)

services-up: $(STAMP) postgres-bin
	$(BIN)/python -m catalog.services up

services-down:
	$(BIN)/python -m catalog.services down

# Benchmark-only packages (mosaicml-streaming for vs_streaming.py), --no-deps into their own folder, never the venv:
# their declared dependencies (transformers, torchvision, cloud SDKs, numpy<2.2) are not the project's.
$(BENCH_PKGS): $(STAMP) benchmarks/bench-requirements.txt
	$(BIN)/pip install -q --no-deps --upgrade --target benchmarks/.bench-packages -r benchmarks/bench-requirements.txt
	touch $(BENCH_PKGS)

bench-packages: $(BENCH_PKGS)

bench: $(STAMP) $(BENCH_PKGS) postgres-bin
	$(BIN)/python benchmarks/commit_scaling.py
	$(BIN)/python benchmarks/read_path.py
	$(BIN)/python benchmarks/retention.py
	$(BIN)/python benchmarks/stream_retention.py
	$(BIN)/python benchmarks/vs_kafka.py
	$(BIN)/python benchmarks/vs_colocated.py
	$(BIN)/python benchmarks/producer_churn.py --max-seconds 900
	$(BIN)/python benchmarks/step_cost.py
	$(BIN)/python benchmarks/commit_writes.py
	$(BIN)/python benchmarks/gc_sweep.py
	$(BIN)/python benchmarks/host_copy.py
	$(BIN)/python benchmarks/vs_ray.py
	$(BIN)/python benchmarks/vs_streaming.py
	$(BIN)/python benchmarks/file_encoding.py
	$(BIN)/python benchmarks/merge_cpu.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/commit_cpu.py
	$(BIN)/python benchmarks/busy_producers.py
	$(BIN)/python benchmarks/disaggregation.py
	$(BIN)/python benchmarks/fanout.py

lint: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check lakestream_iceberg tests benchmarks catalog
	$(BIN)/mypy lakestream_iceberg

# benchmarks/results/YYYY-MM-DD-*.json is tracked (the dated runs); only the scripts' latest, untracked output goes.
clean:
	rm -rf .lakestream site
	find benchmarks/results -maxdepth 1 -type f ! -name '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]-*.json' -delete
