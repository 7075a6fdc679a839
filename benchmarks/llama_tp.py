"""The tests' Llama as a LightningCLI entry: one ``configure_model`` with tensor parallelism, run under either strategy.

``LlamaTP`` is ``lightning_zeropp.testing.models.LlamaModule`` (torch's usual tensor-parallel plan over the mesh's
``"tensor_parallel"`` dimension, then ``fully_shard`` on every block and the root over ``"data_parallel"``) with its
shape as arguments and the FSDP mixed precision that Lightning's own tensor-parallel example passes to ``fully_shard``
(bf16 weights gathered, fp32 gradients reduced: ``ModelParallelStrategy`` leaves FSDP's precision to the user's
``configure_model``). The data are the example GPT's byte corpus (``examples/gpt/data.py``: the standard library's
source, never downloaded), in sequences of ``max_seq_len`` bytes. ``benchmarks/cluster.py`` runs it for its
tensor-parallel topologies (``2x4t2``, ``2x4t4``) under ``ModelParallelStrategy`` and ``ZeroPPStrategy`` alike; by hand,
4 ranks as t = 2 inside a data-parallel dimension of 2:

    python benchmarks/llama_tp.py fit --trainer.accelerator cpu --trainer.devices 4 --trainer.max_steps 3 \\
        --trainer.strategy lightning.pytorch.strategies.ModelParallelStrategy \\
        --trainer.strategy.data_parallel_size 2 --trainer.strategy.tensor_parallel_size 2
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.cli import LightningCLI

from lightning_zeropp.testing.models import LLAMA, LlamaModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from data import ByteCorpusDataModule  # examples/gpt/data.py

Dtype = Literal["float32", "bfloat16"]


class LlamaTP(LlamaModule):
    """``LlamaModule`` with its shape as arguments and FSDP's mixed precision chosen.

    Args:
        vocab_size, n_layer, dim, n_head, n_kv_head, ffn_hidden, max_seq_len: ``TinyLlama``'s shape (defaults:
            ``LLAMA``); n_head and n_kv_head must divide by the tensor-parallel size, max_seq_len too (sequence
            parallelism splits the sequence between the blocks' matmuls).
        param_dtype: dtype of the weights FSDP gathers and computes with (Lightning's example: bfloat16).
        reduce_dtype: dtype of FSDP's gradient reduction (Lightning's example, torchtitan's default: float32).
        lr: AdamW's learning rate.
        seed: the initial weights' seed, the same on every rank (the plan takes the norms' weights as replicas).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        n_layer: int = LLAMA["n_layer"],
        dim: int = LLAMA["dim"],
        n_head: int = LLAMA["n_head"],
        n_kv_head: int = LLAMA["n_kv_head"],
        ffn_hidden: int = LLAMA["ffn_hidden"],
        max_seq_len: int = LLAMA["max_seq_len"],
        param_dtype: Dtype = "bfloat16",
        reduce_dtype: Dtype = "float32",
        lr: float = 1e-3,
        seed: int = 0,
    ) -> None:
        shape = dict(vocab_size=vocab_size, n_layer=n_layer, dim=dim, n_head=n_head, n_kv_head=n_kv_head,
                     ffn_hidden=ffn_hidden, max_seq_len=max_seq_len)  # fmt: skip
        super().__init__(lr=lr, seed=seed, model=shape)
        self.save_hyperparameters()
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from lightning_zeropp.testing.models import parallelize_llama

        mesh = self.device_mesh
        parallelize_llama(self.model, mesh["tensor_parallel"], self.sequence_parallel)
        param, reduce = getattr(torch, self.param_dtype), getattr(torch, self.reduce_dtype)
        mp = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh["data_parallel"], mp_policy=mp)
        fully_shard(self.model, mesh=mesh["data_parallel"], mp_policy=mp)


class LlamaCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.max_seq_len", "data.block_size")


def main(args: list[str] | None = None) -> None:
    import lightning_zeropp  # noqa: F401  (registers the "zeropp" strategy names)

    LlamaCLI(LlamaTP, ByteCorpusDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
