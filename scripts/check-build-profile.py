#!/usr/bin/env python3
"""The test build optimises what the tests run, and only that (#51).

Cargo.toml's dev profile compiles the dependencies at opt-level 2 (tests of
real payload sizes run at a sensible speed) through `[profile.dev.package."*"]`,
which wins over `build-override`. So the dependencies that run only while
building (proc macros, build scripts and what they use: syn, serde_derive,
prost-build, cc...) are listed by name at opt-level 0. This reads cargo's unit
graph of the test build, without building anything (its arguments are the
Makefile's TEST_FEATURES), and fails naming:

  - a package all of whose units run only while building (reached from the
    workspace only through a proc macro or a build script) that is
    compiled optimised: it belongs in Cargo.toml's `[profile.dev.package]`
    list;
  - a package the tests run (reached from the workspace through normal
    dependencies) that is compiled unoptimised: it was listed, and is now
    also a dependency of the code under test, so it must come off the list.

The graph comes from scripts/cargo_units.py. Prints `check-build-profile: OK (N build-time
packages unoptimised, M run-time units optimised)`.
"""
import sys

import cargo_units


def name(unit):
    return unit["pkg_id"].rsplit("#", 1)[-1].split("@")[0]


def is_ours(unit):
    return unit["pkg_id"].startswith("path+")


def main():
    graph = cargo_units.unit_graph(
        "check-build-profile", ["build", "--workspace", "--all-targets", *sys.argv[1:]])
    units = graph["units"]
    run_time = set()
    stack = list(graph["roots"])
    while stack:
        index = stack.pop()
        if index in run_time:
            continue
        run_time.add(index)
        for dependency in units[index]["dependencies"]:
            kinds = units[dependency["index"]]["target"]["kind"]
            if "proc-macro" in kinds or "custom-build" in kinds:
                continue
            stack.append(dependency["index"])
    run_time_names = {name(units[i]) for i in run_time}
    problems = []
    build_time = set()
    for index, unit in enumerate(units):
        if is_ours(unit):
            continue
        level = unit["profile"]["opt_level"]
        if index in run_time and level == "0":
            problems.append(
                f"{name(unit)} runs in the tests but is compiled at opt-level 0: take it off "
                "Cargo.toml's [profile.dev.package] list of build-time dependencies")
        elif name(unit) not in run_time_names:
            build_time.add(name(unit))
            if level != "0":
                problems.append(
                    f"{name(unit)} runs only while building but is compiled at opt-level {level}: "
                    f"add `{name(unit)} = {{ opt-level = 0 }}` to Cargo.toml's "
                    "[profile.dev.package]")
    for problem in sorted(set(problems)):
        print(f"check-build-profile: {problem}")
    if problems:
        sys.exit(1)
    optimised = sum(1 for i in run_time if not is_ours(units[i]))
    print(f"check-build-profile: OK ({len(build_time)} build-time packages unoptimised, "
          f"{optimised} run-time units optimised)")


if __name__ == "__main__":
    main()
