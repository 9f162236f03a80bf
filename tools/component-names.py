#!/usr/bin/env python3
"""Fails when the core names a built-in component: a string literal in core/src that is the name of a
model, data set, loss, optimizer, schedule or plugin that trainkit's own libraries register, or holds
it quoted ("plugin 'ddp'"), or, for a name no English word can be (grad_accum, fashion-mnist), holds
it at all. What the core needs to know of a component it asks through the interfaces and traits the
component declares (tk/model.h, tk/components.h, OptionSpec, Registry::set_default), so that a
user's component is never second to a built-in one.

Usage: component-names.py TK_RUN SOURCE_DIR   (TK_RUN --list gives the names)
"""
import pathlib
import re
import subprocess
import sys

# Words that are component names and also something else the core means by them. Each is allowed only
# where listed, with what the core means there.
ALLOWED = {
    ("tokens", "loop/record.cpp"): "the metric key tokens (the tokens a run has seen), not the data set",
    ("tokens", "api/context.cpp"): "the reserved metric key tokens, not the data set",
}


def registered_names(tk_run):
    out = subprocess.run([tk_run, "--list"], check=True, capture_output=True, text=True).stdout
    return sorted(set(re.findall(r'^  name = "([^"]+)"', out, re.M)))


def literals(text):
    """The string literals of C++ source `text` (comments removed first), with their line numbers."""
    text = re.sub(r"//[^\n]*", lambda m: " " * len(m.group(0)), text)
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    for m in re.finditer(r'"((?:[^"\\\n]|\\.)*)"', text):
        yield text.count("\n", 0, m.start()) + 1, m.group(1)


def main():
    tk_run, root = sys.argv[1], pathlib.Path(sys.argv[2])
    names = registered_names(tk_run)
    if len(names) < 10:
        sys.exit(f"component-names: {tk_run} --list gave {len(names)} names ({names}); expected trainkit's own")
    core = root / "core" / "src"
    found = []
    for path in sorted(core.rglob("*")):
        if path.suffix not in (".cpp", ".h"):
            continue
        rel = path.relative_to(core).as_posix()
        for line, lit in literals(path.read_text()):
            for name in names:
                quoted = lit == name or f'\\"{name}\\"' in lit or f"'{name}'" in lit
                coined = re.search(r"[_-]", name) and re.search(r"(?<![\w-])" + re.escape(name) + r"(?![\w-])", lit)
                if not (quoted or coined):
                    continue
                if (name, rel) in ALLOWED:
                    continue
                found.append(f"core/src/{rel}:{line}: \"{lit[:80]}\" names the built-in component '{name}'")
    for f in found:
        print(f)
    if found:
        print(f"component-names: {len(found)} place(s) in core/src name a built-in component: ask the component "
              "through an interface or a trait it declares instead", file=sys.stderr)
        return 1
    print(f"component-names: core/src names none of the {len(names)} built-in components")
    return 0


if __name__ == "__main__":
    sys.exit(main())
