"""Short error messages for the ``lightning-loco`` command.

jsonargparse reports a bad argument by printing the whole usage (about 50 lines) and an account of
every type it tried, with the values that would have been accepted somewhere in the middle. This
module turns the common cases into two or three lines that say which argument, what was given, what
is allowed, and, for a near miss, what was probably meant:

- a value outside a ``Literal`` (``--trainer.strategy.topology=torus``) or of the wrong type;
- an argument the class does not take (``--trainer.strategy.sync_evry=20``), or a field an option group
  does not have (``--trainer.strategy.elastic.lighthous=HOST:PORT``);
- a class path that does not import (``--model.class_path=mine.mymod.MyMLPP``);
- a registered name given arguments (``--trainer.strategy=noloco --trainer.strategy.sync_every=20``);
- an unknown option or subcommand;
- a strategy name that is not registered (``--trainer.strategy=nooloco``; Lightning only fails later,
  with a traceback).

The messages are read from jsonargparse's text; one not recognised is shown as jsonargparse wrote it
(still without the usage). ``LIGHTNING_LOCO_FULL_ERRORS=1`` (or jsonargparse's own ``JSONARGPARSE_DEBUG=1``)
restores jsonargparse's full output.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import os
import re
import sys
from typing import Any, Iterable, NoReturn, Optional

FULL_ERRORS_ENV = "LIGHTNING_LOCO_FULL_ERRORS"
_FULL_HINT = f"{FULL_ERRORS_ENV}=1 shows jsonargparse's full message"

_OUTER_KEY = re.compile(r'^Parser key "([^"]+)":\s*')
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)':")
_INNER_KEY = re.compile(r'Parser key "([^"]+)":')
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
_NO_ATTRIBUTE = re.compile(r"module '([^']+)' has no attribute '([^']+)'")
_NO_MODULE = re.compile(r"No module named '([^']+)'")
_DOT_PATH = re.compile(r"Expected a dot import path string: (\S+)")
_GOT_VALUE = re.compile(r"Got value: (.*)$", re.M)
_GIVEN_VALUE = re.compile(r"^\s*Given value: (.*)$", re.M)
_NESTED_ARG = re.compile(r"NestedArg\(key='([^']+)', val=(.*)\)$")
_NESTED_ARGS = re.compile(r"NestedArg\(key='([^']+)', val=(.*)\)$", re.M)
_LITERAL = re.compile(r"typing\.Literal\[(.*?)\]")
_EXPECTED_CLASS = re.compile(r"Expected an? <class '([\w.]+)'>")
_INVALID_CHOICE = re.compile(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)")


def full_errors_wanted() -> bool:
    """Whether jsonargparse's own, complete error output was asked for."""
    return any(os.environ.get(name, "").lower() not in ("", "0", "false", "no")
               for name in (FULL_ERRORS_ENV, "JSONARGPARSE_DEBUG"))


def fail(prog: str, message: str) -> NoReturn:
    """Writes ``PROG: error: MESSAGE`` to stderr and exits with status 2, as argparse does."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.exit(2)


def short_message(message: str, option_strings: Iterable[str], prog: str) -> str:
    """A few lines for jsonargparse's ``message``; ``option_strings`` are those of the parser that
    raised it (for a "did you mean" on an unknown option)."""
    lines = (_unrecognized(message, list(option_strings), prog) or _invalid_choice(message, prog)
             or _typed(message, prog))
    if lines is None:
        return f"{message}\n({_FULL_HINT})"
    return "\n".join([*lines[:-1], f"({lines[-1]}; {_FULL_HINT})"])


def unknown_strategy_name(name: str) -> Optional[str]:
    """The error for ``strategy=NAME`` when Lightning would reject ``NAME`` (not ``"auto"``, not
    registered), listing our names and Lightning's; ``None`` when ``NAME`` is fine."""
    from lightning.pytorch.strategies import StrategyRegistry

    registered = StrategyRegistry.available_strategies()
    if name.lower() == "auto" or name.lower() in registered:
        return None
    ours = [n for n in registered if StrategyRegistry[n]["strategy"].__module__.startswith("lightning_loco.")]
    theirs = ["auto"] + [n for n in registered if n not in ours]
    # Lightning's names without their variants (ddp_spawn, deepspeed_stage_2, ...), which still count for
    # "did you mean"
    base = [n for n in theirs if not any(n.startswith(m + "_") for m in theirs if m != n)]
    candidates = ours + theirs + (_our_strategy_class_paths() if "." in name else [])
    return (
        f"--trainer.strategy={name}: not a strategy name.{_did_you_mean(name, candidates)}\n"
        f"lightning_loco's names: {', '.join(ours)}. Lightning's: {', '.join(base)}, and variants such as "
        "ddp_spawn (all: StrategyRegistry.available_strategies() in lightning.pytorch.strategies). "
        "Or a class path, e.g. lightning_loco.NoLoCoStrategy."
    )


