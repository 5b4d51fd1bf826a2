# dflash-pipeline: `make run` runs the whole pipeline locally, `make test`
# runs every test. Both install what they need first (libtorch once into a
# cache folder outside the clone; nothing else beyond Rust and pip).

CARGO ?= cargo
PYTHON ?= python3
CACHE_DIR ?= $(or $(DFLASH_CACHE_DIR),$(HOME)/.cache/dflash)
export DFLASH_CACHE_DIR := $(CACHE_DIR)

.PHONY: all setup run test test-build test-rust lint check-grpcurl check-checkpoint check-dflash2 check-dspark check-ops-cli check-python bench build release fmt clean-cache fuzz
.PHONY: image check-deploy check-k8s check-cuda-build

all: build

## One-time set-up: libtorch 2.13 (CPU) from PyPI wheels into the cache, and
## gloo's headers (Debian's libgloo-dev) for crates/collective's c10d shim.
setup:
	@bash scripts/setup-libtorch.sh >/dev/null
	@bash scripts/setup-gloo-headers.sh >/dev/null

build: setup
	$(CARGO) build --workspace

release: setup
	$(CARGO) build --release --workspace

## The main job: broker + targets + drafters on the embedded tiny default, on the CPU.
## Built with the `local` profile (Cargo.toml: release for the dependencies,
## a quicker build for what runs little; #51) and only the binaries (no test
## kit), then run as is: `cargo run -p dflash-cli` would resolve the
## dependencies' features for that one package and rebuild many of them
## (3 min 22 s on the 2-core machine). Without default features: the
## broker's jemalloc is the only one (broker/Cargo.toml says why).
.PHONY: local-build
local-build: setup
	$(CARGO) build --profile local --workspace --bins --no-default-features

run: local-build
	$(or $(CARGO_TARGET_DIR),target)/local/dflash local $(ARGS)

## Every test: Rust unit, property, gRPC and system tests, then the checks
## that use external clients (grpcurl against a live broker, the Python client).
test: setup lint check-grpcurl test-rust mutants check-checkpoint check-dflash2 check-dspark check-ops-cli check-python check-k8s check-deploy

## Clippy over every target, with and without the test features, while
## building (#51). clippy-driver is our crates' rustc in make's test builds
## (LINTING: scripts/clippy-rustc, as `cargo clippy` runs it, warnings
## denied), so the lints come with the one test build and the dependencies
## are compiled once. `cargo clippy` first makes a check-mode copy of all of
## them: from an empty build folder, on 2 cores with one kept busy, it took
## 9 min 36 s and the test build after it 5 min 37 s. Cargo keeps our crates
## built with the wrapper apart from those built without it: a hand-run
## `cargo test` reuses make's build with the same variable,
## `RUSTC_WORKSPACE_WRAPPER=$$PWD/scripts/clippy-rustc cargo test --workspace $(TEST_FEATURES)`.
LINTING := RUSTC_WORKSPACE_WRAPPER=$(CURDIR)/scripts/clippy-rustc

lint: setup
	$(PYTHON) scripts/check-module-cycles.py
	$(PYTHON) scripts/check-feature-pins.py $(TEST_FEATURES)
	$(PYTHON) scripts/check-build-profile.py $(TEST_FEATURES)
	$(CARGO) fmt --all -- --check
	$(LINTING) $(CARGO) build --workspace --all-targets
	$(TEST_BUILD)

## The tests run the server binaries with their test hooks (a compute or
## training thread that hangs on purpose: cargo feature `test-hooks`, off in
## `build` and `release`). The same features everywhere: a `cargo test`
## without them would rebuild the binaries the system tests run, hookless.
TEST_FEATURES := --features dflash-target-server/test-hooks,dflash-drafter-server/test-hooks

## One debug build serves every step of `make test` (#51): the binaries, the
## tests and the examples in one cargo invocation, so one feature
## resolution. A build of the binaries alone resolves the dependencies'
## features without the dev-dependencies (dflash-proto without `testing`,
## once_cell without `default`, ...) and so rebuilds the workspace a second
## way; a `-p` build resolves them for that one package. Every step that needs
## binaries runs this same command (a no-op after the first, which puts the
## test-hooks binaries back in TEST_BIN_DIR after lint's build without the
## features) and takes them from TEST_BIN_DIR; `cargo test` after it, with
## the same LINTING, compiles nothing. Every target (benches too, in the dev
## profile here) so that clippy sees all of them.
TEST_BUILD = $(LINTING) $(CARGO) build --workspace --all-targets $(TEST_FEATURES)
TEST_BIN_DIR = $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)/debug

test-build: setup
	$(TEST_BUILD)

test-rust: test-build
	DFLASH_LOCAL_RUN_DIR=$(CURDIR)/runs/test-local $(LINTING) $(CARGO) test --workspace --no-fail-fast $(TEST_FEATURES)

## The drafter checkpoints of the system test's `dflash local` run load in the
## reference `dflash` package (installed once into a venv in the cache). It
## reads the run test-rust keeps (runs/test-local), hence the prerequisite
## (also under make -j).
check-checkpoint: setup test-rust
	bash scripts/check-checkpoint.sh $(CURDIR)/runs/test-local

