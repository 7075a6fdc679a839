"""The baseline a Lightning user would otherwise write: ``ModelParallelStrategy`` and ``fully_shard`` per block.

``FSDPGPTModule`` is the example's ``GPTModule`` sharded the way Lightning's and torchtitan's FSDP2 guides do it:
``fully_shard`` on every transformer block, then on the model, on the strategy's data-parallel mesh, with
torchtitan's default mixed precision (bf16 compute and all-gather, fp32 gradient reduction). Run it with the
example's CLI and config format, and a strategy that spans every rank in one data-parallel dimension:

    python benchmarks/fsdp_baseline.py fit --config examples/gpt/configs/cpu_demo.yaml \\
        --trainer.strategy lightning.pytorch.strategies.ModelParallelStrategy \\
        --trainer.strategy.data_parallel_size 4 --trainer.strategy.tensor_parallel_size 1 --trainer.callbacks=[]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from model import GPTModule


class FSDPGPTModule(GPTModule):
    """``GPTModule`` that shards itself in ``configure_model`` (for ``ModelParallelStrategy``).

    Args:
        reduce_dtype: dtype of the gradient reduce-scatter under bf16 compute (torchtitan's default: float32).
        **kwargs: ``GPTModule``'s arguments.
    """

    def __init__(self, *args, reduce_dtype: Literal["float32", "bfloat16"] = "float32", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reduce_dtype = reduce_dtype

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.net is not None:
            return
        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, self.reduce_dtype))
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(self.net, mesh=mesh, mp_policy=mp)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
    from data import ByteCorpusDataModule
    from train import GPTCLI

    GPTCLI(FSDPGPTModule, ByteCorpusDataModule, save_config_kwargs={"overwrite": True})
