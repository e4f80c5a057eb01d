#!/usr/bin/env python3
"""Fails when the files of a crate import each other in a circle.

Each file under crates/*/src is a module; `crate::a::b`, `super::x` and `self::x` paths name
the modules they reach (the longest prefix that is a file). A cycle of two or more modules is
an error unless every module in it lies under one parent module whose file says, in a comment
near its top, `Cycles on purpose:` and why (a subsystem whose parts are one unit).
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates")
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
GROUP = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*?)\}", re.S)
MARK = "Cycles on purpose:"


def modules(src):
    """Maps a module path (tuple) to its file."""
    out = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src)[:-3].split(os.sep)
            if rel[-1] in ("lib", "main") and len(rel) == 1:
                rel = []
            elif rel[-1] == "mod":
                rel = rel[:-1]
            if "bin" in rel[:1]:
                continue
            out[tuple(rel)] = os.path.join(dirpath, f)
    return out


def strip_comments(text):
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def cfg_test_free(text):
    """Drops `#[cfg(test)] mod tests { ... }` bodies: tests may reach anything."""
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub\s+)?mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def resolve(mods, here, is_dir_module, kind, parts):
    if kind == "crate":
        base = []
    elif kind == "self":
        base = list(here) if is_dir_module else list(here)
    else:  # super
        base = list(here[:-1])
    parts = list(parts)
    while parts and parts[0] == "super":
        base = base[:-1]
        parts = parts[1:]
    full = base + parts
    for n in range(len(full), 0, -1):
        if tuple(full[:n]) in mods:
            return tuple(full[:n])
    return None


def edges(mods):
    graph = {m: set() for m in mods}
    for here, path in mods.items():
        text = cfg_test_free(strip_comments(open(path, encoding="utf-8").read()))
        is_dir = path.endswith("mod.rs") or path.endswith("lib.rs") or path.endswith("main.rs")
        # `self::` in a file module a.rs names a's children too, same as in a/mod.rs.
        refs = []
        for m in GROUP.finditer(text):
            for item in re.split(r"[,\s]+", m.group(3)):
                item = item.split("::")[0].strip("{} ")
                if item and item != "self":
                    refs.append((m.group(1), [p for p in m.group(2).split("::") if p] + [item]))
        for m in PATH.finditer(text):
            refs.append((m.group(1), [p for p in m.group(2).split("::") if p]))
        # `child::x` where `mod child;` is declared here (a path relative to this module)
        for child in re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text, re.M):
            if re.search(r"(?<![:\w])" + child + r"::", text):
                target = tuple(here) + (child,)
                if target in mods:
                    graph[here].add(target)
        for kind, parts in refs:
            target = resolve(mods, here, is_dir, kind, parts)
            if target is not None and target != here and target != here[: len(target)]:
                # a module using its own ancestors' items is not a file cycle unless the ancestor
                # also uses it back; count the edge, the SCC decides
                graph[here].add(target)
            elif target is not None and target != here:
                graph[here].add(target)
    return graph


def sccs(graph):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
    for v in graph:
        if v not in index:
            visit(v)
    return out


def allowed(mods, comp):
    common = list(comp[0])
    for m in comp[1:]:
        k = 0
        while k < min(len(common), len(m)) and common[k] == m[k]:
            k += 1
        common = common[:k]
    for n in range(len(common), -1, -1):
        parent = tuple(common[:n])
        if parent in mods and parent not in comp or (parent in mods and len(parent) == len(common)):
            head = open(mods[parent], encoding="utf-8").read(4000)
            if MARK in head and parent != ():
                return True
    return False


def self_test():
    """The check finds a planted cycle, and accepts it once its parent is marked."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "demo", "src")
        os.makedirs(os.path.join(src, "sub"))
        files = {
            "lib.rs": "mod a;\nmod b;\nmod sub;\n",
            "a.rs": "use crate::b::B;\npub struct A;\n",
            "b.rs": "// crate::a in a comment is no edge\nuse super::a::A;\npub struct B;\n",
            "sub/mod.rs": "mod x;\npub use x::X;\npub struct S;\n",
            "sub/x.rs": "use super::S;\npub struct X;\n",
        }
        for name, text in files.items():
            with open(os.path.join(src, name), "w", encoding="utf-8") as f:
                f.write(text)
        found = check(d, quiet=True)
        assert found == [["a", "b"], ["sub", "sub::x"]], found
        with open(os.path.join(src, "sub/mod.rs"), "a", encoding="utf-8") as f:
            f.write("//! Cycles on purpose: one unit.\n")
        found = check(d, quiet=True)
        assert found == [["a", "b"]], found
    return 0


def check(root, quiet=False):
    found = []
    for crate in sorted(os.listdir(root)):
        src = os.path.join(root, crate, "src")
        if not os.path.isdir(src):
            continue
        mods = modules(src)
        # the crate root re-exports and declares modules; edges into it are not file cycles
        graph = edges(mods)
        for v in graph:
            graph[v].discard(())
        graph.pop((), None)
        for comp in sccs(graph):
            if len(comp) > 1 and not allowed(mods, comp):
                names = sorted("::".join(m) for m in comp)
                found.append(names)
                if not quiet:
                    print(f"{crate}: modules import each other in a circle: {', '.join(names)}")
    return sorted(found)


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    bad = check(ROOT)
    if bad:
        print(f"{len(bad)} cycle(s); break them, or mark the parent module `{MARK} <why>`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
