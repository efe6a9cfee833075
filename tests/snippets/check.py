#!/usr/bin/env python3
"""Every C++ block of README.md and docs/*.md must stand, line for line, in a file of
tests/snippets/, which Meson compiles (and runs where it can): the documentation's code is
code that builds. Indentation is not compared, so a block may sit inside a function there."""
import pathlib
import sys


def blocks(markdown):
    lines = markdown.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() in ("```cpp", "```c++"):
            start = i + 1
            end = start
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            yield start + 1, [line.strip() for line in lines[start:end]]
            i = end
        i += 1


def contains(haystack, needle):
    n = len(needle)
    return any(haystack[k:k + n] == needle for k in range(len(haystack) - n + 1))


def main(root):
    root = pathlib.Path(root)
    sources = {p: [line.strip() for line in p.read_text().splitlines()]
               for p in sorted((root / "tests" / "snippets").glob("*.cpp"))}
    docs = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    found, missing = 0, []
    for doc in docs:
        for line, block in blocks(doc):
            if any(contains(text, block) for text in sources.values()):
                found += 1
            else:
                missing.append(f"{doc.relative_to(root)}:{line}")
    for where in missing:
        print(f"{where}: this C++ block is in no file of tests/snippets/ (so nothing compiles it)")
    print(f"{found} C++ blocks compiled by tests/snippets/, {len(missing)} not")
    return 1 if missing or found == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
