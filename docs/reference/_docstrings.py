"""A Griffe extension for the API reference (mkdocs.yml loads it).

- maskc's docstrings are prose with >>> examples, which Markdown would read as nested block
  quotes: each run of >>> lines (with its ... continuations and output, up to a blank line)
  becomes a ```pycon block, and a dunder in the prose (`__name__`) stays literal.
- A ready-made MaskMod gets its docstring by assignment (`causal.__doc__ = "..."` in
  maskc/masks.py), which static analysis does not read as a docstring: it is read here.
- A public function wrapped by assignment (`block_map = outside_graph(block_map, ...)`, the
  torch.compile boundary of maskc/_graph.py) stays documented as the function it wraps, with
  its signature, instead of as a module attribute.
"""
import ast
import inspect
import re

import griffe


CODE_SPAN = re.compile(r"(`+).+?\1")


def escape_dunders(line: str) -> str:
    """`softcap(30).__name__` in prose, outside code spans, would print "name" in bold."""
    kept, start = [], 0
    for span in CODE_SPAN.finditer(line):
        kept += [line[start:span.start()].replace("__", "\\_\\_"), span.group()]
        start = span.end()
    return "".join(kept) + line[start:].replace("__", "\\_\\_")


def fence_doctests(text: str) -> str:
    lines, out, i, fenced = text.splitlines(), [], 0, False
    while i < len(lines):
        stripped = lines[i].lstrip()
        if stripped.startswith("```"):
            fenced = not fenced
        if fenced or not stripped.startswith(">>>"):
            out.append(lines[i] if fenced or stripped.startswith("```") else escape_dunders(lines[i]))
            i += 1
            continue
        indent = len(lines[i]) - len(stripped)
        if out and out[-1].strip():
            out.append("")
        out.append("```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i][indent:])
            i += 1
        out.extend(["```", ""])
    return "\n".join(out)


def wrapped_name(statement: ast.stmt) -> str | None:
    """`name` for `name = wrapper(name, ...)`, else None."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name) and isinstance(statement.value, ast.Call)):
        return None
    name, args = statement.targets[0].id, statement.value.args
    return name if args and isinstance(args[0], ast.Name) and args[0].id == name else None


def assigned_docstring(statement: ast.stmt) -> tuple[str, str] | None:
    """(name, text) for `name.__doc__ = "text"`, else None."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
        return None
    target, value = statement.targets[0], statement.value
    if (isinstance(target, ast.Attribute) and target.attr == "__doc__" and isinstance(target.value, ast.Name)
            and isinstance(value, ast.Constant) and isinstance(value.value, str)):
        return target.value.id, inspect.cleandoc(value.value)
    return None


class MaskcDocstrings(griffe.Extension):
    def __init__(self) -> None:
        self.functions: dict[str, griffe.Function] = {}

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)

    def on_function_instance(self, *, func: griffe.Function, **kwargs) -> None:
        self.functions[func.path] = func

    def on_module_members(self, *, node, mod: griffe.Module, **kwargs) -> None:
        for statement in getattr(node, "body", ()):
            name = wrapped_name(statement)
            function = self.functions.get(f"{mod.path}.{name}")
            if function is not None and mod.members.get(name) is not function:
                mod.set_member(name, function)
            found = assigned_docstring(statement)
            if found is not None and found[0] in mod.members:
                member = mod.members[found[0]]
                member.docstring = griffe.Docstring(fence_doctests(found[1]), lineno=statement.lineno, parent=member)
