"""The ``lightning-loco`` command.

``lightning-loco fit|validate|test|predict ...`` is Lightning's ``LightningCLI`` (jsonargparse) with
this package imported, so the strategy names "noloco", "diloco" and "gasloc" always resolve and
``--trainer.strategy.help lightning_loco.NoLoCoStrategy`` lists every argument with its paper
symbol and default. Model and data are chosen by ``class_path`` in the config (see
``examples/shakespeare/``). Two mistakes are reported first and briefly, before any process is
launched: a strategy or callback that rejects its arguments (its own ``ValueError``, instead of
jsonargparse's account of every type it tried), and a ``--ckpt_path`` that does not exist (checked
before anything is built).

``lightning-loco export CHECKPOINT OUTPUT [--state-dict-only] [--trust-checkpoint]`` writes the
consensus model of a checkpoint as one plain file (see ``lightning_loco.replica.checkpoints.export_consensus``).

``lightning-loco lighthouse --min-replicas N [--bind HOST:PORT]`` runs torchft's Lighthouse for elastic
replicas and prints its address (see ``lightning_loco.elastic.lighthouse``; needs the ``elastic`` extra).

Like ``python -m``, the command imports from the current folder first, so ``class_path: mine.mymod.MyMLP``
finds ``./mine/mymod.py``. Argument errors are a few lines (``lightning_loco.cli.errors``);
``LIGHTNING_LOCO_FULL_ERRORS=1`` shows jsonargparse's full message instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn, Optional

from lightning.pytorch import Callback
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import Strategy

import lightning_loco  # noqa: F401  (registers the strategy names)
from lightning_loco.cli import errors as cli_errors
from lightning_loco.replica.checkpoints import CheckpointError, export_consensus

PROG = "lightning-loco"
DESCRIPTION = (
    "Lightning's command line (LightningCLI) with lightning_loco's strategies: fit, validate, test and "
    f"predict, and two more subcommands. export: '{PROG} export CHECKPOINT OUTPUT' writes the consensus "
    f"model of a checkpoint as one plain file ('{PROG} export --help'). lighthouse: '{PROG} lighthouse "
    f"--min-replicas N' runs the membership server of elastic replicas ('{PROG} lighthouse --help')."
)
# The config keys whose classes' own argument errors are reported as they are (see LocoCLI).
_CHECKED = ((Strategy, "trainer.strategy"), (Callback, "trainer.callbacks"))
_SPECIAL_CKPT_PATHS = ("best", "last", "hpc")  # resolved by the Trainer, not files
# Subcommands that main() runs itself, before LightningCLI: listed in the top-level help and usage only.
_OWN_SUBCOMMANDS = {
    "export": "Write the consensus model of a checkpoint as one plain file.",
    "lighthouse": "Run torchft's Lighthouse, the membership server of elastic replicas.",
}


def export(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} export", description="Write the consensus model of a checkpoint as one plain file."
    )
    parser.add_argument("checkpoint", help="a checkpoint written by a lightning_loco strategy (or any Lightning one)")
    parser.add_argument("output", help="the file to write")
    parser.add_argument("--state-dict-only", action="store_true", help="write only the model's state_dict")
    parser.add_argument(
        "--trust-checkpoint", action="store_true",
        help="load whatever Python objects the checkpoint holds (torch.load(weights_only=False)): this runs code "
        "from the file, so only for files you trust. Without it, only tensors, plain values and the types of "
        "ordinary Lightning checkpoints load.",
    )
    args = parser.parse_args(argv)
    try:
        path = export_consensus(
            args.checkpoint, args.output, state_dict_only=args.state_dict_only, trust_checkpoint=args.trust_checkpoint
        )
    except (CheckpointError, FileNotFoundError) as err:
        parser.error(str(err))
    print(f"wrote {path}")


class LocoArgumentParser(LightningArgumentParser):
    """Lightning's parser, whose errors are a few lines (``cli_errors.short_message``) instead of the
    usage and jsonargparse's account of every type it tried, and which takes no abbreviation of an option
    (argparse's prefix matching would read ``--trainer.max_step=10`` as ``--trainer.max_steps=10``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def add_subcommands(self, *args: Any, **kwargs: Any) -> Any:
        self.subcommands_action = super().add_subcommands(*args, **kwargs)
        return self.subcommands_action

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        # Parsers that do not exit are jsonargparse's way of trying one type after another: leave them be.
        if not self.exit_on_error or cli_errors.full_errors_wanted():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        options = [option for action in parser._actions for option in action.option_strings]
        prog = parser.prog.replace(" [options]", "")
        cli_errors.fail(prog, cli_errors.short_message(message, options, prog))


class LocoCLI(LightningCLI):
    """``LightningCLI`` that reports bad arguments of a strategy or callback, an unknown strategy name
    and a missing checkpoint first and briefly, before any process is launched; and that lists
    ``export`` and ``lighthouse`` with its subcommands."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._rejected: Optional[tuple[type, str, Exception]] = None
        kwargs.setdefault("parser_class", LocoArgumentParser)
        super().__init__(*args, **kwargs)

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        action = getattr(self.parser, "subcommands_action", None)
        if add_subcommands and action is not None:
            for name, description in _OWN_SUBCOMMANDS.items():
                action.add_subcommand(name, self.parser_class(description=description), help=description)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand in _OWN_SUBCOMMANDS:  # e.g. "lightning-loco --config x.yaml export": main() did not see it
            cli_errors.fail(PROG, f"'{subcommand}' must be the first argument: '{PROG} {subcommand} --help'.")

    def before_instantiate_classes(self) -> None:
        self._check_ckpt_path()
        self._check_strategy_name()
        for class_type, key in _CHECKED:
            self.parser.add_instantiator(self._instantiator(key), class_type, subclasses=True)

    def _instantiator(self, key: str) -> Any:
        def instantiate(class_type: type, *args: Any, **kwargs: Any) -> Any:
            try:
                return class_type(*args, **kwargs)
            except (ValueError, TypeError) as err:
                # jsonargparse goes on to try the other types this key accepts and reports them all;
                # remember the class's own error so that it can be shown alone.
                self._rejected = (class_type, key, err)
                raise

        return instantiate

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as failure:
            if self._rejected is None:
                raise
            class_type, key, err = self._rejected
            if str(err).splitlines()[0] not in _messages(failure):
                raise  # failed for some other reason
            name = cli_errors.public_name(class_type)
            self._exit(
                f"{type(err).__name__}: {err}\n"
                f"(from {key}: {name}; '{PROG} {self.subcommand} --{key}.help {name}' lists its arguments)"
            )

    def _check_ckpt_path(self) -> None:
        ckpt_path = self.config[self.subcommand].get("ckpt_path") if self.subcommand else None
        if not ckpt_path or ckpt_path in _SPECIAL_CKPT_PATHS or str(ckpt_path).startswith("registry"):
            return
        path = str(ckpt_path)
        if "://" in path and not path.startswith("file://"):
            return  # remote storage: left to the Trainer
        path = path.removeprefix("file://")
        if not os.path.exists(path):
            self._exit(f"--ckpt_path {ckpt_path}: no such file or directory (nothing was started).")

    def _check_strategy_name(self) -> None:
        """A strategy name that Lightning would reject only once the Trainer is built, with a traceback
        whose examples do not list ours."""
        strategy = self.config[self.subcommand].get("trainer.strategy") if self.subcommand else None
        if isinstance(strategy, str):
            message = cli_errors.unknown_strategy_name(strategy)
            if message is not None:
                self._exit(message)

    def _exit(self, message: str) -> NoReturn:
        cli_errors.fail(f"{PROG} {self.subcommand}", message)


def _messages(failure: BaseException) -> str:
    """The text of an exception and of every exception it was raised from or during."""
    texts, seen = [], set()
    current: Optional[BaseException] = failure
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts.append(str(current))
        current = current.__cause__ or current.__context__
    return "\n".join(texts)


def group_help(args: list[str]) -> bool:
    """``--trainer.strategy.wire.help`` (or ``.pacing``, ``.replica_sharding``, ``.elastic``; with or without
    ``init_args``): prints the fields of that option group with their docs and returns True. jsonargparse lists
    these flags in a strategy's help but cannot answer them from inside a ``class_path``."""
    from jsonargparse import ArgumentParser

    from lightning_loco.replica.options import GROUPS

    for arg in args:
        key, _, _ = arg.partition("=")
        parts = key.removeprefix("--").split(".")
        if len(parts) >= 4 and parts[:2] == ["trainer", "strategy"] and parts[-1] == "help":
            name = ".".join(p for p in parts[2:-1] if p != "init_args")
            if name in GROUPS:
                group = GROUPS[name]
                parser = ArgumentParser(prog=f"{PROG} fit", description=(group.__doc__ or "").split("\n\n")[0])
                parser.add_class_arguments(group, nested_key=f"trainer.strategy.init_args.{name}")
                parser.print_help()
                return True
    return False


def main(argv: Optional[list[str]] = None) -> None:
    """Runs the command on ``argv`` (default: the command line)."""
    args = sys.argv[1:] if argv is None else argv
    if group_help(args):
        sys.exit(0)  # as argparse's own help does
    # Like `python -m`: class paths in configs may name modules of the current folder (mine.mymod.MyMLP).
    # The console script's own sys.path starts with its bin folder instead.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if args and args[0] == "export":
        export(args[1:])
        return
    if args and args[0] == "lighthouse":
        from lightning_loco.elastic import lighthouse

        lighthouse.main(args[1:])
        return
    LocoCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": PROG, "description": DESCRIPTION},
        # None reads the command line itself; Lightning warns when given a list and a command line.
        args=argv,
    )


if __name__ == "__main__":
    main()
