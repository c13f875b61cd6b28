"""Offline JSONL generation (rollouts, evals) that survives interruption and bad input.

Input lines are ``{"id": ..., "prompt": "..."}`` (optionally ``"max_tokens"``); output lines
``{"id", "prompt", "completion", "completion_tokens", "finish_reason"}``, the reason "stop" (an EOS
ended the row) or "length", the engine's and the server's words (outputs written before said "eos"
for "stop": a rerun reads only their ids, so they resume as any other). Rows run through the
in-flight engine (``hyper_gen.engine``): ``--batch-size`` rows decode together and a finished row's
slot is refilled with the next prompt at the next step, so a short completion never waits for the longest
one of its batch (``batching="fixed"`` keeps the older fixed micro-batches, for comparison). Each
result is appended as one JSON line and flushed (and fsynced) as soon as it finishes, so a killed
run loses at most the rows in flight. Rerunning skips ids already in the output, and drops a
half-written last line first, so no row is lost or written twice. The output is in completion
order: match rows by id. With ``--seed S`` each row samples with its own seed made from S and
its id, so a row's completion is the same whatever rows share its batch or were done before.

No single input can stop a job. A malformed input line (not JSON, not UTF-8, no id or prompt, a
duplicate id) is reported with its line number and skipped. A row generate cannot take (an empty
prompt, text that is not encodable, more tokens than the model's context) is written as an error
record ``{"id": ..., "error": "..."}``, which counts as done on a rerun: delete its line to retry
it. Paths that cannot work (input and output the same file, an output that cannot be written, an
output file corrupt before its last line) are refused before the model loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from tqdm import tqdm

from hyper_gen.config import MAX_NEW_TOKENS
from hyper_gen.engine import Engine, EngineConfig, EngineDeadError, SamplingParams
from hyper_gen.engine.checks import check_engine_model
from hyper_gen.models.checkpoint import Checkpoint

from .complete import completions
from .errors import Interrupted, UsageError

BATCHING = ("inflight", "fixed")

# tokenizers that declare no length limit say model_max_length = int(1e30)
_NO_LIMIT = 10**9


@dataclass
class Row:
    line: int  # in the input file
    id: object
    prompt: str
    max_tokens: Optional[int] = None  # the row's own "max_tokens" (None: --max-new-tokens)

    @property
    def key(self) -> str:
        return json.dumps(self.id)


@dataclass
class Job:
    """A JSONL job, read and checked before the model loads (every rank reads the same)."""

    input_path: str
    output_path: str
    rows: list  # [Row] of well-formed input lines
    notes: list = field(default_factory=list)  # one line per skipped input line
    done: set = field(default_factory=set)  # json.dumps(id) of rows already in the output
    keep_bytes: int = 0  # the output's length without a partial last line


def _lines_after(path: str, offset: int) -> int:
    """Complete lines of ``path`` after byte ``offset``."""
    with open(path, "rb") as f:
        f.seek(offset)
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def check_paths(input_path: str, output_path: str) -> None:
    """UsageError unless the input can be read and the output appended to (and they differ)."""
    if not os.path.exists(input_path):
        raise UsageError(f"--input file {input_path!r} does not exist")
    if not os.path.isfile(input_path):
        raise UsageError(f"--input {input_path!r} is not a file")
    if not os.access(input_path, os.R_OK):
        raise UsageError(f"--input file {input_path!r} is not readable")
    out = output_path
    if os.path.isdir(out):
        raise UsageError(f"--output {out!r} is a directory; give a file in it, e.g. {os.path.join(out, 'out.jsonl')!r}")
    if os.path.exists(out):
        try:
            same = os.path.samefile(input_path, out)
        except OSError:
            same = False
        if same:
            raise UsageError(
                f"--input {input_path!r} and --output {out!r} are the same file: results would be appended to "
                "the prompts; give another --output"
            )
        if not os.path.isfile(out):
            raise UsageError(f"--output {out!r} is not a regular file (a resumable job appends to a file)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.exists(parent):
        raise UsageError(f"--output {out!r}: directory {parent!r} does not exist")
    if not os.path.isdir(parent):
        raise UsageError(f"--output {out!r}: {parent!r} is not a directory")
    try:  # the real test: permissions, read-only file systems, root or not
        if os.path.exists(out):
            with open(out, "ab"):
                pass
        else:
            with tempfile.TemporaryFile(dir=parent):
                pass
    except OSError as exc:
        where = out if os.path.exists(out) else parent
        raise UsageError(f"--output {out!r} cannot be written ({where!r}: {exc.strerror or exc})") from None


def read_prompts(path: str):
    """([Row] of well-formed lines, [one-line note per skipped malformed line])."""
    rows, notes, seen = [], [], set()
    # surrogateescape: invalid UTF-8 is reported for its line instead of failing the whole file
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                try:
                    line.encode("utf-8")
                except UnicodeEncodeError as exc:
                    byte = ord(line[exc.start]) - 0xDC00
                    raise ValueError(f"not UTF-8: byte 0x{byte:02x} at column {exc.start + 1}") from None
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
                if "id" not in record or not isinstance(record.get("prompt"), str):
                    raise ValueError('needs "id" and a string "prompt"')
                limit = record.get("max_tokens")
                if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                    raise ValueError(f'"max_tokens" must be a positive integer, got {limit!r}')
                if limit is not None and limit > MAX_NEW_TOKENS:
                    raise ValueError(f'"max_tokens" must be <= {MAX_NEW_TOKENS} (MAX_NEW_TOKENS), got {limit}')
                row = Row(number, record["id"], record["prompt"], limit)
                if row.key in seen:
                    raise ValueError(f"duplicate id {record['id']!r}")
            except ValueError as exc:
                notes.append(f"hyper-gen: {path}:{number}: skipped malformed line ({exc})")
                continue
            seen.add(row.key)
            rows.append(row)
    return rows, notes


def scan_output(path: str):
    """(ids already written, length to keep), reading only: a partial last line (a kill in the
    middle of a write) is left out; a corrupt line before it is a UsageError naming the line."""
    if not os.path.exists(path):
        return set(), 0
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    done = set()
    for number, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
            if not isinstance(record, dict) or "id" not in record:
                raise ValueError('not a JSON object with an "id"')
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
            raise UsageError(
                f"{path}:{number}: corrupt line in the output file ({_first_line(exc)}); only a partial last "
                f"line is cut off by itself: fix or delete line {number}, then rerun"
            ) from None
        done.add(json.dumps(record["id"]))
    return done, end


def open_job(input_path: str, output_path: str) -> Job:
    """The job the paths describe, or a UsageError; nothing is written."""
    check_paths(input_path, output_path)
    try:
        rows, notes = read_prompts(input_path)
        done, keep = scan_output(output_path)
    except OSError as exc:
        raise UsageError(f"cannot read {exc.filename!r}: {exc.strerror or exc}") from None
    return Job(input_path, output_path, rows, notes, done, keep)


def context_length(model, tokenizer=None, path=None):
    """The model's context in positions (prompt + generated tokens), or None where none is declared:
    the model config's ``max_position_embeddings``, else the checkpoint's, else the tokenizer's
    ``model_max_length``."""

    def positive(value):
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        value = positive(getattr(source, "max_position_embeddings", None))
        if value:
            return value
    if path is not None:
        try:
            value = positive(Checkpoint(path).config.get("max_position_embeddings"))
        except (OSError, ValueError, TypeError):
            value = None
        if value:
            return value
    value = positive(getattr(tokenizer, "model_max_length", None))
    return value if value and value < _NO_LIMIT else None


def check_row(prompt: str, tokenizer, max_new_tokens: int, context):
    """(token count, None) for a prompt generate can take, or (token count, what is wrong)."""
    if not prompt.strip():
        return 0, "empty prompt" if not prompt else "prompt is only whitespace"
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        return 0, (
            f"prompt is not valid text: lone surrogate {prompt[exc.start]!r} at character {exc.start} "
            "(an unpaired \\u escape in the JSON)"
        )
    try:
        length = len(tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"])
    except Exception as exc:  # any tokenizer failure stays this row's
        return 0, f"the tokenizer rejects the prompt: {_first_line(exc)}"
    if length == 0:
        return 0, "prompt has no tokens"
    if context is not None and length + max_new_tokens > context:
        return length, (
            f"prompt is {length} tokens: with max_new_tokens={max_new_tokens} that is {length + max_new_tokens} "
            f"positions, more than the model's context of {context}"
        )
    return length, None


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def row_seed(seed, row: Row):
    """The seed row ``row`` samples with under ``--seed seed``: a function of the seed and the row's
    id only (rows with the same prompt still draw different samples), None without a seed."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{row.key}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sampling_params(config, seed=None, max_tokens=None) -> SamplingParams:
    """The engine's settings for a GenerationConfig: its EOS ids are the stop ids, exactly."""
    sample = config.do_sample
    max_tokens = max_tokens or config.max_new_tokens
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(config.min_new_tokens, max_tokens),
        temperature=config.temperature if sample else 0.0,
        top_k=config.top_k if sample else 0,
        top_p=config.top_p if sample else 1.0,
        min_p=config.min_p if sample else 0.0,
        repetition_penalty=config.repetition_penalty,
        seed=seed,
        stop_token_ids=config.eos_token_ids or None,
        ignore_eos=True,  # the model's own EOS is already in the config's
    )


