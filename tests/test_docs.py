"""The documentation's examples run: every ```python block of every page under docs/, on a CPU.

A page's blocks run in order in one namespace that starts empty, as a reader would type them
into one session, in a temporary working directory (a page may save a picture). Blocks fenced
```py are shown but not run: those that need a GPU, a download, several processes, or that are
fragments. A traceback points at the page's own line (each block is compiled under the page's
path, at its line).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
# A fence opens with three or more backticks, indented or not (in a list or an admonition),
# followed by the language and optional attributes (```python title="x.py"); it closes with as
# many backticks at the same indentation.
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})[ \t]*(?P<info>[^`\n]*)$")
# Pages whose blocks take 5 s or more together on a 2-core CPU (the backward's kernels, Dynamo):
# `-m slow` runs them, so that the default lane's pages stay under 20 s.
SLOW = {"guides/training.md", "guides/torch-compile.md"}


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line, code) of each ```python block of a Markdown page, dedented by its fence's indent."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, ticks = opened["indent"], opened["ticks"]
        language = opened["info"].split()[0].lstrip(".").lower() if opened["info"].strip() else ""
        first, body = i + 2, []
        i += 1
        while i < len(lines):
            closed = FENCE.match(lines[i])
            if closed and closed["ticks"] == ticks and not closed["info"].strip():
                break
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1
        if language == "python":
            blocks.append((first, "\n".join(body) + "\n"))
    return blocks


def _pages() -> list:
    params = []
    for page in sorted(DOCS.rglob("*.md")):
        name = page.relative_to(DOCS).as_posix()
        if python_blocks(page.read_text(encoding="utf-8")):
            params.append(pytest.param(name, id=name, marks=pytest.mark.slow if name in SLOW else ()))
    return params


@pytest.mark.parametrize("name", _pages())
def test_page_examples_run(name, tmp_path, monkeypatch):
    page = DOCS / name
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for first, code in python_blocks(page.read_text(encoding="utf-8")):
        # blank lines before the code put a traceback's line numbers on the page's own lines
        exec(compile("\n" * (first - 1) + code, str(page), "exec"), namespace)  # noqa: S102


def test_python_blocks_are_found_and_py_blocks_are_not():
    page = "\n".join([
        "# A page", "",
        "```python", "x = 1", "```", "",
        "```py", "raise SystemExit('not run')", "```", "",
        "- a list item:", "",
        "    ```python title=\"a.py\"", "    y = x + 1", "    ```", "",
        "````python", "s = '''", "```", "'''", "````", "",
        "```text", ">>> shown", "```",
    ])
    blocks = python_blocks(page)
    assert [first for first, _ in blocks] == [4, 14, 18]
    assert [code for _, code in blocks] == ["x = 1\n", "y = x + 1\n", "s = '''\n```\n'''\n"]


# The API reference's pages (docs/reference/, built by mkdocstrings) and the modules whose public
# names each must document.
REFERENCE = {"maskc": "maskc.md", "maskc.masks": "masks.md", "maskc.scores": "scores.md",
             "maskc.testing": "testing.md", "maskc.distributed": "distributed.md",
             "maskc.integrations.flex": "flex.md", "maskc.integrations.transformers": "transformers.md"}


def _documented_on(page: str, module: str, name: str) -> bool:
    """Whether a reference page renders `name`: a `::: module.name` block, one headed
    `module.name`, a `- name` entry of the module's members, or a heading of its own."""
    lines = page.splitlines()
    return any(line.strip() in (f"heading: {module}.{name}", f"::: {module}.{name}", f"- {name}")
               or (line.startswith("#") and f"`{name}`" in line) for line in lines)


def test_reference_documents_every_public_name():
    import importlib

    modules = {module: importlib.import_module(module) for module in REFERENCE}
    documented, missing = set(), []
    for module, page in REFERENCE.items():
        text = (DOCS / "reference" / page).read_text(encoding="utf-8")
        for name in modules[module].__all__:
            if _documented_on(text, module, name):
                documented.add(id(getattr(modules[module], name)))
    for module, mod in modules.items():
        for name in mod.__all__:
            value = getattr(mod, name)
            # a name re-exported from a module that documents it (maskc.and_masks is maskc.masks.and_masks),
            # or a module with a page of its own
            if id(value) not in documented and getattr(value, "__name__", None) not in REFERENCE:
                missing.append(f"{module}.{name}")
    assert not missing, f"docs/reference/ does not document {missing}; add each to its module's page"
