#!/usr/bin/env python3
"""Checks that the engine's layers (core/src/<layer>/) are what core/CMakeLists.txt says they are,
from the files themselves; exits 1 naming each thing out of place.

    python3 tools/layers.py --root ROOT --layers L1 L2 ... --audiences A1 A2 ... [--max-lines N]

The layers are given bottom first (TK_CORE_LAYERS). It checks:
  - core/src holds one folder per layer and no other, each with at most one header, named after
    it (a layer whose sources implement installed headers alone needs none; core/src/pch.h, the
    precompiled header, aside);
  - every file of a layer includes, of the core's own headers, only its layer's and those of the
    layers before it (`#include "<layer>/<layer>.h"`), and the installed ones (`"tk/..."`); the
    testing library (core/testing/) stands above every layer;
  - the installed headers lie in core/include/<audience>/tk/, one folder per audience given
    (--audiences, lowest first: sdk, embed, testing), a name in one audience only; a header includes
    of the installed ones only those of its audience and the audiences before it, and never a
    private one (core/private/tk/); the plugins (plugins/, examples/*/src/) include only the first
    audience's (the SDK) and, in this tree's own plugins only, the private ones;
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
INSTALLED = re.compile(r'^\s*#\s*include\s+[<"](tk/[\w.]+)[>"]', re.M)
GENERATED = {'tk/version.h': 'version.h.in'}  # configured into the build, from the SDK's folder
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


def audience_problems(root, audiences):
    """The installed headers by audience (name -> audience), and what is out of place in them and
    in the plugins' includes."""
    problems, audience_of = [], {}
    include = root / 'core/include'
    for d in sorted(include.iterdir()):
        if d.name not in audiences:
            problems.append(f'core/include/{d.name} is no audience: the installed headers lie in '
                            f'core/include/<{"|".join(audiences)}>/tk/ (TK_HEADER_AUDIENCES)')
    for a in audiences:
        for h in sorted((include / a / 'tk').glob('*.h*')):
            name = 'tk/' + h.name.removesuffix('.in')
            if name in audience_of:
                problems.append(f'{name} is in two audiences: {audience_of[name]} and {a}')
            audience_of[name] = a
    private = {'tk/' + h.name for h in (root / 'core/private/tk').glob('*.h')}
    rank = {a: i for i, a in enumerate(audiences)}
    for name, a in sorted(audience_of.items()):
        header = include / a / name if name not in GENERATED else include / a / 'tk' / GENERATED[name]
        for inc in INSTALLED.findall(strip_comments(header.read_text())):
            where = f'core/include/{a}/{name}'
            if inc in private:
                problems.append(f'{where} includes the private {inc}: an installed header cannot')
            elif inc not in audience_of:
                problems.append(f'{where} includes {inc}, which is not installed')
            elif rank[audience_of[inc]] > rank[a]:
                problems.append(f'{where} includes {inc} of the {audience_of[inc]} audience: '
                                f'a {a} header includes only {", ".join(audiences[:rank[a] + 1])} ones')
    plugin_files = [(f, True) for f in sorted((root / 'plugins').rglob('*.[ch]*'))]
    plugin_files += [(f, False) for f in sorted(root.glob('examples/*/src/*.[ch]*'))]
    for f, in_tree in plugin_files:
        for inc in INSTALLED.findall(strip_comments(f.read_text())):
            if inc in private and in_tree:
                continue
            if audience_of.get(inc) != audiences[0]:
                kind = 'private' if inc in private else audience_of.get(inc, 'no installed')
                problems.append(f'{f.relative_to(root)} includes {inc} ({kind} header): '
                                f'a plugin includes only {audiences[0]} headers')
    return audience_of, problems


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--root', required=True)
    ap.add_argument('--layers', nargs='+', required=True)
    ap.add_argument('--audiences', nargs='+', default=['sdk', 'embed', 'testing'])
    ap.add_argument('--max-lines', type=int, default=450)
    a = ap.parse_args()
    root = pathlib.Path(a.root)
    src, testing = root / 'core/src', root / 'core/testing'
    rank = {name: i for i, name in enumerate(a.layers)}
    audience_of, problems = audience_problems(root, a.audiences)

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
    for name, audience in sorted(audience_of.items()):
        h = root / 'core/include' / audience / name
        if h.stem in sources or name in GENERATED:
            continue
        decls = declares_functions(h)
        if decls:
            line, decl = decls[0]
            problems.append(f'core/include/{audience}/{name}:{line} declares "{decl}" but no '
                            f'core/src/<layer>/{h.stem}.cpp implements the header')

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
    counts = ', '.join(f'{sum(1 for v in audience_of.values() if v == x)} {x}' for x in a.audiences)
    print(f'installed headers: {counts}')
    print(f'layers: {len(a.layers)} ({" < ".join(a.layers)}), {len(files)} files; '
          f'{len(problems)} problem{"" if len(problems) == 1 else "s"}')
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
