"""MASK and SCORE arguments: a ready-made mod of maskc.masks or maskc.scores with its
arguments after colons (`sliding_window:1024`, `document:lengths=100,200,300:causal=true`),
or a mod from the user's code (`my_masks:sliding`, `./masks.py:sliding`,
`my_masks:make_window:512` for a factory called with 512).
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from maskc import masks, scores
from maskc.analysis.build import MAX_LENGTH
from maskc.cli._common import UsageError
from maskc.errors import MaskcError
from maskc.trace.mods import MaskMod, ScoreMod, as_mask_mod, as_score_mod


def _document(lengths: list, causal: bool = False) -> MaskMod:
    """maskc.masks.document over documents of these lengths, packed in order."""
    lengths = lengths if isinstance(lengths, list) else [lengths]
    if not all(isinstance(n, int) and n > 0 for n in lengths):
        raise ValueError(f"lengths must be positive integers, got {lengths}")
    if sum(lengths) > MAX_LENGTH:
        raise ValueError(f"lengths must add up to at most 2**31 - 1, the longest sequence maskc's kernels index, "
                         f"got {sum(lengths)}")
    return masks.document(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), causal=causal)


def _alibi(heads: int) -> ScoreMod:
    """maskc.scores.alibi with the paper's slopes for this many heads."""
    return scores.alibi(scores.alibi_slopes(heads))


# Public names of maskc.masks and maskc.scores that a command line cannot spell, and what to do
# instead: such mods come from the user's code (module:function).
_COMBINE = ("takes mask_mods, which a command line cannot spell; combine them in your code and name the result "
            "module:function")
_CODE_ONLY = {"and_masks": _COMBINE, "or_masks": _COMBINE, "not_mask": _COMBINE,
              "relative_bias": "takes a learned table, which a command line cannot spell; build the score_mod in "
                               "your code and name it module:function",
              "alibi_slopes": "gives alibi's slopes, not a score_mod; name alibi:HEADS"}
# The ready-made mods a command line can name.
MASKS = {name: getattr(masks, name) for name in masks.__all__ if name not in _CODE_ONLY}
MASKS["document"] = _document
SCORES = {"softcap": scores.softcap, "alibi": _alibi}


class Resolved(NamedTuple):
    mod: MaskMod | ScoreMod
    length: int | None  # the sequence length the arguments spell (a document mask's lengths), else None


def usage(table: dict) -> list[str]:
    """How each entry of MASKS or SCORES is written: `sliding_window:WINDOW`."""
    lines = []
    for name, made in table.items():
        if isinstance(made, (MaskMod, ScoreMod)):
            lines.append(name)
            continue
        text = name
        for p in inspect.signature(made).parameters.values():
            text += f":{p.name.upper()}" if p.default is p.empty else f"[:{p.name}={p.default!r}]".lower()
        lines.append(text)
    return lines


def help_text(kind: str) -> str:
    table = MASKS if kind == "mask" else SCORES
    upper = kind.upper()
    return (f"{upper} is one of maskc.{kind}s with its arguments after colons (name=value works too):\n  "
            + "\n  ".join(usage(table))
            + f"\nor a {kind}_mod of your code: module:function (a dotted module found from the current folder, or a "
              f"file: ./my_{kind}s.py:function), or module:factory:ARG... for a function that returns one.")