def run_jsonl(
    model, tokenizer, config, job: Job, batch_size: int, write: bool = True, context=None, batching: str = "inflight"
) -> int:
    """Generate every row of ``job`` not yet in its output; rank 0 (``write``) appends and reports.

    ``batching``: "inflight" (the engine refills finished rows) or "fixed" (micro-batches of
    ``batch_size`` rows sorted by prompt length, each run to its longest row). Every rank reads
    the job before the model loads and only rank 0 touches the output; under a multi-rank model
    rank 0 runs the engine and the other ranks follow its steps (fixed: every rank runs the same
    batches, which generate checks)."""
    if batching not in BATCHING:
        raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")

    def say(line: str) -> None:
        if write:
            tqdm.write(line, file=sys.stderr)

    for note in job.notes:
        say(note)
    if batching == "inflight":
        try:
            check_engine_model(model)
        except TypeError as refused:  # e.g. a context-parallel model: fixed micro-batches still work
            say(f"hyper-gen: in-flight batching unavailable ({refused}); running fixed micro-batches")
            batching = "fixed"
    rows = [row for row in job.rows if row.key not in job.done]
    out = None
    if write:
        if os.path.exists(job.output_path) and os.path.getsize(job.output_path) > job.keep_bytes:
            with open(job.output_path, "rb+") as f:  # the half-written last line of a killed run
                f.truncate(job.keep_bytes)
        out = open(job.output_path, "a", encoding="utf-8")
        appended_from = os.path.getsize(job.output_path)

    def append(records) -> None:
        if out is not None and records:
            out.write("".join(json.dumps(record) + "\n" for record in records))
            out.flush()
            os.fsync(out.fileno())

    def failed(row: Row, message: str) -> dict:
        say(f"hyper-gen: {job.input_path}:{row.line}: id {row.id!r}: {message} (error record written)")
        return {"id": row.id, "error": message}

    total, already = len(job.rows), len(job.rows) - len(rows)
    generated = errors = tokens = 0
    progress = None
    start = time.perf_counter()
    try:
        good, lengths, bad = [], {}, []
        for row in rows:
            length, problem = check_row(row.prompt, tokenizer, row.max_tokens or config.max_new_tokens, context)
            if problem is None:
                good.append(row)
                lengths[row.line] = length
            else:
                bad.append(failed(row, problem))
        append(bad)
        errors += len(bad)
        good.sort(key=lambda row: lengths[row.line])
        progress = tqdm(
            total=total, initial=already + errors, unit="row", disable=not write, desc="generate", file=sys.stderr
        )
        start = time.perf_counter()
        run = _inflight if batching == "inflight" else _fixed
        batches = run(model, tokenizer, config, good, batch_size)
        for results in batches:
            records = []
            for row, result in results:
                if isinstance(result, Exception):
                    records.append(failed(row, _first_line(result)))
                    continue
                text, count, reason = result
                records.append(
                    {
                        "id": row.id,
                        "prompt": row.prompt,
                        "completion": text,
                        "completion_tokens": count,
                        "finish_reason": reason,
                    }
                )
            append(records)  # counted once on disk
            new_errors = sum("error" in record for record in records)
            errors += new_errors
            generated += len(records) - new_errors
            tokens += sum(record.get("completion_tokens", 0) for record in records)
            progress.update(len(records))
            progress.set_postfix(tok_per_s=f"{tokens / (time.perf_counter() - start):.1f}")
    except KeyboardInterrupt:
        # counted on disk: an interrupt just after a write, before the counters moved, must not
        # leave the message a row short of the file
        if out is not None:
            out.flush()
            finished = already + _lines_after(job.output_path, appended_from)
        else:
            finished = already + generated + errors
        raise Interrupted(
            f"interrupted after {finished} of {total} rows; {job.output_path!r} keeps every finished row: "
            "run the same command again to resume"
        ) from None
    finally:
        if progress is not None:
            progress.close()
        if out is not None:
            out.close()
    seconds = time.perf_counter() - start
    rate = f"{tokens / seconds:.0f} tok/s" if seconds > 0 else "- tok/s"
    retry = f" (delete {'its line' if errors == 1 else 'their lines'} from the output to retry)" if errors else ""
    say(
        f"hyper-gen: {_plural(total, 'row')}: {generated} generated, {_plural(errors, 'error')}{retry}, "
        f"{already} already done; {tokens} tokens in {seconds:.1f} s ({rate}) -> {job.output_path}"
    )
    return 0


