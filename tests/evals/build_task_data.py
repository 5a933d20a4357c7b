"""Builds the local lm-eval task data under ``tests/evals/tasks/data/`` from ``../shared/data/gsm8k_test.parquet``.

Deterministic: the same input gives the same files, which are committed so the task YAMLs need no hub and no build
step. Run from the repo root to rebuild: ``python -m tests.evals.build_task_data [PATH/TO/gsm8k_test.parquet]``.

- ``gsm8k_mc.parquet``: multiple choice, all 1,319 test rows. Each GSM8K question with its final answer and the
  final answers of the next rows that differ from it and from each other (three wrong choices); the right one's
  place is drawn from a seeded generator. Columns: question, choices (list of 4 strings), label (index of the right choice).
- ``gsm8k_gen.parquet``: generation, the first ``NUM_GEN_ROWS`` rows. Columns: question, answer (the full GSM8K
  solution ending "#### N").
- ``gsm8k_texts.parquet``: perplexity. Each text is ``ROWS_PER_TEXT`` consecutive question/answer pairs of the rows
  after those, a few thousand characters, longer than a 512-token context. Column: text.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE = REPO_ROOT.parent / "shared" / "data" / "gsm8k_test.parquet"
DATA_DIR = Path(__file__).resolve().parent / "tasks" / "data"

NUM_MC_ROWS = 1319
NUM_GEN_ROWS = 200
NUM_TEXTS = 8
ROWS_PER_TEXT = 12
NUM_WRONG = 3


def final_answer(solution: str) -> str:
    """The number after GSM8K's "####" marker."""
    return solution.split("####")[-1].strip()


def multiple_choice_rows(rows: list[dict], num_rows: int, seed: int = 0) -> list[dict]:
    """Question, four distinct final answers (one right, three from the following rows) and the right index."""
    rng = random.Random(seed)
    out = []
    for i in range(num_rows):
        right = final_answer(rows[i]["answer"])
        choices = [right]
        j = i
        while len(choices) < 1 + NUM_WRONG:
            j = (j + 1) % len(rows)
            candidate = final_answer(rows[j]["answer"])
            if candidate not in choices:
                choices.append(candidate)
        wrong = choices[1:]
        label = rng.randrange(len(choices))
        ordered = wrong[:label] + [right] + wrong[label:]
        out.append({"question": rows[i]["question"], "choices": ordered, "label": label})
    return out


def text_rows(rows: list[dict], num_texts: int, rows_per_text: int) -> list[dict]:
    texts = []
    for t in range(num_texts):
        part = rows[t * rows_per_text : (t + 1) * rows_per_text]
        texts.append({"text": "\n\n".join(f"Question: {r['question']}\nAnswer: {r['answer']}" for r in part)})
    return texts


def build(source: Path = SOURCE, out_dir: Path = DATA_DIR) -> dict[str, Path]:
    """Write the three Parquet files; returns their paths by name."""
    rows = pq.read_table(source, columns=["question", "answer"]).to_pylist()
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = {
        "gsm8k_mc": multiple_choice_rows(rows, NUM_MC_ROWS),
        "gsm8k_gen": rows[:NUM_GEN_ROWS],
        "gsm8k_texts": text_rows(rows[NUM_GEN_ROWS:], NUM_TEXTS, ROWS_PER_TEXT),
    }
    paths = {}
    for name, table_rows in tables.items():
        paths[name] = out_dir / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(table_rows), paths[name])
    return paths


if __name__ == "__main__":
    import sys

    for name, path in build(Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE).items():
        print(f"{name}: {pq.read_metadata(path).num_rows} rows -> {path.relative_to(REPO_ROOT)}")
