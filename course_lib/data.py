"""Data the course makes itself: nothing here downloads anything.

A *batch* is a tensor, a tuple of tensors (inputs, targets) or a dict of tensors, split along
dim 0 (``course_lib.loss`` says what each form means); ``batch_len`` and ``to_device`` take all three.
``synthetic_images`` is learnable (each class is a fixed random template under noise), so a
loss curve going down means the training step works. ``text_corpus`` generates English-like
sentences with checkable facts; ``train_tokenizer`` fits a byte-level BPE to any text.
"""

from __future__ import annotations

import random

import torch
from torch.utils.data import TensorDataset


def batch_len(batch) -> int:
    """The number of examples in a batch: a tensor, a tuple or list of tensors, or a dict of tensors."""
    first = batch if torch.is_tensor(batch) else next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return first.shape[0]


def to_device(batch, device: torch.device | str, non_blocking: bool = False):
    """The batch with every tensor moved to ``device`` (same form: tensor, tuple or dict)."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}
    return tuple(t.to(device, non_blocking=non_blocking) for t in batch)


def class_templates(num_classes: int = 10, size: int = 32, channels: int = 3, seed: int = 0,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """The class templates of ``synthetic_images`` with this ``seed``: one ``channels×size×size`` image per class
    (drawn from ``generator`` where given, which then goes on to draw the labels and the noise)."""
    g = torch.Generator().manual_seed(seed) if generator is None else generator
    return torch.randn(num_classes, channels, size, size, generator=g)


def synthetic_images(n: int, num_classes: int = 10, size: int = 32, channels: int = 3, noise: float = 1.0,
                     seed: int = 0) -> TensorDataset:
    """``n`` images of ``channels×size×size`` with labels: class template (``class_templates``) plus Gaussian
    noise."""
    g = torch.Generator().manual_seed(seed)
    templates = class_templates(num_classes, size, channels, generator=g)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    images = templates[labels] + noise * torch.randn(n, channels, size, size, generator=g)
    return TensorDataset(images, labels)


def random_tokens(batch: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Uniform random token ids, for measuring speed and memory of a language model."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=g)


def lm_batch(step: int, global_batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """The global batch of token rows of step ``step``: learnable rows (each token = previous + 7, mod vocab).

    A function of the step alone, so a run resumed at step k sees exactly the batches it would have seen.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, vocab, (global_batch, 1), generator=g)
    return (start + 7 * torch.arange(seq)) % vocab


_NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Radia", "Ken"]
_THINGS = ["apples", "books", "lamps", "kites", "stones", "coins", "shells", "cards"]
_PLACES = ["the kitchen", "the garden", "the library", "the harbour", "the workshop", "the attic"]


def text_corpus(n_sentences: int = 2000, seed: int = 0) -> str:
    """English-like text with small arithmetic facts, one sentence a line."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        name, thing, place = rng.choice(_NAMES), rng.choice(_THINGS), rng.choice(_PLACES)
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        lines.append(rng.choice([
            f"{name} has {a} {thing} in {place} and finds {b} more, so {name} has {a + b} {thing}.",
            f"In {place}, {name} counted {a} {thing}; after giving away {min(a, b)}, {a - min(a, b)} remained.",
            f"{name} keeps the {thing} in {place}.",
        ]))
    return "\n".join(lines)


def train_tokenizer(text: str, vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on ``text``, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
