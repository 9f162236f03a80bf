#!/usr/bin/env python3
"""Says why each test that ctest skipped was skipped: its own last words, from ctest's log.

ctest prints a skipped test as "***Skipped" and nothing more; the reason (a missing tool, a CPU
that cannot run it) is in the test's output, which only Testing/Temporary/LastTest.log keeps.
    python3 tools/skip-reasons.py BUILD_DIR CTEST_OUTPUT
CTEST_OUTPUT is what ctest printed (the lines "N/M Test #K: NAME ...***Skipped" name the tests).
"""
import re
import sys


def skipped_names(ctest_output):
    names = []
    for line in open(ctest_output, errors="replace"):
        m = re.search(r"Test +#\d+: (\S+) \.*\*\*\*Skipped", line)
        if m:
            names.append(m.group(1))
    return names


def outputs(log):
    """Each test's output in LastTest.log, by name."""
    text = open(log, errors="replace").read()
    found = {}
    for m in re.finditer(r'^\d+/\d+ Test: (\S+)\n.*?^Output:\n-+\n(.*?)^<end of output>', text, re.M | re.S):
        found[m.group(1)] = m.group(2)
    return found


def main():
    build, ctest_output = sys.argv[1], sys.argv[2]
    names = skipped_names(ctest_output)
    if not names:
        return
    try:
        out = outputs(f"{build}/Testing/Temporary/LastTest.log")
    except OSError as e:
        print(f"skipped: {', '.join(names)} (no reasons: {e.strerror}: {e.filename})")
        return
    print(f"{len(names)} skipped, each with the reason it gave:")
    for name in names:
        lines = [l for l in out.get(name, "").splitlines() if l.strip()]
        # A line that says why ("skip ...", "SKIPPED: ...", "... cannot ..."), else the last one.
        why = [l for l in lines if re.search(r"\bskip|SKIPPED|cannot", l, re.I)] or lines[-1:] or ["(no output)"]
        print(f"  {name}: " + "\n    ".join(why[:3]))


if __name__ == "__main__":
    main()
