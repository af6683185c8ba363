"""Activation memory of a decoder transformer: the part of the peak ZeRO does not shard.

Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", eq. (1): one layer stores s*b*h*(34 + 5*a*s/h) bytes with
16-bit activations, no tensor or sequence parallelism. The 5*a*s/h term is the
attention score/softmax/dropout tensors; a fused (flash / SDPA) attention kernel
does not store them. With full activation checkpointing each layer keeps only its
16-bit input (2*s*b*h bytes) and one layer is recomputed at a time. Those kept inputs are
what activation offload moves to the host or NVMe (`memory.Strategy.activation_offload`).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.policies import ConfigError

__all__ = ["ActivationEstimate", "activation_bytes", "BYTES_PER_LAYER_COEF", "ATTN_SCORE_COEF",
           "CHECKPOINT_INPUT_COEF", "LOGITS_BYTES_PER_ELEMENT"]

BYTES_PER_LAYER_COEF = 34  # Korthikanti eq. (1): bytes per s*b*h per layer, 16-bit, without scores
ATTN_SCORE_COEF = 5  # Korthikanti eq. (1): bytes per a*s*s*b per layer (scores, softmax, dropout mask)
CHECKPOINT_INPUT_COEF = 2  # one 16-bit copy of each layer's input under full checkpointing
# bf16 logits plus the fp32 copy the cross-entropy upcasts to (HF LlamaForCausalLM does this).
LOGITS_BYTES_PER_ELEMENT = 2 + 4


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes per device for one micro-batch; not divided by N under any ZeRO stage."""

    per_layer: int  # one layer, stored for backward (without checkpointing)
    stored: int  # all layers, what is kept between forward and backward
    recompute: int  # extra working set while one checkpointed layer is recomputed
    logits: int
    total: int
    checkpointing: bool
    flash_attention: bool
    checkpoint_input: int = 0  # one layer's kept input under checkpointing (what activation offload moves)


def activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int, layers: int, vocab: int,
                     checkpointing: bool = False, flash_attention: bool = True,
                     act_bytes: int = 2) -> ActivationEstimate:
    """Peak activation bytes on one device for a decoder of `layers` layers.

    act_bytes: 2 for bf16/fp16 activations; 4 doubles every term (fp32 training)."""
    for name, v in (("sequence length", seq), ("micro-batch", micro_batch), ("hidden", hidden),
                    ("heads", heads), ("layers", layers), ("vocab", vocab)):
        if v <= 0:
            raise ConfigError(f"{name} must be positive, got {v}")
    s, b, h, a = seq, micro_batch, hidden, heads
    scale = act_bytes / 2
    coef = BYTES_PER_LAYER_COEF * s * b * h
    if not flash_attention:
        coef += ATTN_SCORE_COEF * a * s * s * b
    per_layer = int(coef * scale)
    logits = s * b * vocab * LOGITS_BYTES_PER_ELEMENT
    if checkpointing:
        checkpoint_input = int(CHECKPOINT_INPUT_COEF * s * b * h * scale)
        stored = checkpoint_input * layers
        recompute = per_layer
    else:
        stored = per_layer * layers
        recompute = checkpoint_input = 0
    return ActivationEstimate(per_layer=per_layer, stored=stored, recompute=recompute, logits=logits,
                              total=stored + recompute + logits, checkpointing=checkpointing,
                              flash_attention=flash_attention, checkpoint_input=checkpoint_input)
