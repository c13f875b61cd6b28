"""Offline JSONL generation (rollouts, evals) that survives interruption.

Input lines are ``{"id": ..., "prompt": "..."}``. Each result is appended as one JSON line and
flushed as soon as its micro-batch finishes, so a killed run loses at most the batch in flight.
Rerunning skips ids already in the output, and drops a half-written last line first, so no row
is lost or written twice. Micro-batches are sorted by prompt length to waste little on padding.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tqdm import tqdm

from .common import Interrupted, completions


def read_prompts(path: str):
    """[(line number, id, prompt)] of well-formed lines; malformed ones are reported and skipped."""
    rows, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
                if "id" not in record or not isinstance(record.get("prompt"), str):
                    raise ValueError('needs "id" and a string "prompt"')
                key = json.dumps(record["id"])
                if key in seen:
                    raise ValueError(f"duplicate id {record['id']!r}")
            except ValueError as exc:
                print(f"hyper-gen: {path}:{number}: skipped malformed line ({exc})", file=sys.stderr)
                continue
            seen.add(key)
            rows.append((number, record["id"], record["prompt"]))
    return rows


def finished_ids(path: str) -> set:
    """ids already written; a trailing partial line (from a kill mid-write) is cut off first."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
    done = set()
    for line in data[:end].decode("utf-8").splitlines():
        if line.strip():
            done.add(json.dumps(json.loads(line)["id"]))
    return done


def run_jsonl(model, tokenizer, config, input_path: str, output_path: str, batch_size: int, write: bool = True) -> int:
    rows = read_prompts(input_path)
    done = finished_ids(output_path) if write else set()
    todo = [row for row in rows if json.dumps(row[1]) not in done]
    lengths = {i: len(tokenizer(row[2], add_special_tokens=False)["input_ids"]) for i, row in enumerate(todo)}
    order = sorted(range(len(todo)), key=lambda i: lengths[i])
    out = open(output_path, "a", encoding="utf-8") if write else None
    progress = tqdm(
        total=len(rows), initial=len(rows) - len(todo), unit="row", disable=not write, desc="generate", file=sys.stderr
    )
    tokens, start = 0, time.perf_counter()
    try:
        for first in range(0, len(order), batch_size):
            batch = [todo[i] for i in order[first : first + batch_size]]
            texts, counts, reasons = completions(model, tokenizer, [row[2] for row in batch], config)
            tokens += sum(counts)
            if out is not None:
                for (_, row_id, prompt), text, count, reason in zip(batch, texts, counts, reasons):
                    out.write(
                        json.dumps(
                            {
                                "id": row_id,
                                "prompt": prompt,
                                "completion": text,
                                "completion_tokens": count,
                                "finish_reason": reason,
                            }
                        )
                        + "\n"
                    )
                out.flush()
                os.fsync(out.fileno())
            progress.update(len(batch))
            progress.set_postfix(tok_per_s=f"{tokens / (time.perf_counter() - start):.1f}")
    except KeyboardInterrupt:
        finished = progress.n
        raise Interrupted(
            f"interrupted after {finished} of {len(rows)} rows; {output_path!r} keeps every finished row: "
            "run the same command again to resume"
        ) from None
    finally:
        progress.close()
        if out is not None:
            out.close()
    return 0