def _typed(message: str, prog: str) -> Optional[list[str]]:
    """``Parser key "...":`` messages: a bad value, an unknown argument or a class path that does not import."""
    outer = _OUTER_KEY.match(message)
    if outer is None:
        return None
    key = outer.group(1)
    klass = _CLASS_PATH.search(message)
    if klass is None:
        return _bad_value(key, message[outer.end():], about=None, hint=f"'{prog} --help' lists the arguments") or \
            _registered_name_with_arguments(key, message, prog)
    class_path = klass.group(1)
    body = message[klass.end():]
    hint = f"'{prog} --{key}.help {class_path}' lists its arguments"
    # the first complaint about this class (a union lists one per class it tried)
    matches = [m for m in (p.search(body) for p in (_NOT_ACCEPTED, _INNER_KEY, _NO_ATTRIBUTE, _NO_MODULE)) if m]
    first = min(matches, key=lambda m: m.start(), default=None)
    if first is None:
        return None
    if first.re is _NOT_ACCEPTED:
        name = first.group(1)
        nested = _NESTED_ARG.search(message)
        given = f"={_unquote(nested.group(2))}" if nested and nested.group(1).endswith(name) else ""
        names = _init_arguments(class_path)
        suggestion = _did_you_mean(name, names)
        listing = "" if suggestion or not names else f" Its arguments: {', '.join(names)}."
        return [f"--{key}.{name}{given}: {class_path} takes no argument '{name}'.{suggestion}{listing}", hint]
    if first.re is _INNER_KEY:
        inner = f"{key}.{first.group(1)}"
        return (_bad_value(inner, body[first.end():], about=class_path, hint=hint)
                or _unknown_group_field(inner, body[first.end():], hint))
    if first.re is _NO_MODULE:
        module = first.group(1)
        return [f"--{key}: class_path '{class_path}': no module named '{module}'. The command imports from the "
                f"current folder and PYTHONPATH: run it from the folder that holds '{module.split('.')[0]}', or add "
                "that folder to PYTHONPATH.", f"'{prog} --help' lists the arguments"]
    module, attribute = first.groups()
    defined: dict[str, Any] = getattr(sys.modules.get(module), "__dict__", {})
    candidates = [f"{module}.{name}" for name, value in defined.items()
                  if isinstance(value, type) and not name.startswith("_")]
    suggestion = _did_you_mean(class_path, candidates)
    return [f"--{key}: class_path '{class_path}': module '{module}' has no attribute '{attribute}'.{suggestion}",
            f"'{prog} --help' lists the arguments"]


def _unknown_group_field(key: str, block: str, hint: str) -> Optional[list[str]]:
    """A field an option group does not have (``--trainer.strategy.elastic.lighthous=...``: ElasticConfig)."""
    group, unknown = _CLASS_PATH.search(block), _NOT_ACCEPTED.search(block)
    if group is None or unknown is None or unknown.start() < group.start():
        return None
    class_path, name = group.group(1), unknown.group(1)
    nested = [m for m in _NESTED_ARGS.finditer(block) if m.group(1) == name]
    given = f"={_unquote(nested[0].group(2))}" if nested else ""
    names = _init_arguments(class_path)
    suggestion = _did_you_mean(name, names)
    listing = "" if suggestion or not names else f" Its fields: {', '.join(names)}."
    return [f"--{key}.{name}{given}: {class_path} has no field '{name}'.{suggestion}{listing}", hint]


