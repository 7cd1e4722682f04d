#!/usr/bin/env python3
"""docs/architecture.md's include table, checked against the tree (issue #30, item 4).

The table under "## Folders, and what each may include" has a row per folder (or per file, such
as `worker/main.cc`); its last column names, in backticks, the rows that folder may include, and
in plain words the external libraries (not checked here). This test reads every .h, .cc, .cu and
.cuh file of the repository and fails on:

  * an `#include` of a project path that the including row's last column does not allow;
  * a cycle between rows, in the includes the tree has or in the ones the table allows;
  * a source file, or an included project path, that no row covers;
  * a table that cannot be read: no section, no table, a backticked name in the last column
    that is no row, a row whose folder does not exist.

The rules, strictly:

  * A file belongs to the row of the longest folder (or the exact file) that has a row. Rows are
    not nested: `common/` does not cover `common/proto/`, which has its own row, and naming
    `common/` in a last column allows `common/`'s own files only.
  * A row may always include itself (`kernels/cpu/`, `kernels/cuda/` is one row).
  * "all of `X/`" allows every row under X/; "anything" allows every row.
  * Text in parentheses is a note: `worker/engine/` (model, optimizer options) allows all of
    `worker/engine/`.
  * A project path is an include whose first folder is a top-level folder of the repository;
    the generated `lathe/v1/*.pb.h` are the files of `proto/lathe/v1/`.
  * Skipped: hidden folders, `build`, `build-*` and any folder holding a CMakeCache.txt.

Run by ctest (label unit); `include_table_test.py --report [ROOT]` prints the row graph.
"""

import os
import re
import shutil
import sys
import tempfile
import unittest

SECTION = "## Folders, and what each may include"
SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh")
ANYTHING = "anything"
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*(?:"([^"]+)"|<([^>]+)>)', re.MULTILINE)
# The generated API headers: "lathe/v1/job.pb.h" is proto/lathe/v1/job.proto's.
GENERATED_PREFIXES = {"lathe/": "proto/lathe/"}

# Layering violations the tree has today, which the table does not allow and should not: each
# is (file, included path). The test fails on any other, and on an entry the tree no longer has
# (remove it then); the list only shrinks.
KNOWN_VIOLATIONS = {
    ("kernels/cuda/linear_cross_entropy.cc", "common/status_macros.h"):
        "the raw kernels include no project folder but kernels/, and lathe_kernels_cuda does "
        "not link lathe_common",
}


class TableError(Exception):
    pass


class Row:
    def __init__(self, line_no, keys, may_include_text):
        self.line_no = line_no
        self.keys = keys  # "common/proto/" or "worker/main.cc"
        self.may_include_text = may_include_text
        self.allowed = set()  # names of rows
        self.anything = False

    @property
    def name(self):
        return ", ".join("`%s`" % k for k in self.keys)


def _cells(line):
    line = line.strip()
    if not line.startswith("|"):
        return None
    # Split on pipes outside backticks.
    cells, cur, in_code = [], [], False
    for ch in line.strip("|"):
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    cells.append("".join(cur).strip())
    return cells


def _strip_notes(text):
    prev = None
    while prev != text:
        prev, text = text, re.sub(r"\([^()]*\)", "", text)
    return text


def parse_table(markdown, doc_name="docs/architecture.md"):
    """Returns the rows of the include table; raises TableError."""
    lines = markdown.splitlines()
    try:
        start = next(i for i, l in enumerate(lines) if l.strip() == SECTION)
    except StopIteration:
        raise TableError('%s has no section "%s"' % (doc_name, SECTION))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    table = [(i, _cells(lines[i])) for i in range(start + 1, end) if _cells(lines[i]) is not None]
    if len(table) < 3:
        raise TableError('%s: section "%s" has no table' % (doc_name, SECTION))
    header = [c.lower() for c in table[0][1]]
    if len(header) != 3 or header[0] != "folder" or header[2] != "may include":
        raise TableError(
            "%s:%d: the include table's header is %s, not | folder | what it is | may include |"
            % (doc_name, table[0][0] + 1, table[0][1]))
    rows, by_key, errors = [], {}, []
    for i, cells in table[2:]:
        where = "%s:%d" % (doc_name, i + 1)
        if len(cells) != 3:
            errors.append("%s: a row of %d cells, not 3" % (where, len(cells)))
            continue
        keys = re.findall(r"`([^`]+)`", cells[0])
        if not keys or re.sub(r"`[^`]+`|,|\s", "", cells[0]):
            errors.append("%s: the folder cell %r is not a list of `folder/` or `file`"
                          % (where, cells[0]))
            continue
        row = Row(i + 1, keys, cells[2])
        for k in keys:
            if k in by_key:
                errors.append("%s: `%s` has two rows" % (where, k))
            by_key[k] = row
        rows.append(row)
    for row in rows:
        where = "%s:%d" % (doc_name, row.line_no)
        text = _strip_notes(row.may_include_text)
        if text.strip().lower() == ANYTHING:
            row.anything = True
            continue
        for m in re.finditer(r"(all of\s+)?`([^`]+)`", text):
            name = m.group(2)
            if m.group(1):
                under = [r for r in rows if any(k.startswith(name) for k in r.keys)]
                if not name.endswith("/") or not under:
                    errors.append("%s: %s may include all of `%s`, under which there is no row"
                                  % (where, row.name, name))
                row.allowed.update(r.name for r in under)
            elif name in by_key:
                row.allowed.add(by_key[name].name)
            else:
                errors.append("%s: %s may include `%s`, which is no row of the table"
                              % (where, row.name, name))
        row.allowed.discard(row.name)
    if errors:
        raise TableError("\n".join(errors))
    return rows


