"""The ops that produce a float8 layer's input, moved into the activation kernel
(`float8_activations.float8_rows`), so that what they produce is never written in bf16 and
read back: a feed-forward's tanh-GELU, read by its second layer's kernel, and FLUX.1's
single block's concatenation of its attention output and its MLP's GELU, read by
`proj_out`'s kernel from where the two lie.

Both apply to layers `use_float8_rows` switched (`--quantize fp8`). The float8 values are
torchao's scaling of torch's GELU output, but where the kernel's GELU rounds to another bf16
value than Inductor's (libdevice's tanh on both sides, so rarely), one float8 step apart.
Each checks as it runs that its layer is still a `Float8RowsLinear`: one wrapped by PEFT
(the load-and-fuse and hotswap baselines) gets diffusers' own forward.
"""

import logging
from typing import Any

import torch
from diffusers.models.activations import GELU
from diffusers.models.attention import FeedForward
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock
from torch import nn

from .float8_activations import Float8RowsLinear

logger = logging.getLogger(__name__)


class Float8FeedForward(FeedForward):
    """diffusers' feed-forward (tanh-GELU module, dropout, linear) whose second layer, a
    `Float8RowsLinear`, applies the GELU to the first layer's output as its kernel reads it.
    Where that layer is something else (wrapped by PEFT for a baseline, say) or dropout
    drops, it is diffusers' own."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        first, dropout, second = self.net
        if type(second) is not Float8RowsLinear or (self.training and dropout.p):
            return super().forward(hidden_states, *args, **kwargs)
        return second(first.proj(hidden_states), gelu=True)


def _takes_gelu_into_next(layer: nn.Module) -> bool:
    """diffusers' `FeedForward` as tanh-GELU module, dropout, a `Float8RowsLinear`."""
    net = getattr(layer, "net", None)
    return (type(layer) is FeedForward and len(net) == 3 and type(net[0]) is GELU and net[0].approximate == "tanh"
            and isinstance(net[1], nn.Dropout) and type(net[2]) is Float8RowsLinear)


class Float8SingleBlock(FluxSingleTransformerBlock):
    """FLUX.1's single block (diffusers' forward, line for line) whose `proj_out`, a
    `Float8RowsLinear`, reads the attention output and the MLP's output before its GELU
    where they lie: its kernel applies the GELU and writes the float8 concatenation. Where
    `proj_out` is something else, it is diffusers' own."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                joint_attention_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if type(self.proj_out) is not Float8RowsLinear:
            return super().forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                   joint_attention_kwargs)
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        residual = hidden_states
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        mlp_hidden_states = self.proj_mlp(norm_hidden_states)  # the GELU: in proj_out's kernel
        attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                                **(joint_attention_kwargs or {}))
        hidden_states = residual + gate.unsqueeze(1) * self.proj_out(attn_output, gelu_tail=mlp_hidden_states)
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def _takes_single_block(layer: nn.Module) -> bool:
    return (type(layer) is FluxSingleTransformerBlock and type(layer.proj_out) is Float8RowsLinear
            and type(layer.act_mlp) is nn.GELU and layer.act_mlp.approximate == "tanh")


def use_float8_producers(module: nn.Module) -> int:
    """Every producer of a float8 layer's input in `module` that the kernel can take over
    moved into it (feed-forwards' GELU, FLUX.1's single blocks); returns how many."""
    blocks = [layer for layer in module.modules() if _takes_single_block(layer)]
    for block in blocks:
        block.__class__ = Float8SingleBlock
    feed_forwards = [layer for layer in module.modules() if _takes_gelu_into_next(layer)]
    for layer in feed_forwards:
        layer.__class__ = Float8FeedForward
    for layer in module.modules():  # regional compile finds its blocks by class name
        repeated = getattr(layer, "_repeated_blocks", None)
        if blocks and repeated and FluxSingleTransformerBlock.__name__ in repeated \
                and Float8SingleBlock.__name__ not in repeated:
            layer._repeated_blocks = [*repeated, Float8SingleBlock.__name__]
    changed = len(blocks) + len(feed_forwards)
    if changed:
        logger.info("%s: %d float8 layers apply their input's GELU in the activation kernel",
                    type(module).__name__, changed)
    return changed


def restore_producers(module: nn.Module) -> None:
    """Undo `use_float8_producers`: each producer applies its own GELU again."""
    for layer in module.modules():
        if type(layer) is Float8SingleBlock:
            layer.__class__ = FluxSingleTransformerBlock
        elif type(layer) is Float8FeedForward:
            layer.__class__ = FeedForward
