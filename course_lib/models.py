"""The models of the course: a small CNN, and Llama-shaped transformers built from configs.

Nothing here downloads weights: presets are configs, and ``build_llama`` gives random
weights. ``from_pretrained`` users pass a model name in notebook 11 instead.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from course_lib import attention
from course_lib.device import device_memory_bytes

# Llama shapes by preset. The large ones are the published architectures (hidden size, layers,
# heads, KV heads, MLP width, vocabulary); the small ones keep the same structure at sizes a
# laptop CPU trains in seconds.
LLAMA_PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=512),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=2048, max_position_embeddings=1024),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
               rope_theta=500000.0, tie_word_embeddings=True),  # Llama-3.2-1B
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False),  # Meta-Llama-3-8B (seed 003)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
               rope_theta=500000.0, tie_word_embeddings=False),  # Llama-3.1-8B
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                rope_theta=500000.0, tie_word_embeddings=False),  # Llama-3.1-70B
}


class SmallCNN(nn.Module):
    """Three conv blocks and a linear head for 32×32 images.

    GroupNorm, not BatchNorm: BatchNorm's statistics depend on the micro-batch, which would
    make gradient accumulation differ from the big batch (notebook 03 shows why).
    """

    def __init__(self, num_classes: int = 10, width: int = 32, in_channels: int = 3):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.ReLU(), nn.MaxPool2d(2))

        self.features = nn.Sequential(block(in_channels, width), block(width, 2 * width), block(2 * width, 4 * width))
        self.head = nn.Linear(4 * width * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


# Where torchao is installed, importing it logs what no notebook's reader can act on: the CUDA kernels a CPU build
# of torch cannot load, and a deprecation inside torch's pytree. transformers imports it when it builds its first
# model, so those lines would land in notebook outputs, as warnings.
TORCHAO_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_torchao_import():
    """Inside this block, the warnings torchao's import logs are held back (``TORCHAO_IMPORT_LOGGERS``); errors
    still log, and a failed import still raises."""
    loggers = [logging.getLogger(name) for name in TORCHAO_IMPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _llama_class():
    """transformers' ``LlamaForCausalLM``, imported with the quantizer registry it builds models with (which imports
    torchao where installed), quietly."""
    with quiet_torchao_import():
        from transformers import LlamaForCausalLM

        with contextlib.suppress(ImportError):
            import transformers.quantizers.auto  # noqa: F401
    return LlamaForCausalLM


def llama_config(preset: str = "tiny", **overrides):
    """A ``transformers.LlamaConfig`` for a preset of ``LLAMA_PRESETS``, with overrides."""
    from transformers import LlamaConfig

    if preset not in LLAMA_PRESETS:
        raise ValueError(f"preset={preset!r} is unknown; choose one of {sorted(LLAMA_PRESETS)}")
    return LlamaConfig(**{**LLAMA_PRESETS[preset], **overrides})


def build_llama(config_or_preset="tiny", *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                attn_implementation: str = attention.IMPLEMENTATION, seed: int = 0, **overrides):
    """A ``LlamaForCausalLM`` with random weights from a preset name or a config.

    Attention is ``course_sdpa`` (``course_lib.attention``): a fused SDPA kernel in every dtype, or
    an error; ``attn_implementation="sdpa"`` gives transformers' own, which may fall back silently.

    Checks first that the weights fit on the device, so a preset too big stops with a
    message instead of an out-of-memory error halfway through initialisation.
    """
    LlamaForCausalLM = _llama_class()
    attention.register()
    config = llama_config(config_or_preset, **overrides) if isinstance(config_or_preset, str) else config_or_preset
    config._attn_implementation = attn_implementation
    # Training needs no KV cache: it is only waste, and checkpointing's recompute would append to it twice.
    config.use_cache = overrides.get("use_cache", False)
    device = torch.device(device)
    need = llama_num_parameters(config) * torch.empty((), dtype=dtype).element_size()
    have = device_memory_bytes(device)
    if have and need > 0.9 * have:
        raise ValueError(
            f"the weights of this Llama alone need {need / 2**30:.1f} GiB in {dtype} and {device} has "
            f"{have / 2**30:.1f} GiB: pick a smaller preset (or a tier with more memory)"
        )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype)


def llama_num_parameters(config, *, include_lm_head: bool = True) -> int:
    """Parameters of a Llama from its config alone, without building it.

    Per layer: q and o projections (d×d each), k and v (d × d·kv/heads each), a gated MLP
    (3·d·ffn) and two RMSNorm weights (2·d). Plus the embedding (V·d), the final norm (d)
    and the LM head (V·d) unless it is tied to the embedding.
    """
    d, ffn, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = d * config.num_key_value_heads // config.num_attention_heads
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d
    total = layers * per_layer + config.vocab_size * d + d
    if include_lm_head and not getattr(config, "tie_word_embeddings", False):
        total += config.vocab_size * d
    return total


def bert_base_cased_config():
    """The configuration of bert-base-cased (seed 003's small example), built offline."""
    from transformers import BertConfig

    return BertConfig(vocab_size=28996)  # every other field is BERT-base's default


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (each shared tensor counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def empty_llama(config_or_preset="tiny", *, attn_implementation: str = attention.IMPLEMENTATION, **overrides):
    """A ``LlamaForCausalLM`` on the meta device: every shape, no memory, no initialisation.

    For counting parameters and estimating memory of models too big for this machine
    (70B builds in a fraction of a second), and for meta-device initialisation (FSDP shards it,
    then materialises it with ``to_empty``): so its attention is ``build_llama``'s, ``course_sdpa``.
    """
    LlamaForCausalLM = _llama_class()
    attention.register()
    config = llama_config(config_or_preset, **overrides) if isinstance(config_or_preset, str) else config_or_preset
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside a PEFT (LoRA) wrapper, or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
