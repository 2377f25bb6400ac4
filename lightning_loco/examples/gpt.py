"""A small GPT as a LightningModule: causal self-attention blocks, AdamW, warmup then cosine decay.

Its training step adds no collective of its own (no ``sync_dist=True`` on per-step logs), so a run
shows only the strategy's communication.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, cast

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.ln2(x))


class GPT(L.LightningModule):
    """Args:
        vocab_size: tokens in the vocabulary (256 for bytes).
        block_size: the longest context.
        n_layer: transformer blocks.
        n_head: attention heads per block.
        n_embd: width.
        dropout: dropout probability.
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay (not applied to biases and norms).
        warmup_steps: linear warmup length in optimizer steps.
        max_steps: length of the cosine decay (to lr/10), in optimizer steps.

    Under a strategy that paces rounds by time (``sync_seconds``), where every replica takes its own
    number of steps, the schedule follows the run's nominal progress (``strategy.nominal_step``: t·H
    plus the share of the current inner phase) instead of this replica's own step count, so that
    every replica warms up and decays at the same wall time and ends the run at lr/10.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        max_steps: int = 1000,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        mask = torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), 1)
        self.register_buffer("mask", mask, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Small initial weights (as in GPT-2): with tied embeddings, PyTorch's N(0, 1) embedding init
        # would start the loss far above that of a uniform guess.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        mask = cast(torch.Tensor, self.mask)  # a buffer: nn.Module's attributes are typed loosely
        for block in self.blocks:
            x = block(x, mask[:t, :t])
        return self.head(self.ln_f(x))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        # Once per validation epoch, averaged over replicas: the mean replica loss.
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        hp: Any = self.hparams
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=(0.9, 0.95),
        )

        # under sync_seconds the schedule follows the run's nominal progress, not this replica's own step count
        strategy = lambda: getattr(self._trainer, "strategy", None)  # noqa: E731
        scheduler = warmup_cosine(optimizer, hp.warmup_steps, hp.max_steps,
                                  nominal=lambda: getattr(strategy(), "nominal_step", None))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int,
                  nominal: Optional[Callable[[], Optional[float]]] = None) -> Any:
    """The learning-rate schedule of :class:`GPT`, per optimizer step: linear warm-up over ``warmup_steps``,
    then cosine decay to a tenth of the peak at ``max_steps``. ``nominal``, where it gives a number, is the
    step to use instead of the optimizer's count (the run's nominal progress under ``sync_seconds``)."""

    def schedule(step: float) -> float:
        progress_step = nominal() if nominal is not None else None
        step = step if progress_step is None else progress_step
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
