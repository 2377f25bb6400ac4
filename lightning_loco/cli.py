"""The ``lightning-loco`` command.

``lightning-loco fit|validate|test|predict ...`` is Lightning's ``LightningCLI`` (jsonargparse) with
this package imported, so the strategy names "noloco", "diloco" and "gasloc" always resolve and
``--trainer.strategy.help lightning_loco.NoLoCoStrategy`` lists every argument with its paper
symbol and default. Model and data are chosen by ``class_path`` in the config (see
``examples/shakespeare/``).

``lightning-loco export CHECKPOINT OUTPUT [--state-dict-only]`` writes the consensus model of a
checkpoint as one plain file (see ``lightning_loco.checkpoints.export_consensus``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import lightning_loco  # noqa: F401  (registers the strategy names)
from lightning.pytorch.cli import LightningCLI
from lightning_loco.checkpoints import export_consensus


def export(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-loco export", description="Write the consensus model of a checkpoint as one plain file."
    )
    parser.add_argument("checkpoint", help="a checkpoint written by a lightning_loco strategy (or any Lightning one)")
    parser.add_argument("output", help="the file to write")
    parser.add_argument("--state-dict-only", action="store_true", help="write only the model's state_dict")
    args = parser.parse_args(argv)
    path = export_consensus(args.checkpoint, args.output, state_dict_only=args.state_dict_only)
    print(f"wrote {path}")


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "export":
        export(argv[1:])
        return
    LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=argv,
    )


if __name__ == "__main__":
    main()
