"""benchmarks/record.py: a results file and its manifest (where the figures came from), and a static check that every
benchmark script writes its JSON results through it."""

import ast
import json
import os
import re
import subprocess
from pathlib import Path

import torch

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
record = load_script(BENCH / "record.py", "record_benchmark")

# JSON a script writes that is not a results file, by (script, function): no manifest belongs beside it.
NOT_RESULTS = {
    # one JSON line per step and rank, scratch that cluster.py reads back and summarizes into its own results file;
    # (link_probe.py prints its JSON to stdout for cluster.py: a print is no file write, so it needs no entry)
    ("step_probe.py", "StepProbe._record"),
}


def _argv(*args: str) -> list[str]:
    return [str(BENCH / "x.py"), *args]


def test_write_writes_the_data_and_a_manifest_of_where_it_came_from(tmp_path):
    path = tmp_path / "q" / "x.json"  # the question's folder is made
    data = {"rows": [{"a": 1.5, "b": None}], "meta": {"n": 3}}
    record.write(path, data, _argv("--json", "benchmarks/data/q/x.json", "--name", "two words"))
    assert json.loads(path.read_text()) == data
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.json", "x.manifest.json"]  # no .tmp left behind
    assert record.manifest_path(path) == path.parent / "x.manifest.json"
    (entry,) = json.loads(record.manifest_path(path).read_text())["runs"]
    assert entry == record.read_manifest(path)[0]
    # the command as run from the repository's root, whatever the working directory or the script's absolute path
    assert entry["command"] == "python benchmarks/x.py --json benchmarks/data/q/x.json --name 'two words'"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert entry["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    assert entry["uncommitted_changes"] in ((True, False) if head.returncode == 0 else (None,))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", entry["date"]) and "first_date" not in entry
    assert entry["versions"]["torch"] == torch.__version__ and set(entry["versions"]) >= {"python", "lightning"}
    assert entry["machine"]["cpus"] == os.cpu_count() and entry["machine"]["system"]


def test_one_invocation_keeps_one_entry_and_a_second_appends_its_own(tmp_path):
    path = tmp_path / "study.json"
    record.write(path, {"runs": [1]}, _argv("--seeds", "1"))
    entries = record.read_manifest(path)
    entries[0]["date"] = "2001-01-01T00:00:00Z"  # as if the invocation's first run had finished long ago
    record.manifest_path(path).write_text(json.dumps({"runs": entries}))
    for runs in ([1, 2], [1, 2, 3]):  # the same invocation writes the file after each finished run
        record.write(path, {"runs": runs}, _argv("--seeds", "1"))
        (entry,) = record.read_manifest(path)
        assert entry["first_date"] == "2001-01-01T00:00:00Z" and entry["date"] > entry["first_date"]
    assert json.loads(path.read_text()) == {"runs": [1, 2, 3]}

    record._WRITTEN.clear()  # another invocation (another process) adds runs to the same file
    record.write(path, {"runs": [1, 2, 3, 4]}, _argv("--seeds", "2"))
    first, second = record.read_manifest(path)
    assert first["first_date"] == "2001-01-01T00:00:00Z" and first["command"].endswith("--seeds 1")
    assert second["command"] == "python benchmarks/x.py --seeds 2" and "first_date" not in second
    record.write(path, {"runs": [1, 2, 3, 4, 5]}, _argv("--seeds", "2"))  # and keeps to its own entry
    assert [e["command"] for e in record.read_manifest(path)] == [first["command"], second["command"]]


def json_writes(source: str) -> list[tuple[int, str, str]]:
    """The JSON file writes in ``source`` that bypass ``record.write``, as (line, enclosing function, code):
    ``json.dump(...)``, and a ``.write_text(...)`` or ``.write(...)`` of ``json.dumps(...)`` or of a name bound to one
    in the same function. ``print(json.dumps(...))`` is no file write."""
    tree = ast.parse(source)
    found = []

    def is_dumps(node: ast.AST, names: set[str]) -> bool:
        return any(
            (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "dumps"
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "json")
            or (isinstance(n, ast.Name) and n.id in names)
            for n in ast.walk(node)
        )  # fmt: skip

    def own(scope: ast.AST) -> list[ast.AST]:
        """The nodes of ``scope`` outside the functions and classes it defines (those, but not their insides)."""
        out, todo = [], list(ast.iter_child_nodes(scope))
        while todo:
            node = todo.pop()
            out.append(node)
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                todo.extend(ast.iter_child_nodes(node))
        return out

    def visit(scope: ast.AST, qualname: str) -> None:
        mine = own(scope)
        names = {t.id for n in mine if isinstance(n, ast.Assign) and is_dumps(n.value, set())
                 for t in n.targets if isinstance(t, ast.Name)}  # fmt: skip
        for n in mine:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(n, f"{qualname}.{n.name}" if qualname else n.name)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                dump = n.func.attr == "dump" and isinstance(n.func.value, ast.Name) and n.func.value.id == "json"
                write = n.func.attr in ("write", "write_text") and any(is_dumps(a, names) for a in n.args)
                if dump or write:
                    found.append((n.lineno, qualname, ast.get_source_segment(source, n)))

    visit(tree, "")
    return sorted(found)


def test_the_check_finds_each_way_of_writing_json_past_record():
    source = """
import json
def a(args, rows):
    args.json.write_text(json.dumps(rows, indent=2))
def b(path, rows):
    with open(path, "w") as f:
        json.dump(rows, f)
class C:
    def c(self, rows):
        text = json.dumps(rows) + "\\n"
        self.file.write(text)
def fine(path, rows):
    print(json.dumps(rows))
    record.write(path, rows)
    Path(path).write_text("not json")
"""
    assert [(line, where) for line, where, _ in json_writes(source)] == [(4, "a"), (7, "b"), (11, "C.c")]


def test_every_benchmark_writes_its_json_results_through_record():
    offenders, allowed = [], set()
    for script in sorted(BENCH.glob("*.py")):
        if script.name == "record.py":
            continue
        for line, where, code in json_writes(script.read_text()):
            if (script.name, where) in NOT_RESULTS:
                allowed.add((script.name, where))
            else:
                offenders.append(f"benchmarks/{script.name}:{line} ({where}): {code}")
    assert not offenders, "write results with record.write(path, data, argv) (a manifest beside them):\n" + "\n".join(
        offenders
    )
    assert allowed == NOT_RESULTS  # an entry that no longer matches a write is stale


def test_a_recording_does_not_count_its_own_files_as_uncommitted_changes():
    status = " M benchmarks/data/suite/suite_time.json\n M benchmarks/data/suite/suite_time.manifest.json\n"
    own = ("benchmarks/data/suite/suite_time.json", "benchmarks/data/suite/suite_time.manifest.json")
    assert record.changed(status, own) is False
    assert record.changed(status + " M lightning_zeropp/core.py\n", own) is True
    assert record.changed("", own) is False and record.changed(status) is True
