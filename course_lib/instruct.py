"""Instruction data for fine-tuning, made by the package (nothing is downloaded by default).

A fine-tune shows that it worked only on a task whose answers can be *checked*. The tasks here
have exactly one right answer, so a model's greedy output is either right or wrong:

- ``reverse``: "Reverse the words: lamp kite coin" → "coin kite lamp"
- ``sort``:    "Sort the words: lamp kite coin"    → "coin kite lamp" (alphabetical)
- ``add``:     "Add: 12 + 7"                         → "19"
- ``lookup``:  "a=3 b=7 c=1. What is b?"             → "7"

Every example is a prompt and a response, formatted with the tokenizer's own chat template where it
has one (``tokenizer.chat_template``: Llama 3's ``<|start_header_id|>user<|end_header_id|>...``, through
``apply_chat_template``), else with the package's chat-like template (``format_prompt``).
Training sees prompt and response as one sequence, but the loss is taken
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

Real data has examples longer than a training row. ``fit_to_length`` does what fine-tuning
libraries do (TRL truncates, axolotl drops): an example whose prompt leaves room for at least
``min_response`` response tokens keeps its whole prompt and as much of its response as fits (it loses
its EOS, since it did not end there); one whose prompt alone fills the row is dropped, as it has
nothing left to learn from. It returns the counts, and the CLI prints them.

``load_instruction_data`` gives a train and a held-out split: the package's own task by
default, or a Hugging Face data set by name, or a local JSON-lines file (``datasets`` is imported only then).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

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
    if n == 0:
        return []
    rng, seen, out = random.Random(seed), set(exclude or ()), []
    for _ in range(200 * n):
        ex = make_example(task, rng, n_words)
        if ex.instruction not in seen:
            seen.add(ex.instruction)
            out.append(ex)
            if len(out) == n:
                return out
    raise ValueError(f"task={task!r} has fewer than {n} distinct examples with n_words={n_words} (it found {len(out)} "
                     f"in {200 * n} draws, {len(seen) - len(out)} excluded): ask for fewer")


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` brings its own chat template (Llama 3 Instruct's does; the package's does not)."""
    return bool(getattr(tokenizer, "chat_template", None))


def format_prompt(instruction: str, tokenizer=None) -> str:
    """The text the model sees before its answer: the tokenizer's chat template with the generation prompt
    (``apply_chat_template``) where it has one, else the package's template."""
    if tokenizer is not None and has_chat_template(tokenizer):
        return tokenizer.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                             add_generation_prompt=True)
    return PROMPT_TEMPLATE.format(instruction=instruction)


def example_texts(examples: list[Example]) -> list[str]:
    """Each example as the model sees it in training with the package's template: the formatted prompt and the
    response (to train a tokenizer on)."""
    return [format_prompt(e.instruction) + e.response for e in examples]


def prompt_ids(tokenizer, instruction: str) -> list[int]:
    """The token ids of the formatted prompt, BOS first: what training masks and what generation starts from.

    A chat template writes its own BOS (Llama 3's ``<|begin_of_text|>``) into the text, so none is added then.
    """
    text = format_prompt(instruction, tokenizer)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and not (ids and ids[0] == bos):
        ids = [bos] + ids
    return ids


def _response_text(tokenizer, example: Example) -> str:
    """The text after the prompt: the response, plus the template's end of turn (Llama 3's ``<|eot_id|>``)."""
    if not has_chat_template(tokenizer):
        return example.response
    prompt = format_prompt(example.instruction, tokenizer)
    full = tokenizer.apply_chat_template([{"role": "user", "content": example.instruction},
                                          {"role": "assistant", "content": example.response}], tokenize=False)
    if not full.startswith(prompt):
        raise ValueError("the tokenizer's chat template renders the prompt differently with and without the answer, so "
                         "the prompt/response boundary is not exact: use a template whose generation prompt is a "
                         "prefix of the full conversation, or set tokenizer.chat_template = None for the package's "
                         "template")
    return full[len(prompt):]


def tokenize_example(tokenizer, example: Example) -> dict[str, list[int]]:
    """``input_ids`` of prompt + response + EOS, and ``labels`` with -100 on every prompt position.

    Prompt and response are tokenized separately, so the boundary between them is exact
    whatever the tokenizer merges. The EOS (and a chat template's end of turn) is a label: the model
    must learn to stop.
    """
    prompt = prompt_ids(tokenizer, example.instruction)
    response = tokenizer(_response_text(tokenizer, example), add_special_tokens=False)["input_ids"]
    if not response or response[-1] != tokenizer.eos_token_id:
        response = response + [tokenizer.eos_token_id]
    return {"input_ids": prompt + response, "labels": [IGNORE_INDEX] * len(prompt) + response}