## A trained tiny DFlash2 checkpoint loads in the reference's
## DFlash2DraftModel with 0 missing/unexpected keys and the same forward (#42).
check-dflash2: test-build
	bash scripts/check-dflash2.sh $(TEST_BIN_DIR)

## A trained tiny DSpark checkpoint (each Markov head variant) loads in
## speculators 0.9.0's DSparkDraftModel with 0 missing/unexpected keys and
## gives the same loss and metrics on a held-out sequence (#50).
check-dspark: test-build
	bash scripts/check-dspark.sh $(TEST_BIN_DIR)

## The Python client (clients/python) against the real broker, target-server
## and drafter-server binaries (pytest, in a venv holding exactly what the
## package declares for its tests: scripts/python-venv.sh client).
check-python: test-build
	bash scripts/check-python.sh $(TEST_BIN_DIR)

check-grpcurl: test-build
	bash scripts/check-grpcurl.sh $(TEST_BIN_DIR)

## `dflash-ops status`/`top`/`health` (no libtorch) work
## against a live broker and link no libtorch.
check-ops-cli: test-build
	bash scripts/check-ops-cli.sh $(TEST_BIN_DIR)

## Mutation check of the queue's and the lighthouse's rules
## (scripts/mutants.sh): each named mutant of broker/src/queue and
## broker/src/lighthouse must make their tests fail. In `test` (#48): the
## commit rules must be seen to be tested. MUTANTS picks some.
.PHONY: mutants
MUTANTS ?=
mutants:
	bash scripts/mutants.sh $(MUTANTS)

bench: setup
	$(CARGO) bench -p dflash-broker --bench throughput

## An operator's bad minute on the demo (#48), with the `local` build:
## 3 data-parallel drafters, one SIGKILLed, one SIGSTOPped past the quorum
## timeout, a fourth joining, the broker kill -9'd and restarted on its
## state dir; every (target, seq) must be in exactly one committed step
## (scripts/operator-faults.py). Not in `test`: about 3 minutes.
.PHONY: operator-faults
operator-faults: local-build
	$(PYTHON) scripts/operator-faults.py --bin-dir $(or $(CARGO_TARGET_DIR),target)/local --work runs/operator-faults-$$(date +%s)

## c10d's Gloo all-reduce on loopback (crates/collective): W = 2 and 4
## processes, 16 M, 64 M and 277 M f32. Not in `test`: tens of seconds, GBs.
## The dev profile is enough (the work is libtorch's; dependencies are built
## optimised) and reuses `make test`'s build instead of a release tch.
.PHONY: bench-collective
bench-collective: setup
	$(CARGO) run -p dflash-collective --example allreduce_bench

## The broker across hosts: the bench's section 7 inside the multi-host test
## bed of scripts/hosts.sh (9 network namespaces on a bridge, each link
## shaped per profile; root). Not in `test`: minutes. HOSTS_ARGS are the
## bench's (e.g. --quick, --rounds 3).
.PHONY: bench-hosts
HOSTS_ARGS ?=
bench-hosts: setup
	$(CARGO) bench -p dflash-broker --bench throughput --no-run
	bash scripts/hosts.sh run --hosts 9 -- $(CARGO) bench -p dflash-broker --bench throughput -- --only hosts $(HOSTS_ARGS)

fmt:
	$(CARGO) fmt --all

## cargo-fuzz over every decoder of untrusted bytes (tests/fuzz), FUZZ_SECONDS
## per target (default 60); not part of `test`, which replays the committed
## corpus (tests/fuzz/corpus) on stable instead. Installs cargo-fuzz when
## missing; needs the nightly toolchain. FUZZ_TARGETS picks targets.
FUZZ_SECONDS ?= 60
fuzz:
	FUZZ_SECONDS=$(FUZZ_SECONDS) bash scripts/fuzz.sh

## Deployment (deploy/): the runtime image made here from the built binaries
## on a locally debootstrapped base (no registry needed; the base is made once).
image: setup
	$(CARGO) build --workspace --bins
	bash scripts/build-image.sh --profile debug

## The compose deployment with real containers: 5 targets x 3 drafters,
## scale-up, SIGKILL, partition, a stopped target, TLS and the token.
## Skipped (with a message) where no Docker engine answers.
check-deploy: test-build
	bash scripts/check-deploy.sh

## The Kubernetes manifests render (kubectl kustomize) and validate strictly.
check-k8s:
	bash scripts/check-k8s.sh

## The CUDA variant links libtorch_cuda and fails clearly without a GPU.
## Not in `test`: the first run fetches the CUDA wheels (GBs) and compiles tch.
check-cuda-build: setup
	$(CARGO) build --workspace --bins
	bash scripts/check-cuda-build.sh

## The one prepared GPU check (#26): the CUDA build checks, then on a GPU a
## Qwen3-8B-shaped target forward with capture, the reference drafter step
## and `dflash local` on the one GPU; without a GPU it says so and passes
## after the build checks. Not in `test`: it fetches the CUDA wheels once.
.PHONY: check-gpu
check-gpu: setup
	$(CARGO) build --workspace --bins
	bash scripts/check-gpu.sh
