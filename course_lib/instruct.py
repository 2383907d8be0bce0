"""Instruction data for fine-tuning, made by the package (nothing is downloaded by default).

A fine-tune shows that it worked only on a task whose answers can be *checked*. The tasks here
have exactly one right answer, so a model's greedy output is either right or wrong:

- ``reverse``: "Reverse the words: lamp kite coin" → "coin kite lamp"
- ``sort``:    "Sort the words: lamp kite coin"    → "coin kite lamp" (alphabetical)
- ``add``:     "Add: 12 + 7"                         → "19"
- ``lookup``:  "a=3 b=7 c=1. What is b?"             → "7"

Every example is a prompt and a response, formatted with a chat-like template
(``format_prompt``). Training sees prompt and response as one sequence, but the loss is taken
on the response only: ``tokenize_example`` sets ``labels = -100`` on every prompt position
(and ``pad_batch`` on every padding position), the index PyTorch's cross-entropy ignores.
Labels follow the transformers convention: ``labels[t]`` is the token at position ``t``, and
the model's output at ``t - 1`` is scored against it (the shift happens inside the loss).

Two ways to make batches of examples of different lengths:

- **padding** (``pad_batch``): one example per row, padded to the longest row. Simple, every
  row is one document, but the padded positions cost compute for nothing;
  ``padding_waste`` measures how much.
- **packing** (``pack_examples``): examples laid end to end in rows of a fixed length, so
  almost no position is padding. To keep documents apart, each one restarts its position ids
  at 0 and ``packed_attention_mask`` builds a block-diagonal causal mask: a token attends only
  to earlier tokens of its own document, so a packed example computes exactly what it would
  alone. Packing pays off when lengths vary a lot (real instruction data); with short examples
  of similar length, as here, padding wastes little and keeps the batches simpler.

``load_instruction_data`` gives a train and a held-out split: the package's own task by
default, or a Hugging Face data set by name (``datasets`` is imported only then).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
PROMPT_TEMPLATE = "<|user|>\n{instruction}\n<|assistant|>\n"
WORDS = ["apple", "book", "coin", "desk", "egg", "fish", "gold", "hat", "ink", "jam", "kite", "lamp",
         "moon", "nut", "owl", "pen"]
TASKS = ("reverse", "sort", "add", "lookup")


@dataclass(frozen=True)
class Example:
    """One instruction and its one right response."""

    instruction: str
    response: str


def make_example(task: str, rng: random.Random, n_words: int = 3) -> Example:
    """One random example of ``task`` (see ``TASKS``)."""
    if task == "reverse":
        words = rng.sample(WORDS, n_words)
        return Example(f"Reverse the words: {' '.join(words)}", " ".join(reversed(words)))
    if task == "sort":
        words = rng.sample(WORDS, n_words)
        return Example(f"Sort the words: {' '.join(words)}", " ".join(sorted(words)))
    if task == "add":
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        return Example(f"Add: {a} + {b}", str(a + b))
    if task == "lookup":
        keys = rng.sample("abcdefgh", n_words)
        values = {k: rng.randint(0, 9) for k in keys}
        q = rng.choice(keys)
        return Example(" ".join(f"{k}={v}" for k, v in values.items()) + f". What is {q}?", str(values[q]))
    raise ValueError(f"task={task!r} is unknown; choose one of {TASKS}")


def make_examples(task: str = "reverse", n: int = 1000, seed: int = 0, n_words: int = 3,
                  exclude: set[str] | None = None) -> list[Example]:
    """``n`` distinct examples of ``task`` (none whose instruction is in ``exclude``)."""
    rng, seen, out = random.Random(seed), set(exclude or ()), []
    for _ in range(200 * n):
        ex = make_example(task, rng, n_words)
        if ex.instruction not in seen:
            seen.add(ex.instruction)
            out.append(ex)
            if len(out) == n:
                return out
    raise ValueError(f"task={task!r} has fewer than {n} distinct examples with n_words={n_words}: ask for fewer")


def format_prompt(instruction: str) -> str:
    """The chat-like template: the text the model sees before its answer."""
    return PROMPT_TEMPLATE.format(instruction=instruction)


def example_texts(examples: list[Example]) -> list[str]:
    """Each example as the model sees it in training: the formatted prompt and the response (to train a tokenizer on)."""
    return [format_prompt(e.instruction) + e.response for e in examples]


def tokenize_example(tokenizer, example: Example) -> dict[str, list[int]]:
    """``input_ids`` of prompt + response + EOS, and ``labels`` with -100 on every prompt position.

    Prompt and response are tokenized separately, so the boundary between them is exact
    whatever the tokenizer merges. The EOS is a label: the model must learn to stop.
    """
    prompt = tokenizer(format_prompt(example.instruction), add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        prompt = [tokenizer.bos_token_id] + prompt
    response = tokenizer(example.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return {"input_ids": prompt + response, "labels": [IGNORE_INDEX] * len(prompt) + response}


def pad_batch(features: list[dict], pad_id: int, length: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad tokenized examples to the longest (or ``length``): one document per row.

    Padded positions get ``labels = -100`` and ``attention_mask = 0``.
    """
    length = length or max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), length), pad_id, dtype=torch.long)
    labels = torch.full((len(features), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(features), length), dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        if n > length:
            raise ValueError(f"an example has {n} tokens, more than length={length}")
        ids[i, :n] = torch.tensor(f["input_ids"])
        labels[i, :n] = torch.tensor(f["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pack_examples(features: list[dict], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Lay tokenized examples end to end in rows of ``seq_len`` tokens (first fit, in order).

    An example never straddles two rows. Returns ``input_ids``, ``labels`` (-100 on padding
    and on the first token of every document, which nothing before it in its own document
    predicts), ``position_ids`` restarting at 0 for each document, and ``document_ids``
    (-1 on padding) for ``packed_attention_mask``.
    """
    rows: list[list[dict]] = [[]]
    used = [0]
    for f in features:
        n = len(f["input_ids"])
        if n > seq_len:
            raise ValueError(f"an example has {n} tokens, more than seq_len={seq_len}")
        if used[-1] + n > seq_len:
            rows.append([])
            used.append(0)
        rows[-1].append(f)
        used[-1] += n
    shape = (len(rows), seq_len)
    out = {"input_ids": torch.full(shape, pad_id, dtype=torch.long),
           "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
           "position_ids": torch.zeros(shape, dtype=torch.long),
           "document_ids": torch.full(shape, -1, dtype=torch.long)}
    doc = 0
    for r, row in enumerate(rows):
        at = 0
        for f in row:
            n = len(f["input_ids"])
            out["input_ids"][r, at:at + n] = torch.tensor(f["input_ids"])
            labels = torch.tensor(f["labels"])
            labels[0] = IGNORE_INDEX
            out["labels"][r, at:at + n] = labels
            out["position_ids"][r, at:at + n] = torch.arange(n)
            out["document_ids"][r, at:at + n] = doc
            doc, at = doc + 1, at + n
        out["position_ids"][r, at:] = torch.arange(seq_len - at)
    return out


def pack_for_training(examples: list[Example], tokenizer, seq_len: int) -> dict[str, torch.Tensor]:
    """Tokenize ``examples`` (prompts masked) and pack them into rows of ``seq_len`` tokens."""
    return pack_examples([tokenize_example(tokenizer, e) for e in examples], seq_len, tokenizer.pad_token_id)


def packed_attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask (batch, 1, T, T), True where query t may attend to key s.

    Query and key must be in the same document and ``s <= t``. Padding attends to itself only,
    so no row of the softmax is empty.
    """
    t = document_ids.shape[-1]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=document_ids.device))
    eye = torch.eye(t, dtype=torch.bool, device=document_ids.device)
    return ((same & causal) | eye)[:, None]


def padding_waste(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """How many positions of a batch are real tokens, padding, and scored (labels != -100)."""
    ids = batch["input_ids"]
    if "attention_mask" in batch:
        real = int(batch["attention_mask"].sum())
    else:
        real = int((batch["document_ids"] >= 0).sum())
    total = ids.numel()
    return {"positions": total, "real tokens": real, "padding": total - real,
            "padding fraction": (total - real) / total, "scored tokens": int((batch["labels"] != IGNORE_INDEX).sum())}


def batches(features: list[dict], batch_size: int, pad_id: int, *, seed: int = 0, shuffle: bool = True):
    """Endless padded batches of ``batch_size`` examples (reshuffled every pass, fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(features), generator=g).tolist() if shuffle else list(range(len(features)))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield pad_batch([features[j] for j in order[i:i + batch_size]], pad_id)


def exact_match(predictions: list[str], references: list[str]) -> float:
    """Fraction of predictions equal to their reference (surrounding whitespace ignored)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not references:
        return 0.0
    return sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / len(references)


def _pick(row: dict, names: tuple[str, ...]) -> str | None:
    for n in names:
        if row.get(n):
            return str(row[n])
    return None


def load_instruction_data(dataset_name: str | None = None, *, task: str = "reverse", n_train: int = 1000,
                          n_test: int = 100, seed: int = 0, n_words: int = 3, split: str = "train",
                          **load_kwargs) -> dict[str, list[Example]]:
    """``{"train": [...], "test": [...]}`` examples, the test split held out (no instruction in both).

    With ``dataset_name=None`` (the default) the package makes the examples of ``task``. With a
    name, ``datasets.load_dataset(dataset_name, split=split, **load_kwargs)`` loads it and each
    row becomes an ``Example`` from its instruction (``instruction``/``prompt``/``question``,
    plus ``input`` if present) and its response (``output``/``response``/``answer``).
    """
    if dataset_name is None:
        test = make_examples(task, n_test, seed=seed + 1, n_words=n_words)
        train = make_examples(task, n_train, seed=seed, n_words=n_words, exclude={e.instruction for e in test})
        return {"train": train, "test": test}
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"dataset_name={dataset_name!r} needs the datasets package: pip install datasets "
                          "(or leave dataset_name=None to use the package's own task)") from err
    rows = datasets.load_dataset(dataset_name, split=split, **load_kwargs).shuffle(seed=seed)
    examples = []
    for row in rows:
        instruction = _pick(row, ("instruction", "prompt", "question", "query"))
        response = _pick(row, ("output", "response", "answer", "completion"))
        if instruction is None or response is None:
            continue
        if row.get("input"):
            instruction += "\n" + str(row["input"])
        examples.append(Example(instruction, response))
        if len(examples) == n_train + n_test:
            break
    if len(examples) < n_test + 1:
        raise ValueError(f"{dataset_name!r} gave {len(examples)} usable rows: it needs instruction/prompt/question "
                         "and output/response/answer columns")
    return {"train": examples[n_test:], "test": examples[:n_test]}