def _fixed(model, tokenizer, config, rows, batch_size: int):
    """Fixed micro-batches: yields [(row, (text, tokens, reason) or the error)] per batch. A batch
    generate rejects is retried row by row, so the error costs only the row that caused it."""
    for first in range(0, len(rows), batch_size):
        batch = rows[first : first + batch_size]
        try:
            yield list(zip(batch, _batch_completions(model, tokenizer, batch, config)))
            continue
        except (ValueError, TypeError) as exc:
            if len(batch) == 1:
                yield [(batch[0], exc)]
                continue
        out = []
        for row in batch:
            try:
                out.append((row, _batch_completions(model, tokenizer, [row], config)[0]))
            except (ValueError, TypeError) as exc:
                out.append((row, exc))
        yield out


def _batch_completions(model, tokenizer, batch, config):
    """[(text, tokens, reason)] of one micro-batch. Rows with their own max_tokens: the batch runs to
    the largest (what a fixed batch costs) and each row keeps its own tokens up to its limit."""
    prompts = [row.prompt for row in batch]
    if all(row.max_tokens is None for row in batch):
        return list(zip(*completions(model, tokenizer, prompts, config)))
    limits = [row.max_tokens or config.max_new_tokens for row in batch]
    steps = []
    completions(
        model,
        tokenizer,
        prompts,
        config.replace(max_new_tokens=max(limits), min_new_tokens=min(config.min_new_tokens, max(limits))),
        on_tokens=lambda step, tokens, finished: steps.append(tokens),
    )
    generated = np.stack(steps, axis=1)
    eos, results = set(config.eos_token_ids), []
    for row, limit in enumerate(limits):
        ids = generated[row, :limit].tolist()
        ended = next((i for i, t in enumerate(ids) if t in eos), None)
        ids = ids if ended is None else ids[: ended + 1]
        results.append(
            (tokenizer.decode(ids, skip_special_tokens=True), len(ids), "length" if ended is None else "stop")
        )
    return results


