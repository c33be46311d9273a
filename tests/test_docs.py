"""The docs stay true to the tree: every file path, test and module they name exists.

Read: README.md, docs/*.md, and the comments and docstrings of the code (they name files too).
Checked: paths under the project's folders (`pipeline/store/versions.py`, `bench/results/<name>.json`), tests
(`test_<file>.py::test_<name>`) and dotted module paths (`stages.ppo_update.worker`, and a name in
a module: `pipeline.store.audit.audit_before_training`)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from pipeline.orchestration.stage_table import ROOT

FOLDERS = ("pipeline", "stages", "schemas", "runtime", "bench", "tests", "docs", "deployments")
PACKAGES = ("pipeline", "stages", "schemas", "runtime")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(FOLDERS)})/[\w./-]*[\w])")
TEST = re.compile(r"\b(test_\w+\.py)::(\w+)")
MODULE = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.\w+)+)")
README_MAX_LINES = 300


def documents() -> dict[str, str]:
    texts = {
        str(path.relative_to(ROOT)): path.read_text() for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    }
    for folder in (*PACKAGES, "bench", "tests", "deployments"):
        for path in (ROOT / folder).rglob("*.py"):
            texts[str(path.relative_to(ROOT))] = path.read_text()
    texts["Makefile"] = (ROOT / "Makefile").read_text()
    texts["deployments/prefect.yaml"] = (ROOT / "deployments/prefect.yaml").read_text()
    return texts


@functools.cache
def top_level_names(path: Path) -> set[str]:
    """Names a module defines at its top level (not those it imports: a docs reference names where a
    thing is defined)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def module_reference_exists(dotted: str) -> bool:
    """`a.b.c`: the longest prefix that is a module of the tree, then (at most) one name it defines."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:end])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if base.is_dir() or source.is_file():
            rest = parts[end:]
            if not rest:
                return True
            return source.is_file() and rest[0] in top_level_names(source)
    return False


def test_every_path_the_docs_name_exists():
    missing = sorted(
        {
            f"{name}: {path}"
            for name, text in documents().items()
            for path in PATH.findall(text)
            if not (ROOT / path).exists() and "*" not in path and "<" not in path
        }
    )
    assert not missing, "stale file names:\n" + "\n".join(missing)


def test_every_test_the_docs_name_exists():
    missing = []
    for name, text in documents().items():
        for file, test in TEST.findall(text):
            path = ROOT / "tests" / file
            if not path.is_file() or not re.search(rf"def {test}\b", path.read_text()):
                missing.append(f"{name}: {file}::{test}")
    assert not missing, "stale test names:\n" + "\n".join(sorted(set(missing)))


def test_every_module_the_docs_name_exists():
    missing = sorted(
        {
            f"{name}: {dotted}"
            for name, text in documents().items()
            for dotted in MODULE.findall(text)
            if not module_reference_exists(dotted.rstrip("."))
        }
    )
    assert not missing, "stale module names:\n" + "\n".join(missing)


def test_the_readme_is_short_enough_to_read():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the details belong in docs/"


def test_the_docs_describe_every_registered_stage_and_only_those():
    """docs/architecture.md's list of stages ("How each stage works") is the stage table's."""
    from pipeline.orchestration.stage_table import STAGES

    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## How each stage works") :]
    section = section[: section.index("\n## ", 1)]
    assert set(re.findall(r"^- \*\*([a-z-]+)\*\*", section, re.M)) == set(STAGES)


def layout_map() -> dict[str, dict[str, str]]:
    """docs/architecture.md's map of the code (the blocks under "## Layout"): for each package, each entry
    (a module `name.py` or a folder `name/`) and the text that describes it."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Layout") :]
    section = section[: section.index("\n## ", 1)]
    packages: dict[str, dict[str, str]] = {}
    entry = None
    for block in re.findall(r"```\n(.*?)```", section, re.S):
        for line in block.splitlines():
            if top := re.match(r"^(\w+)/\s", line + " "):
                package = packages.setdefault(top.group(1), {})
                entry = None
            elif named := re.match(r"^  (\w+(?:\.py|/))\s", line + " "):
                entry = named.group(1)
                package[entry] = line
            elif entry is not None and line.startswith("   "):
                package[entry] += " " + line.strip()
    return packages


def modules_and_folders(folder: Path) -> set[str]:
    """A package's modules (`name.py`, not __init__ or __main__) and sub-packages (`name/`)."""
    names = {p.name for p in folder.glob("*.py") if not p.name.startswith("__")}
    return names | {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()}


def test_the_docs_map_every_module_and_folder_of_the_packages_and_only_those():
    """docs/architecture.md's map names each package's modules and sub-packages, and pipeline's sub-packages
    name each of their modules: a file moved, added or removed is moved, added or removed there too."""
    mapped = layout_map()
    assert set(mapped) >= set(PACKAGES)
    for package in PACKAGES:
        assert set(mapped[package]) == modules_and_folders(ROOT / package), package
    for folder, entry in mapped["pipeline"].items():
        named = set(re.findall(r"\b\w+\.py\b", entry)) | set(re.findall(r"\b\w+/", entry))
        contents = modules_and_folders(ROOT / "pipeline" / folder)
        assert {name for name in named if name.endswith(".py")} == {n for n in contents if n.endswith(".py")}, folder
        assert named >= contents, folder