def resolve(spec: str, kind: str) -> Resolved:
    """The traced mod a MASK (kind "mask") or SCORE (kind "score") argument names."""
    table = MASKS if kind == "mask" else SCORES
    name, *args = spec.split(":")
    _refuse_other_names(name, kind)
    if name in table:
        made = table[name]
        if isinstance(made, (MaskMod, ScoreMod)):
            if args:
                raise UsageError(f"{kind} {name!r} takes no arguments, got {spec!r}")
            return Resolved(made, None)
        mod = _call(made, args, spec, usage({name: made})[0])
        # a document mask is as long as its documents together
        return Resolved(mod, len(mod.traced.tensors[0]) if made is _document else None)
    if not args:
        raise UsageError(f"unknown {kind} {spec!r}; {_did_you_mean(name, table)}name one of {', '.join(table)} "
                         f"(see --help), or your own as module:function")
    try:
        module = _module(name, spec)
    except UsageError:
        # a misspelt ready-made name with arguments reads as module:function: say which was meant
        if not name.isidentifier() or not _close(name, table) or importlib.util.find_spec(name):
            raise
        raise UsageError(f"unknown {kind} {name!r} in {spec!r} (no maskc {kind} and no module of that name); "
                         f"{_did_you_mean(name, table)}name one of {', '.join(table)} (see --help), or your own as "
                         f"module:function") from None
    target = _attribute(module, args[0], spec)
    if len(args) > 1:
        target = _call(target, args[1:], spec, f"{args[0]}{inspect.signature(target)}")
    try:
        mod = as_mask_mod(target) if kind == "mask" else as_score_mod(target)
    except (MaskcError, TypeError) as error:
        raise UsageError(f"{spec!r} is not a {kind}_mod maskc can trace: {error}") from None
    return Resolved(mod, None)


def _close(name: str, table: dict) -> list[str]:
    return difflib.get_close_matches(name, table)


def _did_you_mean(name: str, table: dict) -> str:
    close = _close(name, table)
    return f"did you mean {' or '.join(close)}? " if close else ""


def _refuse_other_names(name: str, kind: str) -> None:
    """A name of maskc's that this argument cannot take: the other kind's mod, or one of _CODE_ONLY."""
    other, table = ("score", SCORES) if kind == "mask" else ("mask", MASKS)
    if name in table:
        raise UsageError(f"{name!r} is a maskc {other}, not a {kind}; name a {kind} here (see --help)")
    if name in _CODE_ONLY:
        raise UsageError(f"maskc.{'masks' if name in masks.__all__ else 'scores'}.{name} {_CODE_ONLY[name]}")


def _call(factory, args: list[str], spec: str, shown: str):
    """factory(*args), each argument read by _value; `shown` is how it is called, for errors."""
    positional, named = [], {}
    for arg in args:
        key, eq, text = arg.partition("=")
        if eq:
            named[key] = _value(text)
        elif named:
            raise UsageError(f"{spec!r}: the positional argument {arg!r} follows a name=value one; put it first")
        else:
            positional.append(_value(arg))
    signature = inspect.signature(factory)
    try:
        bound = signature.bind(*positional, **named)
    except TypeError as error:
        raise UsageError(f"{spec!r} does not fit {shown}: {error}") from None
    for key, value in bound.arguments.items():
        # _value reads only true and false as booleans: any other word would be a truthy string
        if isinstance(signature.parameters[key].default, bool) and not isinstance(value, bool):
            raise UsageError(f"{spec!r}: {key} must be true or false, got {value!r}")
    try:
        return factory(*positional, **named)
    except (ValueError, TypeError, MaskcError) as error:
        raise UsageError(f"{spec!r}: {error}") from None


def _value(text: str):
    """An argument's value: an int, a float, true/false, or a comma-separated list of them; else the text."""
    if "," in text:
        return [_value(part) for part in text.split(",") if part]
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _module(name: str, spec: str):
    """The user's module: a file path (ending in .py) or a dotted name found from the current folder."""
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"no file {name} for {spec!r}; give the path of a Python file, or a module name")
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
        return module
    if not all(part.isidentifier() for part in name.split(".")):
        raise UsageError(f"{name!r} in {spec!r} is not a module name; write module:function with a dotted module "
                         f"name, or path/to/file.py:function")
    # NOTE: a console script's sys.path lacks the current folder, where `python -m` has it:
    # modules next to the user are found either way.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        raise UsageError(f"cannot import {name!r} for {spec!r} ({error}); run maskc from the folder that holds it, "
                         f"or name the file: path/to/{name.replace('.', '/')}.py:{spec.split(':')[1]}") from None


def _attribute(module, dotted: str, spec: str):
    target = module
    for part in dotted.split("."):
        if not hasattr(target, part):
            raise UsageError(f"{module.__name__} has no {dotted!r} for {spec!r}")
        target = getattr(target, part)
    return target


__all__ = ["MASKS", "SCORES", "Resolved", "help_text", "resolve", "usage"]