def _bad_value(key: str, block: str, about: Optional[str], hint: str) -> Optional[list[str]]:
    """A value of the wrong type or outside a ``Literal``: what was given and what is allowed."""
    got = _GOT_VALUE.search(block) or _GIVEN_VALUE.search(block)
    if got is None:
        return None
    given = got.group(1).strip()
    if given.startswith("NestedArg("):
        return None
    block = block[: got.start()]
    literals = list(dict.fromkeys(value for match in _LITERAL.findall(block) for value in _literal_values(match)))
    classes = [name for name in _EXPECTED_CLASS.findall(block) if name != "NoneType"]
    nullable = "<class 'NoneType'>" in block
    suggestion = ""
    if literals:
        allowed = "one of " + ", ".join([repr(v) for v in literals] + (["null"] if nullable else []))
        suggestion = _did_you_mean(given, [str(v) for v in literals])
    elif classes:
        allowed = " or ".join(dict.fromkeys(classes + (["null"] if nullable else [])))
    else:
        return None
    where = f" ({about})" if about else ""
    return [f"--{key}{where}: got {given!r}, expected {allowed}.{suggestion}", hint]


def _registered_name_with_arguments(key: str, message: str, prog: str) -> Optional[list[str]]:
    """``--trainer.strategy=noloco --trainer.strategy.sync_every=20``: a registered name takes no arguments."""
    dot_path, nested = _DOT_PATH.search(message), _NESTED_ARG.search(message)
    if dot_path is None or nested is None or key != "trainer.strategy":
        return None
    from lightning.pytorch.strategies import StrategyRegistry

    name = dot_path.group(1)
    if name not in StrategyRegistry:
        return None
    class_type = StrategyRegistry[name]["strategy"]
    class_path = public_name(class_type)
    argument = f"--{key}.{nested.group(1)}={_unquote(nested.group(2))}"
    return [f"{argument}: '{name}' is a registered name, which takes no arguments. Name its class instead: "
            f"--{key}={class_path} {argument}", f"'{prog} --{key}.help {class_path}' lists its arguments"]


def _unrecognized(message: str, option_strings: list[str], prog: str) -> Optional[list[str]]:
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return None
    unknown = [token for token in message[len(prefix):].split() if token.startswith("-")]
    lines = [f"unrecognized argument {token}.{_did_you_mean(token.split('=')[0], option_strings, quote=False)}"
             for token in unknown] or [message]
    return [*lines, f"'{prog} --help' lists the arguments"]


def _invalid_choice(message: str, prog: str) -> Optional[list[str]]:
    match = _INVALID_CHOICE.search(message)
    if match is None:
        return None
    argument, given, listing = match.groups()
    choices = [choice.strip().strip("'") for choice in listing.split(",")]
    return [f"{argument} {given!r} is not one of {', '.join(choices)}.{_did_you_mean(given, choices)}",
            f"'{prog} --help' lists them"]


def _did_you_mean(given: str, candidates: Iterable[str], quote: bool = True) -> str:
    close = difflib.get_close_matches(given, list(candidates), n=1, cutoff=0.6)
    if not close:
        return ""
    return f" Did you mean {close[0]!r}?" if quote else f" Did you mean {close[0]}?"


def _init_arguments(class_path: str) -> list[str]:
    """The arguments jsonargparse accepts for ``class_path`` (following ``**kwargs`` into base classes)."""
    from jsonargparse import ArgumentParser

    module, _, name = class_path.rpartition(".")
    try:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(getattr(importlib.import_module(module), name), fail_untyped=False)
        keys = parser.get_defaults().keys()
    except Exception:  # only for a suggestion: without it the message is still right
        return []
    return list(dict.fromkeys(key.split(".")[0] for key in keys))


def _literal_values(text: str) -> list[Any]:
    try:
        return list(ast.literal_eval(f"[{text}]"))
    except (ValueError, SyntaxError):
        return []


def _unquote(text: str) -> str:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, str) else text


def _our_strategy_class_paths() -> list[str]:
    import lightning_loco

    return [f"lightning_loco.{name}" for name in lightning_loco.__all__ if name.endswith("Strategy")]


def public_name(class_type: type) -> str:
    """``lightning_loco.NoLoCoStrategy`` rather than its defining module, where the package exports it."""
    package = sys.modules.get(class_type.__module__.split(".")[0])
    if package is not None and getattr(package, class_type.__qualname__, None) is class_type:
        return f"{package.__name__}.{class_type.__qualname__}"
    return f"{class_type.__module__}.{class_type.__qualname__}"
