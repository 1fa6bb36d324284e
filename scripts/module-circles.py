#!/usr/bin/env python3
"""List circles in the tree's shape, and exit 1 if there is one.

- Between modules of one crate: sibling modules that reference each other,
  directly or around a loop (`crate::a` in b and `crate::b` in a). A
  reference between two modules counts as one between their ancestors just
  below the deepest module holding both, so `a::x` using `b::y` is `a -> b`.
  Test code inside a file (after `#[cfg(test)]`) is left out; test modules
  in files of their own count.
- Between the two daemons: neither `memory-donor` nor `inference-node` may
  depend on the other (`cargo metadata`).

Run from the repository root: `python3 scripts/module-circles.py`.
"""
import collections
import json
import os
import re
import subprocess
import sys

REF = re.compile(r'\b(crate|super|self)((?:::\w+)+)')
GROUP = re.compile(r'\buse\s+(crate|super|self)::\{([^;]*)\};', re.S)


def modules(src):
    """Module path (a tuple) -> file, for every .rs file under src."""
    found = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith('.rs'):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, src)[:-3].split(os.sep)
            if rel[-1] == 'mod':
                rel = rel[:-1]
            if rel in (['lib'], ['main']):
                rel = []
            found[tuple(rel)] = path
    return found


def resolve(base, segs, mod, known):
    """The deepest known module a path starting at base names."""
    segs = [s for s in segs if s]
    cur = [] if base == 'crate' else list(mod)
    if base == 'super':
        cur = cur[:-1]
        while segs and segs[0] == 'super':
            segs = segs[1:]
            cur = cur[:-1]
    best = tuple(cur)
    for s in segs:
        cur.append(s)
        if tuple(cur) not in known:
            break
        best = tuple(cur)
    return best


def references(path, mod, known):
    text = re.sub(r'//[^\n]*', '', open(path, encoding='utf-8').read())
    cut = text.find('#[cfg(test)]')
    if cut >= 0:
        text = text[:cut]
    out = set()
    for m in GROUP.finditer(text):
        for part in re.split(r'[,\s]+', m.group(2)):
            part = part.strip('{} ')
            if part:
                out.add(resolve(m.group(1), [''] + part.split('::'), mod, known))
    for m in REF.finditer(text):
        out.add(resolve(m.group(1), m.group(2).split('::'), mod, known))
    return out


def circles(src):
    known = modules(src)
    edges = collections.defaultdict(set)
    for mod, path in known.items():
        for target in references(path, mod, known):
            k = 0
            while k < len(mod) and k < len(target) and mod[k] == target[k]:
                k += 1
            if k < len(mod) and k < len(target):
                edges[mod[:k + 1]].add(target[:k + 1])
    # Tarjan's strongly connected components.
    index, low, stack, on, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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
            if len(comp) > 1:
                found.append(sorted('::'.join(x) for x in comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def main():
    meta = json.loads(subprocess.check_output(
        ['cargo', 'metadata', '--format-version', '1', '--no-deps']))
    bad = 0
    names = {p['name'] for p in meta['packages']}
    for p in meta['packages']:
        src = os.path.join(os.path.dirname(p['manifest_path']), 'src')
        for comp in circles(src):
            print(f"{p['name']}: modules in a circle: {' <-> '.join(comp)}")
            bad += 1
        deps = {d['name'] for d in p['dependencies'] if d['name'] in names}
        daemons = {'memory-donor': 'inference-node', 'inference-node': 'memory-donor'}
        if p['name'] in daemons and daemons[p['name']] in deps:
            print(f"{p['name']} depends on {daemons[p['name']]}: the daemons must share libraries, not each other")
            bad += 1
    if bad:
        sys.exit(1)
    print(f"no circles in {len(meta['packages'])} crates, no arrow between the daemons")


if __name__ == '__main__':
    main()
