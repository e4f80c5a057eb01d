# One entry point for what CI runs. `make verify` = exactly CI's checks.
CARGO ?= cargo

.PHONY: build test verify fmt lint demo bench

build:
	$(CARGO) build --workspace --all-targets

test:
	$(CARGO) nextest run --workspace --no-fail-fast

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

verify: lint test

fmt:
	$(CARGO) fmt --all

# Bring up a local cluster with 100 sim edges, run the main job against it, stop it.
demo:
	./scripts/demo.sh

# The issue-2 benchmark (release build, 100 sim edges).
bench:
	./scripts/bench.sh
