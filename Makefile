# dflash-pipeline: `make run` runs the whole pipeline locally, `make test`
# runs every test. Both install what they need first (libtorch once into a
# cache folder outside the clone; nothing else beyond Rust and pip).

CARGO ?= cargo
PYTHON ?= python3
CACHE_DIR ?= $(or $(DFLASH_CACHE_DIR),$(HOME)/.cache/dflash)
export DFLASH_CACHE_DIR := $(CACHE_DIR)

.PHONY: all setup run test test-rust lint check-grpcurl check-checkpoint check-dflash2 check-dspark check-ops-cli check-python bench build release fmt clean-cache fuzz
.PHONY: image check-deploy check-k8s check-cuda-build study

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
## The binary `release` built is run as is: `cargo run -p dflash-cli` would
## resolve the dependencies' features for that one package and rebuild many
## of them (3 min 22 s on the 2-core machine).
run: release
	$(or $(CARGO_TARGET_DIR),target)/release/dflash local $(ARGS)

## Every test: Rust unit, property, gRPC and system tests, then the checks
## that use external clients (grpcurl against a live broker, the Python client).
test: setup lint check-grpcurl test-rust check-checkpoint check-dflash2 check-dspark check-ops-cli check-python check-k8s check-deploy

lint:
	$(PYTHON) scripts/check-module-cycles.py
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --workspace --all-targets $(TEST_FEATURES) -- -D warnings

## The tests run the server binaries with their test hooks (a compute or
## training thread that hangs on purpose: cargo feature `test-hooks`, off in
## `build` and `release`). The same features on both lines: a `cargo test`
## without them would rebuild the binaries the system tests run, hookless.
TEST_FEATURES := --features dflash-target-server/test-hooks,dflash-drafter-server/test-hooks

test-rust: setup
	$(CARGO) build --workspace --bins $(TEST_FEATURES)
	DFLASH_LOCAL_RUN_DIR=$(CURDIR)/runs/test-local $(CARGO) test --workspace --no-fail-fast $(TEST_FEATURES)

## The model-sync study behind the outer optimizer's defaults (not in
## `make test`: minutes per seed): N synced drafters against one drafter on
## the same samples, per N and seed. Knobs: see the header of
## services/drafter-server/tests/model_sync_quality.rs.
study: setup
	$(CARGO) test -p dflash-drafter-server --test model_sync_quality -- --ignored --exact study --nocapture

## The drafter checkpoints of the system test's `dflash local` run load in the
## reference `dflash` package (installed once into a venv in the cache). It
## reads the run test-rust keeps (runs/test-local), hence the prerequisite
## (also under make -j).
check-checkpoint: setup test-rust
	bash scripts/check-checkpoint.sh $(CURDIR)/runs/test-local

## A trained tiny DFlash2 checkpoint loads in the reference's
## DFlash2DraftModel with 0 missing/unexpected keys and the same forward (#42).
check-dflash2: setup
	bash scripts/check-dflash2.sh

## A trained tiny DSpark checkpoint (each Markov head variant) loads in
## speculators 0.9.0's DSparkDraftModel with 0 missing/unexpected keys and
## gives the same loss and metrics on a held-out sequence (#50).
check-dspark: setup
	bash scripts/check-dspark.sh

## The Python client (clients/python) against the real broker, target-server
## and drafter-server binaries (pytest, in the venv of scripts/python-venv.sh).
check-python: setup
	$(CARGO) build --workspace --bins
	bash scripts/check-python.sh $(or $(CARGO_TARGET_DIR),target)/debug

check-grpcurl: setup
	bash scripts/check-grpcurl.sh

## `dflash-ops status`/`top`/`health` (no libtorch) work
## against a live broker and link no libtorch.
check-ops-cli: setup
	bash scripts/check-ops-cli.sh

## Mutation check of the queue's rules (scripts/mutants.sh): each named
## mutant of broker/src/queue must make its tests fail. Not in `test`: 5 min
## on the 2-core machine (27 mutants, 8-18 s each). MUTANTS picks some.
.PHONY: mutants
MUTANTS ?=
mutants:
	bash scripts/mutants.sh $(MUTANTS)

bench: setup
	$(CARGO) bench -p dflash-broker --bench throughput

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
check-deploy: setup
	$(CARGO) build --workspace --bins
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
