"""The questions of the generation analysis and the prompt each model answers.

    mmlu    the paper's: N questions per subject (10 in the paper: 570 of MMLU's 57 subjects) of MMLU's test split,
            from the data `m2d fetch-data` brings (evaluate/paper_data.py), read from its Arrow files
    local   offline (CI, the demo): N per domain of the embedded corpus (data/synthetic.py), each a paragraph of
            the corpus' test split cut inside a sentence with four endings to choose from, the true one and three
            from other paragraphs of the same domain (evaluate/local_tasks.py's construction)

The sample is drawn with a recorded seed: each subject's rows in a seeded order (sha256 of seed and subject), the
first N taken, so a larger N keeps the smaller sample. Subject groups are MMLU's four (the MMLU paper's
categories, as lm-eval's mmlu groups); the corpus' domains are put where MMLU puts their nearest subjects
(astronomy: STEM; law and music: humanities, as MMLU's law and arts; medicine, cooking and sports: other, as
MMLU's medicine, nutrition and miscellaneous).

The prompt is a zero-shot chain-of-thought one (`TEMPLATE`, recorded with the results): plain text, no chat
template, so base models, distilled students and instruction-tuned teachers read the same characters. A model's
answer ends where it starts the next question or chat turn (`answer_part`: a line opening as the template's
questions do, as MMLU's header, a numbered or Markdown question, "Problem:", "Q:" or a chat role does, or a chat-turn
token; as lm-eval's generation tasks stop at their `until` strings): a base model that answers and then writes
questions of its own is read at its answer, not at the questions it made up (their word 3-grams would also count as
repetition).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from m2d_ray.catalog.evaluate import SETS  # noqa: E402,F401  (re-exported)
from m2d_ray.data.synthetic import DOMAINS, corpus_documents
from m2d_ray.errors import M2DError
from m2d_ray.evaluate.extraction import letters
from m2d_ray.evaluate.local_tasks import paragraphs, rows_from
from m2d_ray.evaluate.paper_data import verify
from m2d_ray.evaluate.paper_tasks import MMLU_SUBJECTS, TASKS

TEMPLATE = (
    "The following is a multiple choice question about {subject}. Think step by step, then finish with "
    '"The answer is (X)" where X is the letter of the correct choice.\n\n'
    "Question: {question}\n{choices}\nAnswer: Let's think step by step."
)
TEMPLATE_CHARS = len(TEMPLATE.format(subject="", question="", choices=""))  # the prompt's own characters
LOCAL_QUESTION = "Which ending completes this text? {context} ..."
#: a line opening with one of these starts the next question or the next chat turn: the answer ended before it
#: (TEMPLATE's own openings, MMLU's plural header, numbered and Markdown questions, "Problem:", lm-eval's "Q:", chat
#: roles); recorded with the settings as the generation's stop strings
UNTIL = (
    "Question:",
    "Question N:",
    "### Question",
    "Problem:",
    "Q:",
    "The following is a multiple choice question",
    "The following are multiple choice questions",
    "User:",
    "Human:",
)
_LINE_STARTS = (
    r"Question(?:\s*\d+)?\s*(?:[:.)*]|(?=[ \t]*\n))",  # "### Question" ends its line (a stream's end is no end)
    r"Problem(?:\s*\d+)?\s*[:.)*]",
    r"Q\s*\d*\s*:",
    r"The following (?:is|are) (?:a )?multiple[ -]choice question",
    r"(?:User|USER|Human|HUMAN)\s*:",
)
#: end-of-text and chat-turn tokens written out (in a responses file from elsewhere: our answers are decoded without
#: them)
END_TEXTS = (
    "</s>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<start_of_turn>",
    "<|im_start|>",
    "<|user|>",
    "<|start_header_id|>",
    "[INST]",
)
_UNTIL = re.compile(r"\n[ \t*#>]*(?:" + "|".join(_LINE_STARTS) + ")|" + "|".join(map(re.escape, END_TEXTS)))


def answer_part(text: str) -> tuple[str, str]:
    """(the answer, what ran on after it): `text` cut before a line that starts the next question or chat turn, or
    an end-of-text or chat-turn token written out."""
    m = _UNTIL.search(text)
    return (text, "") if m is None else (text[: m.start()], text[m.start() :])


GROUPS = ("humanities", "social sciences", "STEM", "other")
_GROUPS = {
    "humanities": "formal_logic high_school_european_history high_school_us_history high_school_world_history "
    "international_law jurisprudence logical_fallacies moral_disputes moral_scenarios philosophy prehistory "
    "professional_law world_religions law music",
    "social sciences": "econometrics high_school_geography high_school_government_and_politics "
    "high_school_macroeconomics high_school_microeconomics high_school_psychology human_sexuality "
    "professional_psychology public_relations security_studies sociology us_foreign_policy",
    "STEM": "abstract_algebra anatomy astronomy college_biology college_chemistry college_computer_science "
    "college_mathematics college_physics computer_security conceptual_physics electrical_engineering "
    "elementary_mathematics high_school_biology high_school_chemistry high_school_computer_science "
    "high_school_mathematics high_school_physics high_school_statistics machine_learning",
    "other": "business_ethics clinical_knowledge college_medicine global_facts human_aging management marketing "
    "medical_genetics miscellaneous nutrition professional_accounting professional_medicine virology "
    "medicine cooking sports",
}
SUBJECT_GROUP = {s: g for g, subjects in _GROUPS.items() for s in subjects.split()}
UNMAPPED = "unmapped"  # a subject of neither set (a responses file's own)


def group_of(subject: str) -> str:
    return SUBJECT_GROUP.get(subject, UNMAPPED)


@dataclass(frozen=True)
class Question:
    id: str
    subject: str
    question: str
    choices: tuple[str, ...]
    answer: str  # the key's letter

    def prompt(self, template: str = TEMPLATE) -> str:
        lines = "\n".join(f"{x}. {c}" for x, c in zip(letters(len(self.choices)), self.choices))
        return template.format(subject=self.subject.replace("_", " "), question=self.question, choices=lines)

    def record(self) -> dict:
        """The fields a responses line carries (m2d analyze --responses reads them back)."""
        return {
            "id": self.id,
            "subject": self.subject,
            "question": self.question,
            "choices": list(self.choices),
            "answer": self.answer,
        }


def check_set(name: str) -> None:
    """Before any work: a known set, and for `mmlu` its data fetched and intact (else the line saying to fetch)."""
    if name not in SETS:
        raise M2DError(f"questions {name!r}: write one of {', '.join(SETS)}")
    if name == "mmlu":
        verify()


def sample(name: str, per_subject: int, seed: int) -> list[Question]:
    """`per_subject` questions of every subject of set `name`, drawn with `seed` (see the module docstring)."""
    check_set(name)
    return _mmlu(per_subject, seed) if name == "mmlu" else _local(per_subject, seed)


def _order(n: int, seed: int, subject: str) -> list[int]:
    key = int.from_bytes(hashlib.sha256(f"{seed}\0{subject}".encode()).digest()[:8], "big")
    return random.Random(key).sample(range(n), n)


def _mmlu(per_subject: int, seed: int, root: Path | None = None) -> list[Question]:
    base = verify(root) / TASKS["mmlu"][0]
    out = []
    for subject in MMLU_SUBJECTS:
        rows = _arrow_rows(base / subject / "test")
        for i in _order(len(rows), seed, subject)[:per_subject]:
            r = rows[i]
            choices = tuple(r["choices"])
            out.append(
                Question(f"{subject}/{i}", subject, r["question"].strip(), choices, letters(len(choices))[r["answer"]])
            )
    return out


def _arrow_rows(split_dir: Path) -> list[dict]:
    """The rows of a `datasets.save_to_disk` split (its Arrow stream files, in name order), read with pyarrow."""
    tables = [pa.ipc.open_stream(str(p)).read_all() for p in sorted(split_dir.glob("*.arrow"))]
    return [row for t in tables for row in t.to_pylist()]


def _local(per_subject: int, seed: int) -> list[Question]:
    docs = corpus_documents("test")
    out = []
    for domain in DOMAINS:
        paras = [p for d in docs if d.domain == domain for p in paragraphs(d.text)]
        rows = rows_from(paras, len(paras), seed)
        for i in _order(len(rows), seed, domain)[:per_subject]:
            r = rows[i]
            out.append(
                Question(
                    f"{domain}/{i}",
                    domain,
                    LOCAL_QUESTION.format(context=r["context"]),
                    tuple(r["choices"]),
                    letters(4)[r["label"]],
                )
            )
    return out
