"""The torchrun dialect's network: a tiny GPT-2 written with torch.nn alone, as a plain
`torchrun train.py` script writes its own model.

Its ranks import torch and nothing else: transformers' import costs every rank about two
seconds of CPU, and the devcluster runs many ranks on two cores. The layout and names are
GPT-2's (`transformer.wte`, `transformer.h.N.attn`, `.mlp`, `lm_head` tied to the embedding),
so the injection's hooks find the same modules and a checkpoint holds the same keys; the hf
dialect keeps transformers' own GPT-2 (`realtrain.hf.tiny_gpt2`), which its Trainer needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional

from realtrain.data import TINY_HEADS, TINY_HIDDEN, TINY_LAYERS, TINY_SEQ, TINY_VOCAB

# GPT-2's initialisation: weights from N(0, 0.02), biases zero.
INIT_STD = 0.02
MLP_EXPANSION = 4


@dataclass(frozen=True)
class LMOutput:
    """What a forward returns: the mean next-token loss (when labels are given) and the logits."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden_states.shape
        query, key, value = (
            part.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for part in self.c_attn(hidden_states).split(width, dim=2)
        )
        attended = functional.scaled_dot_product_attention(query, key, value, is_causal=True)
        projected: torch.Tensor = self.c_proj(
            attended.transpose(1, 2).reshape(batch, length, width)
        )
        return projected


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(hidden, MLP_EXPANSION * hidden)
        self.c_proj = nn.Linear(MLP_EXPANSION * hidden, hidden)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        projected: torch.Tensor = self.c_proj(
            functional.gelu(self.c_fc(hidden_states), approximate="tanh")
        )
        return projected


class Block(nn.Module):
    """GPT-2's pre-norm block: attention, then the MLP, each added to the residual stream."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attn_output: torch.Tensor = self.attn(self.ln_1(hidden_states))
        hidden_states = hidden_states + attn_output
        feed_forward_hidden_states: torch.Tensor = self.mlp(self.ln_2(hidden_states))
        return hidden_states + feed_forward_hidden_states


class Transformer(nn.Module):
    def __init__(self, vocab: int, positions: int, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(positions, hidden)
        self.h = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden_states = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden_states = block(hidden_states)
        normed: torch.Tensor = self.ln_f(hidden_states)
        return normed


class TinyGPT(nn.Module):
    """A causal language model; takes the batches transformers' GPT-2 takes (input_ids, an
    all-ones attention_mask, labels equal to input_ids, shifted here) and greedy `generate`."""

    def __init__(
        self,
        vocab: int = TINY_VOCAB,
        positions: int = TINY_SEQ,
        hidden: int = TINY_HIDDEN,
        layers: int = TINY_LAYERS,
        heads: int = TINY_HEADS,
    ) -> None:
        super().__init__()
        self.positions = positions
        self.transformer = Transformer(vocab, positions, hidden, layers, heads)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.apply(_init_weights)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> LMOutput:
        # The data is never padded; a mask that hides tokens would be silently ignored here.
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("TinyGPT takes unpadded sequences only (an all-ones mask)")
        hidden_states = self.transformer(input_ids)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
            )
        return LMOutput(loss=loss, logits=logits)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: the prompt and `max_new_tokens` tokens, each the likeliest next."""
        tokens = input_ids
        for _ in range(max_new_tokens):
            logits = self(input_ids=tokens[:, -self.positions :]).logits
            tokens = torch.cat([tokens, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
        return tokens


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def tiny_gpt(seed: int = 0) -> TinyGPT:
    """The same random weights on every rank (DDP checks they agree)."""
    torch.manual_seed(seed)
    return TinyGPT()