def fit_to_length(features: list[dict], seq_len: int, *, long: str = "truncate",
                  min_response: int = 1) -> tuple[list[dict], dict[str, int]]:
    """Make every tokenized example fit in ``seq_len`` tokens; the kept examples and the counts.

    ``long="truncate"`` keeps the whole prompt and the first ``seq_len - len(prompt)`` tokens of the response,
    and drops an example whose prompt leaves fewer than ``min_response`` response tokens; ``"drop"`` drops
    every example that is too long; ``"error"`` raises on the first. Counts: ``kept`` (as they were),
    ``truncated``, ``dropped``.
    """
    if long not in ("truncate", "drop", "error"):
        raise ValueError(f"long={long!r} is unknown; choose 'truncate', 'drop' or 'error'")
    out, counts = [], {"kept": 0, "truncated": 0, "dropped": 0}
    for f in features:
        n = len(f["input_ids"])
        if n <= seq_len:
            out.append(f)
            counts["kept"] += 1
            continue
        if long == "error":
            raise ValueError(f"an example has {n} tokens, more than seq_len={seq_len}: raise seq_len, or pass "
                             "long='truncate' or long='drop'")
        n_prompt = next((i for i, label in enumerate(f["labels"]) if label != IGNORE_INDEX), n)
        if long == "drop" or seq_len - n_prompt < min_response:
            counts["dropped"] += 1
            continue
        out.append({k: v[:seq_len] for k, v in f.items()})
        counts["truncated"] += 1
    return out, counts


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
            raise ValueError(f"an example has {n} tokens, more than seq_len={seq_len}: pass the examples through "
                             "fit_to_length first (truncate or drop), or raise seq_len")
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


def pack_for_training(examples: list[Example], tokenizer, seq_len: int, *,
                      long: str = "truncate") -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Tokenize ``examples`` (prompts masked), fit them to ``seq_len`` (``fit_to_length``) and pack them
    into rows of ``seq_len`` tokens; the packed rows and the counts of kept, truncated and dropped examples."""
    features, counts = fit_to_length([tokenize_example(tokenizer, e) for e in examples], seq_len, long=long)
    if not features:
        raise ValueError(f"all {counts['dropped']} examples are longer than seq_len={seq_len} in their prompt "
                         "alone: raise seq_len")
    return pack_examples(features, seq_len, tokenizer.pad_token_id), counts


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
    name, ``datasets.load_dataset(dataset_name, split=split, **load_kwargs)`` loads it (a path ending in
    ``.json``/``.jsonl`` is read as ``load_dataset("json", data_files=path)``, as is ``"json"`` with
    ``data_files``) and each
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
    if Path(dataset_name).suffix in (".json", ".jsonl") and "data_files" not in load_kwargs:
        if not Path(dataset_name).exists():
            raise FileNotFoundError(f"{dataset_name} does not exist: give the path of a JSON-lines file")
        dataset_name, load_kwargs = "json", {**load_kwargs, "data_files": str(dataset_name)}
    rows = datasets.load_dataset(dataset_name, split=split, **load_kwargs).shuffle(seed=seed)
    examples = _rows_to_examples(rows, n_train + n_test)
    if len(examples) < n_test + 1:
        raise ValueError(f"{dataset_name!r} gave {len(examples)} usable rows: it needs instruction/prompt/question "
                         f"and output/response/answer columns, and more than n_test={n_test} rows")
    return {"train": examples[n_test:], "test": examples[:n_test]}


def _rows_to_examples(rows, limit: int) -> list[Example]:
    """Up to ``limit`` examples from a data set's rows; rows without an instruction or a response are skipped."""
    examples = []
    for row in rows:
        instruction = _pick(row, ("instruction", "prompt", "question", "query"))
        response = _pick(row, ("output", "response", "answer", "completion"))
        if instruction is None or response is None:
            continue
        if row.get("input"):
            instruction += "\n" + str(row["input"])
        examples.append(Example(instruction, response))
        if len(examples) == limit:
            break
    return examples
