#!/usr/bin/env python3
"""`cargo test -p dflash-broker` reuses the workspace's one test build
(crates/feature-pins, #51).

Cargo resolves dependencies' features for the packages a command names, so
a build of the broker alone (the mutants, a developer's run) can compile a
dependency, and everything above it, a second way. This compares cargo's
two unit graphs, without building anything: the workspace's test build and
`cargo test -p dflash-broker --lib`. Its arguments are the test build's
feature flags (the Makefile's TEST_FEATURES). Every unit of the second (a package
with its features, its profile and, recursively, its dependencies' units)
must be a unit of the first. A unit that is not, but whose dependencies
all are, is where they part: the check names its package, its features and
the workspace's, for crates/feature-pins/Cargo.toml to ask for.

`--unit-graph` is unstable; RUSTC_BOOTSTRAP=1 lets this read-only query
run on the stable toolchain (it builds nothing). Prints
`check-feature-pins: OK (N units)`.
"""
import json
import sys

import cargo_units

PACKAGE = "dflash-broker"


def unit_graph(args):
    return cargo_units.unit_graph("check-feature-pins", args)["units"]


def signatures(units):
    """One hashable signature per unit: what cargo's artifact hash depends on."""
    memo = {}

    def signature(index):
        if index not in memo:
            unit = units[index]
            profile = {k: v for k, v in unit["profile"].items() if k != "name"}
            memo[index] = (
                unit["pkg_id"], unit["target"]["name"], tuple(unit["target"]["kind"]),
                unit["mode"], tuple(unit["features"]), json.dumps(profile, sort_keys=True),
                unit["platform"],
                tuple(sorted(signature(d["index"]) for d in unit["dependencies"])),
            )
        return memo[index]

    return [signature(index) for index in range(len(units))]


def package(unit):
    return unit["pkg_id"].rsplit("#", 1)[-1]


def main():
    workspace = unit_graph(["build", "--workspace", "--all-targets", *sys.argv[1:]])
    own = unit_graph(["test", "-p", PACKAGE, "--lib", "--no-run"])
    known = set(signatures(workspace))
    own_signatures = signatures(own)
    apart = [i for i, s in enumerate(own_signatures) if s not in known]
    roots = [i for i in apart
             if all(own_signatures[d["index"]] in known for d in own[i]["dependencies"])]
    for index in roots:
        unit = own[index]
        theirs = sorted({",".join(w["features"]) for w in workspace
                         if w["pkg_id"] == unit["pkg_id"] and w["mode"] == unit["mode"]})
        print(f"check-feature-pins: {package(unit)} ({unit['mode']}): `cargo test -p {PACKAGE}` "
              f"builds it with features [{','.join(unit['features'])}], the workspace's build "
              f"with {theirs or 'no such unit'}")
        for twin in (w for w in workspace if w["pkg_id"] == unit["pkg_id"]
                     and w["mode"] == unit["mode"] and w["features"] == unit["features"]):
            wanted = {package(workspace[d["index"]]): workspace[d["index"]]["features"]
                      for d in twin["dependencies"]}
            for d in unit["dependencies"]:
                dep = own[d["index"]]
                if wanted.get(package(dep), dep["features"]) != dep["features"]:
                    print(f"    its dependency {package(dep)}: features "
                          f"[{','.join(dep['features'])}], the workspace's "
                          f"[{','.join(wanted[package(dep)])}]")
    if apart:
        print(f"check-feature-pins: {len(apart)} unit(s) of `cargo test -p {PACKAGE}` would be "
              "compiled a second way: ask for the workspace's features in "
              "crates/feature-pins/Cargo.toml")
        return 1
    print(f"check-feature-pins: OK ({len(own)} units, all in the workspace's build)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
