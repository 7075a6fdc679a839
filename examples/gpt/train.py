"""Train the byte-level GPT with LightningCLI.

python examples/gpt/train.py fit --config examples/gpt/configs/cpu_demo.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import ByteCorpusDataModule
from model import GPTModule

import lightning_zeropp  # noqa: F401  (registers the "zeropp" and "zero3" strategies)


class GPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.block_size", "data.block_size")


def main(args: list[str] | None = None) -> None:
    GPTCLI(GPTModule, ByteCorpusDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
