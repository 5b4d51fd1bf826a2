#!/usr/bin/env python3
"""Fails when the modules of a Rust crate in this workspace import each other in a circle.

Usage: python3 scripts/check-module-cycles.py [--graph] [crate_dir ...]

For every crate target (`src/lib.rs`, `src/main.rs`, `src/bin/*.rs`, and each
file of `tests/`, `benches/` and `examples/` that is its own crate) it builds
the module tree from the `mod` declarations and an edge A -> B whenever module
A names an item of module B: `use crate::…`, `use super::…`, `use self::…`,
`use child::…` and paths written inline in code (`crate::x::y`,
`super::Type`). A path is resolved to the module that *defines* the item:
imports and re-exports (`use`, `pub use`, globs) are followed, so a `mod.rs`
that re-exports a child's type and a sibling that imports it through the
parent is an edge to the child, not to the parent. Declaring a module
(`mod x;`) is not an edge. Test modules (`#[cfg(test)]`) are left out: they
depend on what they test by design and nothing depends on them.

A cycle is a strongly connected component of two or more modules; each is
printed with one file:line per edge, and the exit status is 1.

Folders too: among the children of each module, child A depends on child B
when any module inside A (A itself or below) names any module inside B. A
circle there (`config/` needs `model_sync/` and `model_sync/config.rs` needs
`config::error`) is a cycle between the folders even when no two single
modules form one, and is reported the same way. This is a
lexical analysis (no macro expansion, no type inference): a path built by a
macro is not seen. That is the price of a check that runs in a second without
compiling anything; `cargo-modules` would see more but needs rust-analyzer's
crates built (about 15 minutes on the 2-core CI machine).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {"target", ".cache", ".git", "fuzz", "runs", "node_modules"}


@dataclass
class Module:
    path: tuple[str, ...]
    file: str
    children: dict[str, "Module"] = field(default_factory=dict)
    # name -> (path segments as written, line) of every name a `use` brings in
    reexports: dict[str, tuple[list[str], int]] = field(default_factory=dict)
    globs: list[tuple[list[str], int]] = field(default_factory=list)
    # (segments, line) of every path this module names
    refs: list[tuple[list[str], int]] = field(default_factory=list)
    parent: "Module | None" = None


def strip_comments_and_strings(text: str) -> str:
    """Blank out comments and string/char literals, keeping line numbers."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            end = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j + 1]))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]):
            m = re.match(r"'(\\.|[^\\'])'", text[i:i + 4])
            out.append(" " * len(m.group(0)))
            i += len(m.group(0))
        elif c == "'" and re.match(r"'\\u\{[0-9a-fA-F]+\}'", text[i:i + 12]):
            m = re.match(r"'\\u\{[0-9a-fA-F]+\}'", text[i:i + 12])
            out.append(" " * len(m.group(0)))
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def block_end(text: str, open_brace: int) -> int:
    """The index of the `}` that closes the `{` at `open_brace` (the text's end if none)."""
    depth = 0
    for k in range(open_brace, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(text)


def remove_cfg_test_items(text: str) -> str:
    """Blank out items under `#[cfg(test)]` (a `mod x;` line or a braced block)."""
    out = list(text)
    for m in re.finditer(r"#\[cfg\((?:test|all\([^\]]*\btest\b[^\]]*\))\)\]", text):
        j = m.end()
        # the item: up to `;` or the matching `}` of the first `{`
        k = j
        while k < len(text) and text[k] not in ";{":
            k += 1
        if k >= len(text):
            continue
        if text[k] == "{":
            k = block_end(text, k)
        for p in range(m.start(), min(k + 1, len(text))):
            if out[p] != "\n":
                out[p] = " "
    return "".join(out)


INLINE_MOD_RE = re.compile(r"\bmod\s+[A-Za-z_][A-Za-z0-9_]*\s*\{")


def inline_module_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every inline `mod name { ... }` block."""
    return [(m.start(), block_end(text, m.end() - 1)) for m in INLINE_MOD_RE.finditer(text)]


def strip_inline_supers(segs: list[str], pos: int, spans: list[tuple[int, int]]) -> list[str] | None:
    """Inside an inline module, its own `super`s lead back to the file's module."""
    depth = sum(1 for a, b in spans if a <= pos <= b)
    while depth and segs and segs[0] in ("super", "self"):
        if segs[0] == "super":
            depth -= 1
        segs = segs[1:]
    if not segs:
        return None
    if depth and segs[0] not in ("crate", "super", "self"):
        return None  # a path relative to the inline module: its own items
    return segs


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def expand_use_tree(tree: str) -> list[tuple[list[str], str | None]]:
    """`a::{b, c::d as e, f::*}` -> [([a,b],b), ([a,c,d],e), ([a,f,*],None)]."""
    tree = re.sub(r"\s+", " ", tree).strip()
    tree = re.sub(r"\s*(::|\{|\}|,)\s*", r"\1", tree)
    results: list[tuple[list[str], str | None]] = []

    def split_top(s: str) -> list[str]:
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        if cur:
            parts.append(cur)
        return parts

    def walk(prefix: list[str], s: str) -> None:
        if not s:
            return
        brace = s.find("{")
        if brace >= 0 and s.endswith("}"):
            head = s[:brace].rstrip(":")
            segs = prefix + [x for x in head.split("::") if x]
            for part in split_top(s[brace + 1:-1]):
                walk(segs, part)
            return
        alias = None
        body = s
        m = re.fullmatch(r"(.*) as ([A-Za-z_][A-Za-z0-9_]*)", s)
        if m:
            body, alias = m.group(1), m.group(2)
        segs = prefix + [x for x in body.split("::") if x]
        if segs and segs[-1] == "self":
            segs = segs[:-1]
            name = alias or (segs[-1] if segs else None)
        else:
            name = alias or (segs[-1] if segs and segs[-1] != "*" else None)
        results.append((segs, name))

    walk([], tree)
    return results


USE_RE = re.compile(r"(?P<vis>\bpub(?:\s*\([^)]*\))?\s+)?\buse\s+(?P<tree>[^;]+);")
PATH_RE = re.compile(r"(?<![A-Za-z0-9_:])((?:crate|super|self)(?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)+)")
MOD_RE = re.compile(r"^\s*(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;", re.M)
PATH_ATTR_RE = re.compile(r"#\[path\s*=\s*\"([^\"]+)\"\]\s*(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;")


def load_module(path: tuple[str, ...], file: str, parent: Module | None, is_root: bool) -> Module:
    module = Module(path=path, file=file, parent=parent)
    with open(file, encoding="utf-8") as f:
        raw = f.read()
    path_attrs = {m.group(2): m.group(1) for m in PATH_ATTR_RE.finditer(raw)}
    text = remove_cfg_test_items(strip_comments_and_strings(raw))
    directory = os.path.dirname(file)
    stem = os.path.splitext(os.path.basename(file))[0]
    child_dir = directory if is_root or stem == "mod" else os.path.join(directory, stem)
    for m in MOD_RE.finditer(text):
        name = m.group(1)
        if name in path_attrs:
            candidates = [os.path.join(directory, path_attrs[name])]
        else:
            candidates = [os.path.join(child_dir, name + ".rs"), os.path.join(child_dir, name, "mod.rs")]
        for c in candidates:
            if os.path.isfile(c):
                module.children[name] = load_module(path + (name,), c, module, False)
                break
    spans = inline_module_spans(text)
    for m in USE_RE.finditer(text):
        line = line_of(text, m.start())
        for segs, name in expand_use_tree(m.group("tree")):
            segs = strip_inline_supers(segs, m.start(), spans) if segs else None
            if not segs:
                continue
            module.refs.append((segs if segs[-1] != "*" else segs[:-1], line))
            # A name a module imports, public or not, is what a child's
            # `super::name` reaches: resolve through it either way.
            if segs[-1] == "*":
                module.globs.append((segs[:-1], line))
            elif name:
                module.reexports[name] = (segs, line)
    use_spans = [(m.start(), m.end()) for m in USE_RE.finditer(text)]
    for m in PATH_RE.finditer(text):
        if any(a <= m.start() < b for a, b in use_spans):
            continue
        segs = strip_inline_supers([s.strip() for s in m.group(1).split("::")], m.start(), spans)
        if not segs:
            continue
        module.refs.append((segs, line_of(text, m.start())))
    return module


def all_modules(root: Module):
    yield root
    for child in root.children.values():
        yield from all_modules(child)


def resolve(start: Module, segs: list[str], root: Module, depth: int = 0) -> Module | None:
    """The module defining the item `segs` names, seen from `start`; None if outside the crate."""
    if depth > 16 or not segs:
        return None
    cur: Module | None
    i = 0
    if segs[0] == "crate":
        cur, i = root, 1
    elif segs[0] in ("super", "self"):
        cur = start
        while i < len(segs) and segs[i] in ("super", "self"):
            if segs[i] == "super":
                cur = cur.parent if cur else None
            i += 1
        if cur is None:
            return None
    elif segs[0] in start.children:
        cur = start
    else:
        return None  # an external crate, std, or a local item
    while i < len(segs):
        name = segs[i]
        if name in cur.children:
            cur = cur.children[name]
            i += 1
            continue
        if name in cur.reexports:
            target, _ = cur.reexports[name]
            if target[-1] == name and target[0] not in ("crate", "super", "self") and target[0] not in cur.children:
                return cur  # re-export of an external item: defined here as far as the crate goes
            found = resolve(cur, target + segs[i + 1:], root, depth + 1)
            return found or cur
        for glob, _ in cur.globs:
            found = resolve(cur, glob + segs[i:], root, depth + 1)
            if found is not None and found is not cur:
                return found
        return cur
    return cur


def tarjan(nodes, edges):
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            strong(v)
    return out


def crate_roots(crate_dir: str) -> list[str]:
    roots = []
    src = os.path.join(crate_dir, "src")
    for name in ("lib.rs", "main.rs"):
        p = os.path.join(src, name)
        if os.path.isfile(p):
            roots.append(p)
    for sub in ("src/bin", "tests", "benches", "examples"):
        d = os.path.join(crate_dir, sub)
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            p = os.path.join(d, name)
            if name.endswith(".rs"):
                roots.append(p)
            elif os.path.isfile(os.path.join(p, "main.rs")):
                roots.append(os.path.join(p, "main.rs"))
    return roots


def find_crates() -> list[str]:
    crates = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        if "Cargo.toml" in filenames and (os.path.isdir(os.path.join(dirpath, "src")) or os.path.isdir(os.path.join(dirpath, "tests"))):
            crates.append(dirpath)
    return sorted(crates)


def check_root(root_file: str, show_graph: bool) -> list[str]:
    root = load_module(("crate",), root_file, None, True)
    edges: dict[tuple, dict[tuple, tuple[str, int]]] = {}
    modules = list(all_modules(root))
    for m in modules:
        for segs, line in m.refs:
            target = resolve(m, segs, root)
            if target is None or target is m:
                continue
            edges.setdefault(m.path, {}).setdefault(target.path, (m.file, line))
    if show_graph:
        rel = os.path.relpath(root_file, ROOT)
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f"{rel}: {'::'.join(a)} -> {'::'.join(b)}")
    problems = folder_cycles(root_file, modules, edges)
    for comp in tarjan([m.path for m in modules], edges):
        if len(comp) < 2:
            continue
        members = set(comp)
        lines = [f"cycle in {os.path.relpath(root_file, ROOT)}: " + ", ".join(sorted("::".join(p) for p in comp))]
        for a in sorted(comp):
            for b, (file, line) in sorted(edges.get(a, {}).items()):
                if b in members:
                    lines.append(f"  {'::'.join(a)} -> {'::'.join(b)}  ({os.path.relpath(file, ROOT)}:{line})")
        problems.append("\n".join(lines))
    return problems