def _inflight(model, tokenizer, config, rows, batch_size: int):
    """Every row through the engine at once: yields [(row, (text, tokens, reason) or the error)] as rows
    finish (all that finished since the last yield). Ranks other than 0 follow the engine's steps."""
    settings = EngineConfig(max_num_seqs=batch_size, admit_batch=max(1, batch_size // 4))
    engine = Engine(model, tokenizer, config=settings)
    if engine.rank != 0:
        engine.run_follower()
        return
    finished: queue.Queue = queue.Queue()
    inline = engine.world_size == 1  # one process: this thread drives the steps (no thread handoff)
    engine.start(background=not inline)
    try:
        rows_of = {}
        for row in rows:
            ids = tokenizer(row.prompt, add_special_tokens=False)["input_ids"]
            try:
                stream = engine.submit(ids, sampling_params(config, row_seed(config.seed, row), row.max_tokens))
            except (ValueError, TypeError) as exc:  # what check_row could not know
                yield [(row, exc)]
                continue
            rows_of[id(stream)] = row
            stream.add_done_callback(finished.put)
        while rows_of:
            if inline:
                engine.step()  # done callbacks run in it
                if finished.empty():
                    continue
            try:
                done = [finished.get(timeout=0.5)]
            except queue.Empty:
                continue
            while not finished.empty():
                done.append(finished.get_nowait())
            yield [(rows_of.pop(id(stream)), _result(stream)) for stream in done]
    finally:
        engine.shutdown()


def _result(stream):
    """(text, tokens, finish reason) of a finished stream; a ValueError / TypeError of its request (a row
    the model rejects); anything else (the engine or the model broke) is raised: no error record."""
    try:
        choice = stream.result().outputs[0]
    except EngineDeadError:
        raise
    except (ValueError, TypeError) as exc:
        return exc
    return choice.text, len(choice.token_ids), choice.finish_reason