def row_of(path, rows):
    """The row of a repository path: the exact file's, else the longest folder's."""
    best, best_len = None, -1
    for row in rows:
        for k in row.keys:
            if k == path:
                return row
            if k.endswith("/") and path.startswith(k) and len(k) > best_len:
                best, best_len = row, len(k)
    return best


def is_build_dir(rel, names):
    top = rel.split(os.sep)[0]
    return (os.sep not in rel and (top == "build" or top.startswith("build-"))) or \
        "CMakeCache.txt" in names


def source_files(root):
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        keep = []
        for d in sorted(dirnames):
            sub = os.path.normpath(os.path.join(rel, d))
            if d.startswith(".") or d == "__pycache__":
                continue
            try:
                names = os.listdir(os.path.join(dirpath, d))
            except OSError:
                continue
            if is_build_dir(sub, names):
                continue
            keep.append(d)
        dirnames[:] = keep
        for f in sorted(filenames):
            if f.endswith(SOURCE_SUFFIXES):
                yield os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/")


def project_includes(root, rel_path, top_folders):
    """(line, included repository path) for each include of a project path in the file."""
    with open(os.path.join(root, rel_path), encoding="utf-8", errors="replace") as f:
        text = f.read()
    for m in INCLUDE_RE.finditer(text):
        inc = m.group(1) or m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        if inc.startswith(("./", "../")):
            yield line, inc, None  # relative: an error
            continue
        for prefix, replacement in GENERATED_PREFIXES.items():
            if inc.startswith(prefix):
                yield line, inc, replacement + inc[len(prefix):]
                break
        else:
            if inc.split("/")[0] in top_folders and "/" in inc:
                yield line, inc, inc


