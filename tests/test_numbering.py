"""The notebooks' numbers have one home, their file names: every title and every reference follows them.

A notebook's title is ``# NN · ...`` with NN its file's number (the student edition's README lists the titles).
A reference to another notebook is written ``notebook NN`` or ``notebooks NN and MM`` / ``NN-MM`` (never a bare
``(NN)``, which reads as anything), names a notebook that exists, and where a topic stands right before it
(``DDP (notebook 06)``), the number is one of that topic's notebooks. When notebooks are split or renumbered,
this fails at every title and reference that still carries the old number.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from course_grader.release import assignments

ROOT = Path(__file__).resolve().parent.parent
NUMBERS = {a[:2] for a in assignments()}
# Topics whose notebooks a reference must point at when it names the topic right before the number.
TOPICS = {
    "mixed precision": {"01"}, "autocast": {"01"}, "pure-bf16": {"01"}, "fp8": {"02"},
    "accumulation": {"03"}, "micro-batches": {"03"}, "checkpointing": {"04"}, "input pipeline": {"05"},
    "ddp": {"06", "07"}, "data parallelism": {"06", "07"}, "reducer": {"07"}, "fsdp": {"08"}, "sharding": {"08", "09"},
    "deepspeed": {"09", "10"}, "zero": {"09", "10"}, "offload": {"10"}, "lora": {"11", "12"}, "qlora": {"12"},
    "recipe": {"13"}, "chunked loss": {"13"}, "fine-tune": {"11", "12", "13"}, "tensor": {"14"},
    "pipeline parallel": {"15"}, "context parallel": {"16"}, "expert": {"17"},
}
REFERENCE = re.compile(r"\bnotebooks? (\d\d)((?:(?:,| and|-|–| to)\s*\d\d)*)")
BARE = re.compile(r"(?<!notebook )(?<!notebooks )\((\d\d)(?:(?:,| and|-|–)\s*\d\d)*\)")


def prose(name: str) -> list[str]:
    """The markdown cells of solutions/<name>/<name>.ipynb."""
    cells = json.loads((ROOT / "solutions" / name / f"{name}.ipynb").read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


@pytest.mark.parametrize("name", assignments())
def test_the_title_carries_the_file_s_number(name):
    for folder in ("solutions", "notebooks"):
        path = ROOT / folder / (f"{name}/{name}.ipynb" if folder == "solutions" else f"{name}.ipynb")
        first = "".join(json.loads(path.read_text())["cells"][0]["source"]).splitlines()[0]
        assert re.match(rf"# {name[:2]} · \S", first), \
            f"{path.relative_to(ROOT)}: title {first!r} must start '# {name[:2]} · '"


def references(text: str) -> list[tuple[int, set[str]]]:
    """(offset, numbers) of every ``notebook NN`` reference in ``text``."""
    out = []
    for m in REFERENCE.finditer(text):
        first, rest = m.group(1), re.findall(r"\d\d", m.group(2))
        numbers = {first, *rest}
        ranges = re.findall(r"(\d\d)\s*[-–]\s*(\d\d)", m.group(0)) + re.findall(r"(\d\d) to (\d\d)", m.group(0))
        for a, b in ranges:
            numbers |= {f"{n:02d}" for n in range(int(a), int(b) + 1)}
        out.append((m.start(), numbers))
    return out


def wrong_references(text: str) -> list[str]:
    """What is wrong with the notebook references of one markdown text ([] when nothing is)."""
    wrong = [f"bare reference {m.group(0)!r}: write 'notebook NN'" for m in BARE.finditer(text)]
    for start, numbers in references(text):
        if not numbers <= NUMBERS:
            wrong.append(f"notebook {sorted(numbers - NUMBERS)} does not exist: {text[start:start + 60]!r}")
        before = text[max(0, start - 30):start].lower()
        topic = next((t for t in TOPICS if re.search(rf"{re.escape(t)}[\w-]*\s*[(,]\s*$", before)), None)
        if topic and not numbers & TOPICS[topic]:
            wrong.append(f"{topic!r} is taught in {sorted(TOPICS[topic])}, not {sorted(numbers)}: "
                         f"{text[max(0, start - 30):start + 20]!r}")
    return wrong


@pytest.mark.parametrize("name", assignments())
def test_references_name_notebooks_that_exist_and_match_their_topic(name):
    wrong = [w for text in prose(name) for w in wrong_references(text)]
    assert not wrong, f"{name}:\n  " + "\n  ".join(wrong)


def test_a_stale_number_is_caught():
    """The old 13's 'Data parallelism (04)', a DDP reference to 05, a notebook that does not exist; ranges expand."""
    assert wrong_references("Data parallelism (04) and sharding (05, 06)")[0].startswith("bare reference '(04)'")
    assert wrong_references("DDP (notebook 05) keeps")[0].startswith("'ddp' is taught in ['06', '07'], not ['05']")
    assert "does not exist" in wrong_references("see notebook 31")[0]
    assert wrong_references("FSDP, notebook 08, shards") == [] == \
        wrong_references("as ZeRO-3 does (notebook 08 measured")
    assert references("notebooks 06-10 start") == [(0, {"06", "07", "08", "09", "10"})]
