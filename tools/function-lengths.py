#!/usr/bin/env python3
"""Lists the C++ functions of the given folders longer than a limit (80 lines by default), from
the first line of their signature to their closing brace; exits 1 when there is one.

    python3 tools/function-lengths.py [--max N] [--top K] DIR...

It reads the code as the compiler's lexer would for this purpose: comments, string and character
literals (raw strings included) and preprocessor lines are blanked first, then braces are matched.
A brace opens a function body when, at namespace or class scope, what precedes it since the last
`;`, `{` or `}` has a parameter list; a lambda or a block inside a function is part of that
function."""
import argparse
import pathlib
import re
import sys

KEYWORD_SCOPE = re.compile(r'\b(namespace|class|struct|union|enum)\b|extern\s+"C"')


def blank(text):
    """`text` with comments, literals and preprocessor lines replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if line_start and c == "#":  # a preprocessor line, with its continuations
            while i < n:
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                if text[i] == "\n":
                    break
                out.append(" ")
                i += 1
            continue
        line_start = False
        if text.startswith("//", i):
            while i < n and text[i] != "\n":
                out.append(" ")
                i += 1
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        m = re.match(r'R"([^(\s]*)\(', text[i:i + 20])
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = ")" + m.group(1) + '"'
            j = text.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j + 1, n) - i))
            i = j + 1
            continue
        if c == "\n":
            line_start = True
        out.append(c)
        i += 1
    return "".join(out)


def functions(path):
    """(name, first line, last line) of each function defined in `path`."""
    text = blank(path.read_text(encoding="utf-8", errors="replace"))
    stack = []  # "scope" (namespace, class, ...), "function", "block"
    found = []
    header_start = 0
    line = 1
    starts = []  # for each open function: (name, first line)
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
            continue
        in_function = "function" in stack
        if c == "{":
            header = text[header_start:i]
            if in_function:
                stack.append("block")
            elif header.count("(") > header.count(")"):
                stack.append("argument")  # a braced default argument: still in the signature
                continue
            else:
                if KEYWORD_SCOPE.search(header) and "(" not in header.split("{")[0].split(":")[0]:
                    stack.append("scope")
                elif ")" in header:
                    stack.append("function")
                    stripped = header.lstrip()
                    first = line - stripped.count("\n")
                    name = re.findall(r"([~\w:]+)\s*\(", header)
                    starts.append((name[0] if name else "?", first))
                else:
                    stack.append("block")
            header_start = i + 1
        elif c == "}":
            kind = stack.pop() if stack else "block"
            if kind == "argument":
                continue
            if kind == "function":
                name, first = starts.pop()
                found.append((name, first, line))
            if "function" not in stack:
                header_start = i + 1
        elif c == ";" and not in_function:
            header_start = i + 1
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--max", type=int, default=80, help="the longest a function may be, in lines")
    ap.add_argument("--top", type=int, default=0, help="also list the K longest functions")
    args = ap.parse_args()
    everything = []
    for d in args.dirs:
        for path in sorted(pathlib.Path(d).rglob("*")):
            if path.suffix in (".cpp", ".h", ".hpp", ".cc") and path.is_file():
                for name, first, last in functions(path):
                    everything.append((last - first + 1, str(path), first, name))
    everything.sort(reverse=True)
    for length, path, first, name in everything[: args.top]:
        print(f"{length:4d} lines  {path}:{first}  {name}")
    over = [f for f in everything if f[0] > args.max]
    for length, path, first, name in over:
        print(f"{path}:{first}: {name} is {length} lines, over the {args.max} allowed", file=sys.stderr)
    print(f"{len(everything)} functions in {', '.join(args.dirs)}; {len(over)} over {args.max} lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