def find_cycle(edges):
    """One cycle (a list of nodes, first == last) in a {node: set(node)} graph, or None."""
    color, stack = {}, []

    def visit(n):
        color[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if color.get(m) == 1:
                cycle = stack[stack.index(m):]
                first = cycle.index(min(cycle))  # the same cycle, whichever node it is met at
                cycle = cycle[first:] + cycle[:first]
                return cycle + [cycle[0]]
            if m not in color:
                c = visit(m)
                if c:
                    return c
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(edges):
        if n not in color:
            c = visit(n)
            if c:
                return c
    return None


def check(root, doc="docs/architecture.md", known_violations=()):
    """Returns (errors, {row: {row: [example include]}}) for the tree at root; the includes in
    known_violations ((file, included path) pairs) are allowed, and an error where absent."""
    with open(os.path.join(root, doc), encoding="utf-8") as f:
        try:
            rows = parse_table(f.read(), doc)
        except TableError as e:
            return [str(e)], {}
    errors = []
    for row in rows:
        for k in row.keys:
            if not os.path.exists(os.path.join(root, k)):
                errors.append("%s:%d: the table's `%s` does not exist" % (doc, row.line_no, k))
    by_name = {r.name: r for r in rows}
    top_folders = {d for d in os.listdir(root)
                   if os.path.isdir(os.path.join(root, d)) and not d.startswith(".")}
    graph, known_seen = {}, set()
    for path in source_files(root):
        src = row_of(path, rows)
        if src is None:
            errors.append("%s: no row of the include table covers this file" % path)
            continue
        for line, inc, target in project_includes(root, path, top_folders):
            where = '%s:%d: #include "%s"' % (path, line, inc)
            if target is None:
                errors.append("%s: a relative include; name the path from the root" % where)
                continue
            dst = row_of(target, rows)
            if dst is None:
                errors.append("%s: no row of the include table covers %s" % (where, target))
                continue
            if dst is src:
                continue
            graph.setdefault(src.name, {}).setdefault(dst.name, []).append(where)
            if (path, target) in known_violations:
                known_seen.add((path, target))
            elif not src.anything and dst.name not in src.allowed:
                errors.append("%s: %s includes %s, which its row (%s:%d) does not allow"
                              % (where, src.name, dst.name, doc, src.line_no))
    for path, target in sorted(set(known_violations) - known_seen):
        errors.append('%s: no longer includes "%s" against the table: remove it from '
                      "KNOWN_VIOLATIONS" % (path, target))
    cycle = find_cycle({s: set(d) for s, d in graph.items()})
    if cycle:
        lines = ["an include cycle between rows: " + " -> ".join(cycle)]
        for a, b in zip(cycle, cycle[1:]):
            lines.append("  %s -> %s: %s" % (a, b, graph[a][b][0]))
        errors.append("\n".join(lines))
    declared = {r.name: set(r.allowed) for r in rows if not r.anything}
    cycle = find_cycle(declared)
    if cycle:
        errors.append("%s: the table allows a cycle between rows: %s"
                      % (doc, " -> ".join(cycle)))
    return errors, graph


def repo_root():
    return os.environ.get("LATHE_SOURCE_DIR") or os.path.normpath(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


TABLE = """# Doc

## Folders, and what each may include

| folder | what it is | may include |
| --- | --- | --- |
| `base/` | the base | absl |
| `base/sub/` | below base, its own row | `base/` |
| `mid/` | in the middle | `base/` (notes, `not_a_row`) , gRPC |
| `top/` | on top | `mid/`, `base/sub/` |
| `app/main.cc` | a binary | all of `top/` |
| `app/` | the rest of app | `top/` |
| `lathe_gen/` | uses the generated API | `proto/lathe/v1/` |
| `proto/lathe/v1/` | the API | — |
| `tests/` | tests | anything |

## Next
"""


class SyntheticTreeTest(unittest.TestCase):
    """The checker on small trees: each fault fails with its message."""

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="include_table_test.")
        self.write("docs/architecture.md", TABLE)
        for path in ("proto/lathe/v1/job.proto", "app/main.cc", "lathe_gen/api.cc",
                     "tests/all_test.cc"):
            self.write(path, "")
        self.write("base/a.h", '#include "absl/status/status.h"\n#include <vector>\n')
        self.write("base/sub/b.h", '#include "base/a.h"\n#include "local.h"\n')
        self.write("mid/m.h", '#include "base/a.h"\n#include "mid/m2.h"\n')
        self.write("mid/m2.h", "")
        self.write("top/t.h", '#include "mid/m.h"\n#include "base/sub/b.h"\n')
        self.write("lathe_gen/api.cc", '#include "lathe/v1/job.pb.h"\n')
        self.write("tests/all_test.cc", '#include "top/t.h"\n#include "app/app.h"\n')
        self.write("app/app.h", '#include "top/t.h"\n')
        self.write("build/gen/x.h", '#include "tests/whatever.h"\n')
        self.write("build-debug/x.cc", '#include "app/app.h"\n')
        self.write(".venv/x.h", '#include "app/app.h"\n')
        self.write("out/CMakeCache.txt", "")
        self.write("out/y.h", '#include "app/app.h"\n')

    def tearDown(self):
        shutil.rmtree(self.root)

    def write(self, path, text):
        full = os.path.join(self.root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)

    def errors(self):
        return check(self.root)[0]

    def assert_one_error(self, *fragments):
        errors = self.errors()
        self.assertEqual(len(errors), 1, "\n".join(errors))
        for fragment in fragments:
            self.assertIn(fragment, errors[0])

    def test_clean_tree_passes(self):
        errors, graph = check(self.root)
        self.assertEqual(errors, [])
        self.assertIn("`proto/lathe/v1/`", graph["`lathe_gen/`"])
        self.assertIn("`app/`", graph["`tests/`"])

    def test_forbidden_include(self):
        self.write("base/a.h", '#include "mid/m.h"\n')
        errors = self.errors()
        self.assertIn('base/a.h:1: #include "mid/m.h": `base/` includes `mid/`, which its row '
                      "(docs/architecture.md:7) does not allow", errors)

    def test_folder_does_not_allow_its_sub_rows(self):
        self.write("mid/m.h", '#include "base/sub/b.h"\n')
        self.assert_one_error('mid/m.h:1: #include "base/sub/b.h"', "`mid/` includes `base/sub/`")

    def test_allowed_rows_are_not_transitive(self):
        self.write("top/t.h", '#include "base/a.h"\n')
        self.assert_one_error("`top/` includes `base/`")

    def test_all_of_and_file_rows(self):
        self.write("app/main.cc", '#include "top/t.h"\n')
        self.assertEqual(self.errors(), [])
        self.write("app/main.cc", '#include "mid/m.h"\n')
        self.assert_one_error("`app/main.cc` includes `mid/`")

    def test_generated_headers_map_to_the_proto_row(self):
        self.write("mid/m2.h", '#include "lathe/v1/job.pb.h"\n')
        self.assert_one_error('mid/m2.h:1: #include "lathe/v1/job.pb.h"',
                              "`mid/` includes `proto/lathe/v1/`")

    def test_cycle(self):
        # Allowed to the row that includes it, but a cycle: base/sub -> base -> base/sub.
        self.write("base/a.h", '#include "base/sub/b.h"\n')
        errors = self.errors()
        self.assertIn("`base/` includes `base/sub/`", errors[0])
        cycle = [e for e in errors if e.startswith("an include cycle")]
        self.assertEqual(len(cycle), 1, errors)
        self.assertIn("`base/` -> `base/sub/` -> `base/`", cycle[0])
        self.assertIn('base/a.h:1: #include "base/sub/b.h"', cycle[0])

    def test_cycle_through_anything_rows(self):
        self.write("app/app.h", '#include "tests/util.h"\n')
        errors = self.errors()
        self.assertTrue(any("`app/` -> `tests/` -> `app/`" in e for e in errors), errors)

    def test_file_without_a_row(self):
        self.write("loose/x.cc", '#include "base/a.h"\n')
        self.assert_one_error("loose/x.cc: no row of the include table covers this file")

    def test_include_without_a_row(self):
        self.write("loose/x.txt", "")
        self.write("top/t.h", '#include "loose/x.h"\n')
        self.assert_one_error('top/t.h:1: #include "loose/x.h": no row', "covers loose/x.h")

    def test_relative_include(self):
        self.write("top/t.h", '#include "../mid/m.h"\n')
        self.assert_one_error("a relative include")

    def test_table_names_no_row(self):
        self.write("docs/architecture.md", TABLE.replace("`base/sub/` |\n", "`nowhere/` |\n"))
        self.assert_one_error("`top/` may include `nowhere/`, which is no row of the table")

    def test_table_row_does_not_exist(self):
        shutil.rmtree(os.path.join(self.root, "lathe_gen"))
        self.assert_one_error("the table's `lathe_gen/` does not exist")

    def test_table_allows_a_cycle(self):
        self.write("docs/architecture.md", TABLE.replace("| absl |", "| `top/` |"))
        self.assert_one_error("the table allows a cycle between rows")

    def test_known_violations(self):
        self.write("top/t.h", '#include "base/a.h"\n')
        known = {("top/t.h", "base/a.h"), ("mid/m.h", "base/sub/b.h")}
        errors = check(self.root, known_violations=known)[0]
        self.assertEqual(errors, ['mid/m.h: no longer includes "base/sub/b.h" against the '
                                  "table: remove it from KNOWN_VIOLATIONS"])

    def test_no_section(self):
        self.write("docs/architecture.md", TABLE.replace("## Folders", "## Dossiers"))
        self.assert_one_error('has no section "## Folders, and what each may include"')

    def test_no_table(self):
        self.write("docs/architecture.md", "%s\n\nProse only.\n" % SECTION)
        self.assert_one_error("has no table")


class CurrentTreeTest(unittest.TestCase):
    def test_tree_follows_the_table(self):
        errors, _ = check(repo_root(), known_violations=KNOWN_VIOLATIONS)
        self.assertEqual(errors, [], "docs/architecture.md's include table, against the tree:\n"
                         + "\n".join(errors))


def report(root):
    errors, graph = check(root, known_violations=KNOWN_VIOLATIONS)
    for src in sorted(graph):
        for dst in sorted(graph[src]):
            print("%s -> %s (%d includes, e.g. %s)" % (src, dst, len(graph[src][dst]),
                                                     graph[src][dst][0]))
    for (path, target), why in sorted(KNOWN_VIOLATIONS.items()):
        print('known violation: %s includes "%s": %s' % (path, target, why))
    print("\n".join(errors) if errors else "no errors")
    return 1 if errors else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--report":
        sys.exit(report(sys.argv[2] if len(sys.argv) > 2 else repo_root()))
    unittest.main()