def folder_cycles(root_file: str, modules: list[Module], edges) -> list[str]:
    """Circles among the children of each module, a child standing for its
    whole subtree (see the module doc)."""
    problems = []
    rel = os.path.relpath(root_file, ROOT)
    for parent in modules:
        if len(parent.children) < 2:
            continue
        depth = len(parent.path)
        children = {child.path for child in parent.children.values()}

        def child_of(path: tuple) -> tuple | None:
            if len(path) <= depth or path[:depth] != parent.path:
                return None
            head = path[: depth + 1]
            return head if head in children else None

        folder_edges: dict[tuple, dict[tuple, tuple[str, int]]] = {}
        for a, targets in edges.items():
            source = child_of(a)
            if source is None:
                continue
            for b, where in targets.items():
                target = child_of(b)
                if target is None or target == source:
                    continue
                folder_edges.setdefault(source, {}).setdefault(target, (where[0], where[1], a, b))
        for comp in tarjan(sorted(children), folder_edges):
            if len(comp) < 2:
                continue
            members = set(comp)
            lines = [f"folder cycle in {rel}: " + ", ".join(sorted("::".join(p) for p in comp))]
            for a in sorted(comp):
                for b, (file, line, inner_a, inner_b) in sorted(folder_edges.get(a, {}).items()):
                    if b in members:
                        lines.append(
                            f"  {'::'.join(a)} -> {'::'.join(b)}: {'::'.join(inner_a)} -> {'::'.join(inner_b)}"
                            f"  ({os.path.relpath(file, ROOT)}:{line})"
                        )
            problems.append("\n".join(lines))
    return problems


def main(argv: list[str]) -> int:
    show_graph = "--graph" in argv
    dirs = [a for a in argv if not a.startswith("--")]
    crates = [os.path.abspath(d) for d in dirs] if dirs else find_crates()
    problems, roots = [], 0
    for crate in crates:
        for root_file in crate_roots(crate):
            roots += 1
            problems.extend(check_root(root_file, show_graph))
    for p in problems:
        print(p)
    print(f"module cycles: {len(problems)} in {roots} crate targets of {len(crates)} packages")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
