#!/usr/bin/env python3
"""Prints the filter crate's module graph: which module uses which.

    python3 scripts/module_graph.py [src]

A module is a file under src/ (folders are families: `shared::breaker`);
an edge is any `crate::a::b` path in non-test code. Pairs of modules that
use each other are listed last. An equivalent of `cargo modules dependencies`
without installing it.
"""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "src"


def module_of(path):
    rel = os.path.relpath(path, root)[: -len(".rs")]
    parts = rel.split(os.sep)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return "::".join(parts) or "crate"


files = {}
for dirpath, _, names in os.walk(root):
    for name in names:
        if name.endswith(".rs") and name != "tests.rs":
            files[module_of(os.path.join(dirpath, name))] = os.path.join(dirpath, name)


def resolve(path):
    """The longest known module a `crate::...` path names."""
    parts = path.split("::")
    while parts:
        candidate = "::".join(parts)
        if candidate in files:
            return candidate
        parts = parts[:-1]
    return None


edges = {}
for module, path in sorted(files.items()):
    text = open(path, encoding="utf-8").read()
    text = re.split(r"#\[cfg\(test\)\]\s*mod \w+ \{", text)[0]  # tests at the bottom
    text = re.sub(r"//.*", "", text)
    deps = set()
    # `crate::a::b`, `crate::a::{b, c}`, and `super::x` inside families.
    for m in re.finditer(r"crate::([a-z_]+(?:::[a-z_]+)*)(::\{([^}]*)\})?", text):
        base = m.group(1)
        if m.group(3):
            for item in m.group(3).split(","):
                item = item.strip().split("::")[0]
                target = resolve(f"{base}::{item}") if item else resolve(base)
                if target:
                    deps.add(target)
        elif (target := resolve(base)):
            deps.add(target)
    # `super::` in a family's member is the family (mod.rs) or a sibling.
    parent = module.rsplit("::", 1)[0] if "::" in module else None
    if parent and not path.endswith("mod.rs"):
        for m in re.finditer(r"\bsuper::([a-z_]+|\{|\*)", text):
            sibling = m.group(1)
            target = resolve(f"{parent}::{sibling}") if sibling[0].isalpha() else None
            deps.add(target or parent)
    deps.discard(module)
    deps.discard("crate")
    edges[module] = sorted(deps)

for module in sorted(edges):
    if module == "crate":
        continue
    print(f"{module} -> {', '.join(edges[module]) or '(nothing)'}")
cycles = sorted(
    {tuple(sorted((a, b))) for a, ds in edges.items() for b in ds if a in edges.get(b, [])}
)
print("\nmodules that use each other:", ", ".join(f"{a} <-> {b}" for a, b in cycles) or "none")
