"""A small GPT (byte-level) as a LightningModule, built in ``configure_model`` so large configs can start on meta."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"GPT: n_embd={n_embd} must be a multiple of n_head={n_head}.")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks in an ``nn.ModuleList``, a head tied to the embedding."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.n_layer = n_layer
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        for block in self.blocks:  # GPT-2: scale the residual projections by depth
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.block_size:
            raise ValueError(f"GPT: sequence length {T} exceeds block_size={self.block_size}.")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTModule(LightningModule):
    """Byte-level GPT language model.

    Args:
        vocab_size: 256 for bytes.
        block_size: context length.
        n_layer, n_head, n_embd: transformer shape.
        dropout: dropout in attention.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay on matrices (not on biases, norms and embeddings).
        warmup_steps: linear warm-up steps, then cosine decay to 10% over ``decay_steps``.
        decay_steps: steps of the cosine decay (after warm-up); ``None`` keeps the peak rate.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        decay_steps: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: GPT | None = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        h = self.hparams
        self.net = GPT(h.vocab_size, h.block_size, h.n_layer, h.n_head, h.n_embd, h.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if p.requires_grad:  # decay matrices; not biases, norms or embeddings (the tied head is the embedding)
                (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.learning_rate,
            betas=(0.9, 0.95),
        )
        warmup, decay_steps = self.hparams.warmup_steps, self.hparams.decay_steps

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if not decay_steps:
                return 1.0
            progress = min(1.0, (step - warmup) / decay_steps)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
