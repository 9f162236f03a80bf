#!/usr/bin/env python3
"""Checks that the engine's layers (core/src/<layer>/) are what core/CMakeLists.txt says they are,
from the files themselves; exits 1 naming each thing out of place.

    python3 tools/layers.py --root ROOT --layers L1 L2 ... [--max-lines N]

The layers are given bottom first (TK_CORE_LAYERS). It checks:
  - core/src holds one folder per layer and no other, each with at most one header, named after
    it (a layer whose sources implement installed headers alone needs none; core/src/pch.h, the
    precompiled header, aside);
  - every file of a layer includes, of the core's own headers, only its layer's and those of the
    layers before it (`#include "<layer>/<layer>.h"`), and the installed ones (`"tk/..."`); the
    testing library (core/testing/) stands above every layer;
  - every installed header tk/X.h that declares a function has a source X.cpp (in a layer, or
    core/testing/ for the testing library's);
  - no source or header of core/src or core/testing is longer than --max-lines (450);
  - docs/architecture.md names the layers in the same order.
"""
import argparse
import pathlib
import re
import sys

QUOTED = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# A function declared without a body: a parameter list closed by ");" (qualifiers allowed), not a
# pure virtual, defaulted or deleted one, not a call or a variable's initialiser inside a body.
DECLARATION = re.compile(
    r'^[ \t]*(?![ \t])(?!return\b|throw\b|delete\b|using\b|typedef\b|friend\b|static_assert\b|#|//|/\*|\*)'
    r'(?:\[\[[\w:]+\]\]\s*)?(?:(?:inline|static|virtual|explicit|constexpr|extern)\s+)*'
    r'[\w:<>,\s\*&~]*?\b[\w~]+\s*\([^;{}=]*\)\s*(?:const\s*)?(?:noexcept\s*)?;', re.M)


def strip_comments(text):
    text = re.sub(r'/\*.*?\*/', lambda m: re.sub(r'[^\n]', ' ', m.group(0)), text, flags=re.S)
    return re.sub(r'//[^\n]*', '', text)


def declares_functions(header):
    """Function declarations of `header` that need a definition out of line, as (line, text)."""
    text = strip_comments(header.read_text())
    found = []
    for m in DECLARATION.finditer(text):
        decl = m.group(0).strip()
        # A macro's line, a member that is a template or an expression statement is no declaration.
        if decl.endswith(')') or re.match(r'^[\w:]+\s*\(', decl) or '(*' in decl:
            continue
        found.append((text.count('\n', 0, m.start()) + 1, ' '.join(decl.split())))
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--root', required=True)
    ap.add_argument('--layers', nargs='+', required=True)
    ap.add_argument('--max-lines', type=int, default=450)
    a = ap.parse_args()
    root = pathlib.Path(a.root)
    src, public, testing = root / 'core/src', root / 'core/include/tk', root / 'core/testing'
    rank = {name: i for i, name in enumerate(a.layers)}
    problems = []

    folders = sorted(p.name for p in src.iterdir() if p.is_dir())
    for f in folders:
        if f not in rank:
            problems.append(f'core/src/{f}/ is no layer: add it to TK_CORE_LAYERS in core/CMakeLists.txt, in its place')
    for layer in a.layers:
        d = src / layer
        if not d.is_dir():
            problems.append(f'layer {layer} (TK_CORE_LAYERS) has no folder core/src/{layer}/')
            continue
        headers = sorted(p.name for p in d.glob('*.h'))
        if headers and headers != [f'{layer}.h']:
            problems.append(f'core/src/{layer}/ has the headers {headers}; a layer has at most one, {layer}.h')
    for p in src.iterdir():
        if p.is_file() and p.name != 'pch.h':
            problems.append(f'core/src/{p.name} belongs in a layer folder')

    files = sorted(src.glob('*/*.[ch]*')) + sorted(testing.glob('*.[ch]*'))
    for f in files:
        rel = f.relative_to(root)
        own = f.parent.name if f.parent.parent == src else None
        own_rank = rank.get(own, len(a.layers))  # the testing library stands above every layer
        text = f.read_text()
        for inc in QUOTED.findall(strip_comments(text)):
            if inc.startswith('tk/'):
                continue
            layer = inc.split('/')[0]
            if inc != f'{layer}/{layer}.h' or layer not in rank:
                problems.append(f'{rel} includes "{inc}": of the core, include "<layer>/<layer>.h" or "tk/..."')
            elif rank[layer] > own_rank:
                problems.append(f'{rel} includes "{inc}": layer {own} is below layer {layer} '
                                f'(order: {" < ".join(a.layers)})')
        lines = text.count('\n')
        if lines > a.max_lines:
            problems.append(f'{rel} has {lines} lines, more than {a.max_lines}: split it by what its parts do')

    sources = {p.stem for p in src.glob('*/*.cpp')} | {p.stem for p in testing.glob('*.cpp')}
    for h in sorted(public.glob('*.h')):
        if h.stem in sources:
            continue
        decls = declares_functions(h)
        if decls:
            line, decl = decls[0]
            problems.append(f'core/include/tk/{h.name}:{line} declares "{decl}" but no core/src/<layer>/{h.stem}.cpp '
                            f'implements the header')

    doc = root / 'docs/architecture.md'
    if doc.exists():
        named = []
        for m in re.finditer(r'^core/src/(\w+)/', doc.read_text(), re.M):  # the lines that open a layer
            if m.group(1) in rank and m.group(1) not in named:
                named.append(m.group(1))
        if named != a.layers:
            problems.append(f'docs/architecture.md names the layers in the order {named}, not {a.layers} '
                            f'(TK_CORE_LAYERS)')

    for p in problems:
        print(p)
    print(f'layers: {len(a.layers)} ({" < ".join(a.layers)}), {len(files)} files; '
          f'{len(problems)} problem{"" if len(problems) == 1 else "s"}')
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
