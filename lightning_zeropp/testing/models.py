"""Small models shaped like real ones, for tests of sharding and quantization on CPU gloo ranks.

:class:`TinyLM` is a causal transformer language model (a few thousand parameters, trains in a fraction of a second)
with the features of a real one that sharding and quantization must get right::

    tokens ─> tok_emb (131 x 27) ─┐                       tied: head.weight IS tok_emb.weight, one parameter that
    positions ─> pos_emb (16 x 27)┴─> + ─> blocks ─> ln_f ─> head (27 -> 131)   sits in the root's FSDP unit
                                            │
              nn.ModuleList of Block:  ln1 ─> attn.qkv (27 -> 81, bias) ─> attn.proj (27 -> 27, bias) ─> +
                                       ln2 ─> mlp.fc (27 -> 61, bias) ─> GELU ─> mlp.proj (61 -> 27, bias) ─> +

Every size is odd and none divides by 2 or 4: FSDP pads dim 0 of every parameter on 2 or 4 ranks, and the
quantizers' blocks end in partial tails. 1-D parameters (norms, biases) sit right next to matrices in each unit.
Every parameter starts with distinct random values (norm weights near 1, biases near 0, never all-equal), so a
gather that swaps, drops or zeroes a slice changes the loss from the first step.

:class:`TinyLlama` has the shapes tensor parallelism meets in a Llama (see :data:`LLAMA`), and
:func:`parallelize_llama` applies torch's usual plan to it::

    tokens ─> embed_tokens (131 x 48, RowwiseParallel) ─> layers ─> norm ─> lm_head (ColwiseParallel), tied: one
                                                                              parameter, vocabulary rows split
    LlamaBlock: input_layernorm (RMSNorm) ─> q/k/v_proj (colwise; 6 query heads, 2 key/value heads of 8, RoPE)
                ─> o_proj (rowwise) ─> + ─> post_attention_layernorm ─> gate_proj, up_proj (colwise, 136)
                ─> SiLU(gate) * up ─> down_proj (rowwise) ─> +

No biases, as in Llama. FSDP splits each tensor-parallel piece again over the data-parallel ranks, into odd rows
(on 2 or 4 of them: 12 or 6 of a query projection, 4 or 2 of a key/value one, 34 or 17 of gate and up, 33 or 17 of
the vocabulary, padded), so every parameter's shard ends in a partial quantization block, the norms' beside matrices.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

__all__ = [
    "LLAMA",
    "TINY",
    "Block",
    "LlamaBlock",
    "TinyLM",
    "TinyLlama",
    "TinyTransformer",
    "freeze_all_but_biases_and_norms",
    "make_batches",
    "parallelize_llama",
]

TINY = dict(vocab_size=131, block_size=16, n_layer=2, n_head=3, n_embd=27, mlp_hidden=61)
"""The default shape of :class:`TinyLM`."""


class Attention(nn.Module):
    """Causal multi-head self-attention: one fused ``qkv`` projection and an output ``proj``, both with biases."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"Attention: n_embd={n_embd} must be a multiple of n_head={n_head}.")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, hidden)
        self.proj = nn.Linear(hidden, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-norm transformer block; the class name is what ``auto_wrap_policy`` and
    ``activation_checkpointing_policy`` select in tests (``["Block"]``)."""

    def __init__(self, n_embd: int, n_head: int, mlp_hidden: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Token and position embeddings, ``n_layer`` :class:`Block` s in an ``nn.ModuleList``, a final LayerNorm and
    an output head tied to the token embedding."""

    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, mlp_hidden: int, dropout: float
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, mlp_hidden, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.normal_(module.bias, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.normal_(module.weight, mean=1.0, std=0.1)
                nn.init.normal_(module.bias, std=0.02)
        for block in self.blocks:  # GPT-2: the residual projections scaled by depth
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * len(self.blocks)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.block_size:
            raise ValueError(f"TinyTransformer: sequence length {T} exceeds block_size={self.block_size}.")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TinyLM(LightningModule):
    """:class:`TinyTransformer` as a LightningModule, trained with SGD + momentum at a constant learning rate.

    The network is built in ``configure_model`` (as large models are, so the strategy can shard it as it is made);
    with ``init_path`` its initial weights are loaded from that file (a ``state_dict`` of the network), so every
    run of a test starts from the same point. SGD and not Adam: Adam divides by the root of the squared gradient,
    so a parameter whose true gradient is zero (the key bias: softmax ignores it) turns rounding noise into
    full-size steps, and a parity check would measure that noise instead of the strategy.

    Args:
        init_path: a file saved from ``TinyLM().net.state_dict()``; ``None``: random initial weights.
        vocab_size, block_size, n_layer, n_head, n_embd, mlp_hidden: the shape (defaults: :data:`TINY`).
        dropout: attention dropout while training.
        lr, momentum: SGD's.
    """

    def __init__(
        self,
        init_path: str | None = None,
        *,
        vocab_size: int = TINY["vocab_size"],
        block_size: int = TINY["block_size"],
        n_layer: int = TINY["n_layer"],
        n_head: int = TINY["n_head"],
        n_embd: int = TINY["n_embd"],
        mlp_hidden: int = TINY["mlp_hidden"],
        dropout: float = 0.0,
        lr: float = 0.3,
        momentum: float = 0.9,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore="init_path")  # a checkpoint must not depend on the test's temporary file
        self.init_path = init_path
        self.net: TinyTransformer | None = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        h = self.hparams
        self.net = TinyTransformer(h.vocab_size, h.block_size, h.n_layer, h.n_head, h.n_embd, h.mlp_hidden, h.dropout)
        if self.init_path is not None:
            self.net.load_state_dict(torch.load(self.init_path, weights_only=True))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy of a batch ``(inputs, targets)``, computed in fp32."""
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val/loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def freeze_all_but_biases_and_norms(model: TinyLM) -> None:
    """Freezes every matrix and embedding of ``model.net``, as when fine-tuning only a few parameters."""
    for p in model.net.parameters():
        p.requires_grad_(p.dim() < 2)


def make_batches(
    n_samples: int, block_size: int = TINY["block_size"], vocab_size: int = TINY["vocab_size"], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n_samples`` windows of ``block_size`` tokens and their next tokens: a noisy periodic sequence over the
    vocabulary (learnable, not random)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(n_samples * (block_size + 1)) % 97
    noise = torch.randint(0, 3, base.shape, generator=g)
    seq = ((base + noise) * 7 % vocab_size).view(n_samples, block_size + 1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


LLAMA = dict(vocab_size=131, n_layer=2, dim=48, n_head=6, n_kv_head=2, ffn_hidden=136, max_seq_len=16)
"""The default shape of :class:`TinyLlama`: head size 8; with 2 tensor-parallel ranks, 3 query heads and 1 key/value
head each, 68 of the SwiGLU's hidden units, 66 or 65 rows of the vocabulary (uneven, as DTensor allows)."""


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, sequence, heads, head size) in the half-split layout."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    """Grouped-query causal attention with rotary positions and no biases. The head counts come from the
    projections' outputs, so the module runs unchanged on the heads a tensor-parallel rank holds."""

    def __init__(self, dim: int, n_head: int, n_kv_head: int, max_seq_len: int) -> None:
        super().__init__()
        if dim % n_head or n_head % n_kv_head:
            raise ValueError(
                f"LlamaAttention: dim={dim} must be a multiple of n_head={n_head}, and n_head of n_kv_head={n_kv_head}."
            )
        self.head_dim = dim // n_head
        self.q_proj = nn.Linear(dim, n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * self.head_dim, dim, bias=False)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq).repeat(1, 2)  # (sequence, head size)
        self.register_buffer("cos", angles.cos()[:, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[:, None, :], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        q, k, v = (proj(x).view(B, T, -1, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = self.cos[:T], self.sin[:T]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, n_kv_head: int, ffn_hidden: int, max_seq_len: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim, eps=1e-5)
        self.self_attn = LlamaAttention(dim, n_head, n_kv_head, max_seq_len)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=1e-5)
        self.mlp = SwiGLU(dim, ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """A Llama in miniature (:data:`LLAMA`, HF's names): token embedding tied to the output head, pre-norm blocks of
    RMSNorm, grouped-query attention with rotary positions and a SwiGLU MLP, a final RMSNorm; no biases."""

    def __init__(
        self,
        vocab_size: int = LLAMA["vocab_size"],
        n_layer: int = LLAMA["n_layer"],
        dim: int = LLAMA["dim"],
        n_head: int = LLAMA["n_head"],
        n_kv_head: int = LLAMA["n_kv_head"],
        ffn_hidden: int = LLAMA["ffn_hidden"],
        max_seq_len: int = LLAMA["max_seq_len"],
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, n_head, n_kv_head, ffn_hidden, max_seq_len) for _ in range(n_layer))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.RMSNorm):  # near 1, never all-equal: a norm that does not train shows
                nn.init.normal_(module.weight, mean=1.0, std=0.1)
        for layer in self.layers:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * len(self.layers)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def parallelize_llama(model: TinyLlama, mesh: Any, sequence_parallel: bool = True) -> TinyLlama:
    """Applies torch's usual tensor-parallel plan to ``model`` on the 1-D ``mesh`` (the ``"tensor_parallel"``
    dimension): query/key/value, gate and up projections colwise, output and down projections rowwise, the embedding
    rowwise (vocabulary rows) and the head colwise (the same rows), tied again afterwards; with ``sequence_parallel``
    the norms are SequenceParallel and the activations between the blocks' matmuls are split along the sequence
    (the sequence length must then divide by the mesh's size), otherwise replicated, the norms plain parameters.

    ``parallelize_module`` replaces each parameter it distributes, so the embedding and the head come out as two;
    both hold the vocabulary's rows split the same way (``Shard(0)``), so the head takes the embedding's parameter
    back and the model keeps one. SequenceParallel takes each rank's norm weights as replicas without checking them:
    every rank must build the model from the same seed (or load the same weights).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    between = Shard(1) if sequence_parallel else Replicate()  # the layout of the residual stream
    root_plan: dict[str, Any] = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    block_plan: dict[str, Any] = {
        "self_attn": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=between),
        "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        root_plan["norm"] = SequenceParallel()
        block_plan["input_layernorm"] = SequenceParallel()
        block_plan["post_attention_layernorm"] = SequenceParallel()
    parallelize_module(model, mesh, root_plan)
    model.lm_head.weight = model.embed_tokens.weight
    for layer in model.layers:
        parallelize_module(layer, mesh, block_plan)
    return model


class LlamaModule(LightningModule):
    """:class:`TinyLlama` as a user of Lightning's ModelParallelStrategy writes it: in ``configure_model`` the Llama
    plan (:func:`parallelize_llama`) over ``device_mesh["tensor_parallel"]``, then ``fully_shard`` on every block and
    the root over ``device_mesh["data_parallel"]``; next-token cross-entropy; AdamW at ``lr``. ``seed`` makes the same
    initial weights on every rank (the plan requires it); ``model`` overrides :data:`LLAMA`'s shape."""

    def __init__(
        self, sequence_parallel: bool = True, lr: float = 1e-2, seed: int = 0, model: dict[str, int] | None = None
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = TinyLlama(**(model or {}))
        self.sequence_parallel, self.lr = sequence_parallel, lr

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh
        parallelize_llama(self.model, mesh["tensor_parallel"], self.sequence_parallel)
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(self.model, mesh=mesh["data_parallel"])

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        logits = self.model(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
