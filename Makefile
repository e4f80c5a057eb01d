# One entry point for what CI runs. `make setup verify` = exactly what CI runs.
CARGO ?= cargo

.PHONY: setup build test verify fmt lint fuzz demo e2b-upstream bench bench-scale bench-container bench-network bench-snapshot bench-pool bench-vm bench-sdk bench-e2b bench-iam agent images vm-kernel s3-server sdk-test sdk-venv e2b-images e2b-test up down

# System packages the tests use (a local OCI registry, image tools, busybox for test images;
# libnss-myhostname makes every *.localhost name the loopback address: E2B sandbox hosts).
APT_PACKAGES = make nftables iproute2 systemd docker-registry skopeo umoci busybox-static apache2-utils e2fsprogs debootstrap runc python3-venv qemu-system-x86 erofs-utils cpio kmod libnss-myhostname

setup:
	@if dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then echo "system packages present"; else \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES) >/dev/null; fi

build:
	$(CARGO) build --workspace --all-targets

# Container tests run the static agent as PID 1 of their sandboxes and use the Debian test
# image (built once with debootstrap, cached under /var/cache/opendsec): make both first.
# The multi-host test drives its cluster with the SDK, from the SDK's venv.
test: agent images s3-server vm-kernel sdk-venv
	$(CARGO) nextest run --workspace --no-fail-fast
	$(MAKE) sdk-test
	$(MAKE) e2b-test

# The Python SDK (sdk/python), installed from the repo into a venv, tested against a real
# local cluster started from the built opendsecctl.
SDK_VENV ?= target/sdk-venv
sdk-venv:
	python3 -m venv $(SDK_VENV)
	$(SDK_VENV)/bin/pip install -q --upgrade pip
	$(SDK_VENV)/bin/pip install -q './sdk/python[test]'

sdk-test: agent images s3-server vm-kernel sdk-venv
	$(CARGO) build -p opendsec-cli
	OPENDSECCTL=$(CURDIR)/target/debug/opendsecctl $(SDK_VENV)/bin/pytest -q sdk/python/tests

images:
	./scripts/debian-image.sh
	./scripts/debian-image.sh systemd

# The VM backends' guest kernel and modules, from Debian's kernel package (cached by content).
vm-kernel:
	./scripts/vm-kernel.sh

# An S3-compatible server for the session sync tests (moto's server mode, from PyPI): the
# tests start it on loopback themselves (crates/testkit s3).
S3_VENV ?= target/s3-venv
s3-server:
	@[ -x $(S3_VENV)/bin/moto_server ] || { python3 -m venv $(S3_VENV) && \
	  $(S3_VENV)/bin/pip install -q --upgrade pip && \
	  $(S3_VENV)/bin/pip install -q 'moto[s3]==5.2.5' flask flask-cors boto3; }

# E2B's own SDKs, unmodified, from their registries at pinned versions, against a real local
# cluster's E2B gateway (tests/e2b); the templates' images built from Debian packages.
E2B_VENV ?= target/e2b-venv
E2B_PY_SDKS = e2b==2.63.0 e2b-code-interpreter==2.11.5
E2B_JS_SDKS = e2b@2.51.0 @e2b/code-interpreter@2.8.0
E2B_JS = target/e2b-js
# The version matrix (tests/e2b/test_versions.py): the oldest releases we support (their key
# check refuses anything but e2b_ + hex) and the newest; the newest JavaScript is E2B_JS_SDKS.
E2B_PY_OLD = e2b==2.40.0 e2b-code-interpreter==2.8.0
E2B_PY_NEW = e2b==2.64.0 e2b-code-interpreter==2.11.5
E2B_JS_OLD = e2b@2.10.1 @e2b/code-interpreter@2.0.0
e2b-images:
	./scripts/e2b-images.sh base >/dev/null
	./scripts/e2b-images.sh code-interpreter >/dev/null

e2b-test: agent e2b-images
	$(CARGO) build -p opendsec-cli
	python3 -m venv $(E2B_VENV)
	$(E2B_VENV)/bin/pip install -q --upgrade pip
	$(E2B_VENV)/bin/pip install -q $(E2B_PY_SDKS) pytest ./sdk/python
	@command -v npm >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; }
	mkdir -p $(E2B_JS) && cd $(E2B_JS) && { [ -f package.json ] || echo '{"private": true}' >package.json; } && \
	  npm install --silent --no-audit --no-fund $(E2B_JS_SDKS)
	python3 -m venv $(E2B_VENV)-old && $(E2B_VENV)-old/bin/pip install -q $(E2B_PY_OLD)
	python3 -m venv $(E2B_VENV)-new && $(E2B_VENV)-new/bin/pip install -q $(E2B_PY_NEW)
	mkdir -p $(E2B_JS)-old && cd $(E2B_JS)-old && { [ -f package.json ] || echo '{"private": true}' >package.json; } && \
	  npm install --silent --no-audit --no-fund $(E2B_JS_OLD)
	OPENDSECCTL=$(CURDIR)/target/debug/opendsecctl E2B_JS_MODULES=$(CURDIR)/$(E2B_JS)/node_modules \
	  $(E2B_VENV)/bin/pytest -q tests/e2b

