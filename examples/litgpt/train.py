"""A litgpt model (``litgpt.GPT``, Llama-style: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP)
trained with ZeRO++ through Fabric, in the loop of ``examples/fabric/train.py``.

    pip install -e ".[litgpt]"
    python examples/litgpt/train.py                  # 4 CPU processes acting as 2 nodes x 2 ranks
    python examples/litgpt/train.py --strategy zero3

The model is built from a small ``litgpt.Config`` with random weights (nothing is downloaded); its vocabulary is
the 256 byte values of the corpus (the Python standard library's source). The loop's arguments all apply
(``--steps``, ``--accumulate``, ``--checkpoint``, ...); ``--n-query-groups`` and ``--intermediate-size`` shape the
attention and the MLP. ZeRO++ shards each ``litgpt.model.Block`` as one unit (the elements of the outermost
``nn.ModuleList``), and the embedding, final norm and head as the root's.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from litgpt import GPT, Config

_LOOP = Path(__file__).resolve().parents[1] / "fabric" / "train.py"
_spec = importlib.util.spec_from_file_location("fabric_example_train", _LOOP)
loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loop)


def build_litgpt(args: argparse.Namespace) -> GPT:
    config = Config(
        name="zeropp-tiny-llama",
        block_size=args.block_size,
        vocab_size=256,
        padded_vocab_size=256,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        n_query_groups=args.n_query_groups,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=args.intermediate_size,
    )
    return GPT(config)


def main(argv: list[str] | None = None) -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--n-query-groups", type=int, default=2, help="key/value heads (grouped-query attention)")
    extra.add_argument("--intermediate-size", type=int, default=344, help="the SwiGLU MLP's hidden size")
    ours, rest = extra.parse_known_args(sys.argv[1:] if argv is None else argv)

    def build(args: argparse.Namespace) -> GPT:
        args.n_query_groups, args.intermediate_size = ours.n_query_groups, ours.intermediate_size
        return build_litgpt(args)

    if "--log-dir" not in rest:
        rest += ["--log-dir", "runs/litgpt_demo"]
    loop.main(rest, build)


if __name__ == "__main__":
    main()
