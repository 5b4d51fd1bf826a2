# The programs the GPU check runs (scripts/check-gpu.sh) and
# scripts/build-for-device.sh builds for it: one list, sourced by both.
#
#   device_build_args  cargo's package and target arguments that build them
#   device_programs    their paths under a release folder (examples/ for
#                      the examples); a prebuilt folder holds them by
#                      their base names
device_build_args=(
  -p dflash-cli --bin dflash
  -p dflash-broker --bin broker
  -p dflash-target-server --bin target-server --example capture_overhead
  -p dflash-drafter-server --bin drafter-server --example drafter_step
)
# shellcheck disable=SC2034 # used by the scripts that source this file
device_programs=(dflash broker target-server drafter-server examples/capture_overhead examples/drafter_step)