# E2B's own Python suites against a local cluster's gateway (docs/e2b.md): needs checkouts of
# github.com/e2b-dev/E2B and github.com/e2b-dev/code-interpreter, which CI cannot fetch.
POINT ?= pinned
e2b-upstream: agent e2b-images
	$(CARGO) build -p opendsec-cli
	@[ -n "$(E2B_SRC)" ] && [ -n "$(E2B_CI_SRC)" ] || { echo "set E2B_SRC and E2B_CI_SRC to checkouts of e2b-dev/E2B and e2b-dev/code-interpreter" >&2; exit 2; }
	OPENDSECCTL=$(CURDIR)/target/debug/opendsecctl python3 tests/e2b/upstream/run.py \
	  --e2b-src $(E2B_SRC) --ci-src $(E2B_CI_SRC) --point $(POINT)

lint:
	$(CARGO) fmt --all -- --check
	python3 scripts/check-cycles.py --self-test
	python3 scripts/check-cycles.py
	$(CARGO) clippy --workspace --all-targets -- -D warnings

verify: lint test fuzz

# Coverage-guided fuzzing (cargo-fuzz, libFuzzer, stable toolchain: no sanitizer) of the
# public API's request decoding and validation, the layer unpacker, registry documents and the
# agent's request handling; each target for FUZZ_SECONDS, starting from the seeds in
# fuzz/seeds. A crash fails the run and leaves its input in fuzz/artifacts/.
FUZZ_SECONDS ?= 30
FUZZ_TARGETS = api_requests tar_unpack manifests agent_requests
fuzz:
	@command -v cargo-fuzz >/dev/null || $(CARGO) install --locked cargo-fuzz
	cd fuzz && $(CARGO) fuzz build --sanitizer none
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p fuzz/corpus/$$t && cp -n fuzz/seeds/$$t/* fuzz/corpus/$$t/ && \
	  echo "== fuzz $$t ($(FUZZ_SECONDS) s)" && \
	  (cd fuzz && $(CARGO) fuzz run --sanitizer none $$t -- -max_total_time=$(FUZZ_SECONDS) >$$t.log 2>&1) \
	    || { tail -n 60 fuzz/$$t.log; exit 1; }; \
	  grep -E '^Done' fuzz/$$t.log; \
	done

fmt:
	$(CARGO) fmt --all

# Bring up a local cluster with 100 sim edges, run the main job against it, stop it.
demo:
	./scripts/demo.sh

# A local cluster with container sandboxes and the Debian image, left running (as root);
# `make down` stops it.
up:
	./scripts/up.sh

down:
	./scripts/down.sh

# The issue-2 benchmark (release build, 100 sim edges).
bench:
	./scripts/bench.sh

# The issue-16 benchmark: 1,000 sim edges, 400,000 live sandboxes, IAM, watcher and apiserver
# in processes of their own; prints a table. Stops itself past 40 minutes or 16 GiB.
bench-scale:
	$(CARGO) bench -p opendsec-cli --bench scale

# The issue-4 benchmarks (container sandboxes through the API, beside runc), as root, release.
bench-container: agent
	$(CARGO) bench -p opendsec-cli --bench container

# The issue-13 benchmarks (snapshots and forks of container sandboxes), as root, release.
bench-snapshot: agent
	$(CARGO) bench -p opendsec-cli --bench snapshot

# VMs (issue 14): creation beside QEMU booting the same kernel by hand, pause, memory
# snapshots, fork x8, host memory; as root, release.
bench-vm: agent vm-kernel
	$(CARGO) bench -p opendsec-cli --bench vm

# Warm pool claims beside cold creations (issue 13), as root, release.
bench-pool: agent
	$(CARGO) bench -p opendsec-cli --bench pool

# The issue-15 benchmarks (IAM standalone, on Raft ×3 and etcd 3.4 ×3; failover), release.
bench-iam:
	@command -v etcd >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null && { systemctl disable --now etcd 2>/dev/null || true; }; }
	$(CARGO) bench -p opendsec-cli --bench iam

# The issue-11 benchmarks (sandbox networking, in a namespace of their own), as root, release.
bench-network: agent images
	$(CARGO) bench -p opendsec-cli --bench network

# E2B's SDK through the gateway beside opendsec's SDK on the same cluster (as root, release).
bench-e2b: agent e2b-images
	$(CARGO) build --release -p opendsec-cli
	python3 -m venv $(E2B_VENV)
	$(E2B_VENV)/bin/pip install -q $(E2B_PY_SDKS) ./sdk/python
	OPENDSECCTL=$(CURDIR)/target/release/opendsecctl $(E2B_VENV)/bin/python tests/e2b/bench.py

# The Python SDK beside the Rust client (opendsecctl bench) on container sandboxes (as root).
bench-sdk: agent
	$(CARGO) build --release -p opendsec-cli
	python3 -m venv $(SDK_VENV)
	$(SDK_VENV)/bin/pip install -q './sdk/python'
	OPENDSECCTL=$(CURDIR)/target/release/opendsecctl $(SDK_VENV)/bin/python sdk/python/tools/bench.py

# The in-sandbox agent as one static binary (target/x86_64-unknown-linux-gnu/release/opendsec-agent).
# Stripped: it is bound into every sandbox, and nobody debugs it from there.
agent:
	RUSTFLAGS="-C target-feature=+crt-static" CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=symbols $(CARGO) build --release -p opendsec-agent --target x86_64-unknown-linux-gnu
