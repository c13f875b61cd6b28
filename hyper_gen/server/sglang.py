"""SGLang's native ``POST /generate``: token ids (or text) in, token ids, text and ``meta_info`` out,
as slime, AReaL, SkyRL and OpenRLHF's SGLang path call it.

One prompt answers one object ``{"text", "output_ids", "meta_info"}``; a batch (a list of
``input_ids`` lists or of texts) or ``n > 1`` answers a list, prompt ``i``'s sample ``j`` at
``i * n + j``. ``output_ids`` are every generated id (an EOS or stop token that ended the choice
included), and with ``return_logprob`` ``meta_info.output_token_logprobs`` has one SGLang tuple
``[logprob, token_id, text or None]`` per id, in order (``top_logprobs_num``: ``output_top_logprobs``
too; ``logprob_start_len`` >= 0: ``input_token_logprobs`` of the prompt from that position, the
first prompt token's logprob None). ``meta_info``: ``id`` (the ``rid``, which ``/abort_request``
takes), ``finish_reason`` (``{"type": "stop", "matched": id or string}``, ``{"type": "length",
"length": max_new_tokens}`` or ``{"type": "abort", "message"}``), ``prompt_tokens``,
``completion_tokens``, ``cached_tokens`` (prompt tokens served from the prefix cache),
``weight_version`` (the engine's when the answer was made; ``"default"`` before any update, as
SGLang's), ``e2e_latency``, and ``routed_experts`` ([token][moe layer][k] expert ids) when asked.

``sampling_params.no_stop_trim: true`` keeps the matched stop string (or stop token's text) in
``text``, ``skip_special_tokens: false`` decodes special tokens (``texts.py``); a top-level ``model``
other than the served one is a 404, and the routers' other fields are taken at their neutral
values only (``dialects.py``).

An aborted request (``/abort_request``, ``/pause_generation`` in abort mode) answers what it had
generated so far with ``finish_reason`` abort: resubmitting ``input_ids + output_ids`` continues
it (partial rollout), from the prefix cache while the weights are unchanged.

``stream: true``: server-sent events ``data: {...}``, each the choice's answer so far (cumulative
``text``, ``output_ids`` and logprobs, as SGLang streams them; ``index`` in a batch), then
``data: [DONE]``; an error once streaming is a last ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import List, Optional

from . import dialects, structured
from .errors import APIError, bad_value, shutting_down
from .logprobs import _finite
from .prompts import _check_ids, _encode
from .sglang_protocol import GenerateRequest, NativeSamplingParams, native_params, sampling_params_of
from .state import ServerState, collected_chunks
from .streams import DONE, EventStream, ServerClosing
from .texts import texter

MAX_BATCH = 2048


def version_text(version) -> str:
    """A weight version as SGLang reports it: its text, ``"default"`` before any update."""
    return "default" if version is None else str(version)


def _per_prompt(value, count: int, name: str, default):
    """A per-prompt field: one value for all, or a list with one per prompt."""
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise bad_value(name, f"{name} has {len(value)} entries for {count} prompts")
        return [default if v is None else v for v in value]
    return [value] * count


def _prompts(state: ServerState, request: GenerateRequest):
    """(prompt id lists, batched) from ``input_ids`` or ``text``."""
    if (request.input_ids is None) == (request.text is None):
        raise bad_value("input_ids", "give exactly one of input_ids (token ids) and text")
    if request.input_ids is not None:
        ids, param = request.input_ids, "input_ids"
        batched = bool(ids) and isinstance(ids[0], list)
        items = list(ids) if batched else [ids]
    else:
        param = "text"
        batched = isinstance(request.text, list)
        items = list(request.text) if batched else [request.text]
        if state.tokenizer is None:
            raise bad_value("text", "this server has no tokenizer: send input_ids")
        items = [_encode(state.tokenizer, t, "text", True) for t in items]
    if not items:
        raise bad_value(param, f"{param} is an empty batch")
    if len(items) > MAX_BATCH:
        raise bad_value(param, f"{param} is a batch of {len(items)} prompts, more than {MAX_BATCH}")
    where = [f"{param}.{i}" if batched else param for i in range(len(items))]
    return [_check_ids(p, state.vocab_size, w, state.max_model_len) for p, w in zip(items, where)], batched


class _Choice:
    """One sample's answer as it grows."""

    def __init__(self, prompt: List[int], rid: str, params, sp: NativeSamplingParams, want: tuple, make=None):
        self.prompt, self.rid, self.params, self.sp = prompt, rid, params, sp
        self.return_logprob, self.top, self.start, self.text_in_logprobs = want
        self.ids: List[int] = []
        self.text = ""  # the engine's (the matched stop string is found past it)
        self.own = make() if make is not None else None  # skip_special_tokens false / no_stop_trim (texts.py)
        self.shown = ""
        self.logprobs: List[dict] = []
        self.finish_reason: Optional[str] = None


def _matched(choice: _Choice, tokenizer, eos_ids) -> dict:
    """SGLang's finish_reason object for the engine's ``reason``."""
    reason = choice.finish_reason
    if reason == "length":
        return {"type": "length", "length": choice.params.max_tokens}
    if reason == "stop":
        last = choice.ids[-1] if choice.ids else None
        stop_ids = set(choice.params.stop_token_ids or ()) | (set() if choice.params.ignore_eos else set(eos_ids))
        if last is not None and last in stop_ids:
            return {"type": "stop", "matched": last}
        whole = tokenizer.decode(choice.ids, skip_special_tokens=True) if tokenizer is not None else ""
        rest = whole[len(choice.text) :]
        found = next((s for s in choice.params.stop_strings if rest.startswith(s) or s in rest), None)
        return {"type": "stop", "matched": found if found is not None else last}
    if reason == "abort":
        return {"type": "abort", "message": "Abort in waiting queue" if not choice.ids else "Abort the request"}
    return {"type": reason or "abort", "message": f"the request ended: {reason}"}


class _Answers:
    """Builds SGLang's answer objects for the choices of one /generate call."""

    def __init__(self, state: ServerState, request: GenerateRequest, started: float):
        self.state, self.request, self.started = state, request, started
        self.eos_ids = tuple(getattr(state.engine, "eos_token_ids", None) or ())

    def _tuple(self, logprob, token_id: int, choice: _Choice) -> list:
        text = self.state.tokens.text(token_id) if choice.text_in_logprobs else None
        return [None if logprob is None else _finite(logprob), int(token_id), text]

    def answer(self, choice: _Choice, output=None, routed=None, index=None) -> dict:
        finished = choice.finish_reason is not None
        text = choice.text if choice.own is None else choice.shown
        version = output.weight_version if output is not None else getattr(self.state.engine, "weight_version", None)
        meta = {
            "id": choice.rid,
            "finish_reason": _matched(choice, self.state.tokenizer, self.eos_ids) if finished else None,
            "prompt_tokens": len(choice.prompt),
            "completion_tokens": len(choice.ids),
            "cached_tokens": int(getattr(output, "cached_tokens", 0) or 0),
            "weight_version": version_text(version),
            "e2e_latency": time.monotonic() - self.started,
        }
        if choice.return_logprob:
            entries = choice.logprobs
            meta["output_token_logprobs"] = [self._tuple(e["logprob"], e["token_id"], choice) for e in entries]
            prompt = getattr(output, "prompt_logprobs", None) if choice.start >= 0 else None
            inputs = []
            if choice.start >= 0 and prompt is not None:
                for pos in range(choice.start, len(choice.prompt)):
                    entry = prompt[pos]
                    inputs.append(self._tuple(None if entry is None else entry["logprob"], choice.prompt[pos], choice))
            meta["input_token_logprobs"] = inputs
            if choice.top > 0:
                meta["output_top_logprobs"] = [
                    [self._tuple(lp, i, choice) for i, lp in e.get("top_logprobs") or ()] for e in entries
                ]
                if choice.start >= 0 and prompt is not None:
                    meta["input_top_logprobs"] = [
                        None
                        if prompt[pos] is None
                        else [self._tuple(lp, i, choice) for i, lp in prompt[pos]["top_logprobs"]]
                        for pos in range(choice.start, len(choice.prompt))
                    ]
        if self.request.return_routed_experts:
            meta["routed_experts"] = None if routed is None else routed.tolist()
        out = {"text": text, "output_ids": list(choice.ids), "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out


async def generate(state: ServerState, request: GenerateRequest, http_request):
    started = time.monotonic()
    state.check_model(request.model)
    found = dialects.unhonoured(request, dialects.GENERATE)
    if found is not None:
        raise bad_value(*found)
    prompts, batched = _prompts(state, request)
    count = len(prompts)
    sps = _per_prompt(sampling_params_of(request), count, "sampling_params", NativeSamplingParams())
    rids = _per_prompt(request.rid, count, "rid", None)
    rids = [r if r else uuid.uuid4().hex for r in rids]
    want_lp = _per_prompt(request.return_logprob, count, "return_logprob", False)
    tops = _per_prompt(request.top_logprobs_num, count, "top_logprobs_num", 0)
    starts = _per_prompt(request.logprob_start_len, count, "logprob_start_len", -1)
    items, choices = [], []
    for i, ids in enumerate(prompts):
        if tops[i] < 0:
            raise bad_value("top_logprobs_num", f"top_logprobs_num must be >= 0, got {tops[i]}")
        if starts[i] >= len(ids):
            raise bad_value(
                "logprob_start_len",
                f"logprob_start_len={starts[i]} is past the prompt's {len(ids)} tokens (-1: output logprobs only)",
            )
        where = "sampling_params." if not isinstance(request.sampling_params, list) else f"sampling_params.{i}."
        spec = structured.sglang_requested(sps[i], where)
        outputs = structured.build(state, *spec) if spec else None
        params = native_params(
            sps[i],
            bool(want_lp[i]),
            tops[i],
            bool(want_lp[i]) and starts[i] >= 0,
            request.return_routed_experts,
            outputs,
        )
        items.append((ids, params, rids[i]))
        want = (bool(want_lp[i]), tops[i], starts[i] if want_lp[i] else -1, request.return_text_in_logprobs)
        make = texter(state, params, sps[i].skip_special_tokens, sps[i].no_stop_trim)
        choices.append([_Choice(ids, rids[i], params, sps[i], want, make) for _ in range(params.n)])
    requests = state.submit_each(items, "input_ids" if request.input_ids is not None else "text")
    answers = _Answers(state, request, started)
    many = batched or any(len(c) > 1 for c in choices)
    if request.stream:
        return EventStream(_events(answers, requests, choices, many), requests)

    async for i, chunk in collected_chunks(http_request, requests):
        _add(choices[i][chunk.index], chunk)
    out = []
    for i, stream in enumerate(requests.streams):
        output = await asyncio.to_thread(stream.result, 30)  # the stream has ended: at once
        for j, choice in enumerate(choices[i]):
            routed = output.outputs[j].routed_experts if request.return_routed_experts else None
            out.append(answers.answer(choice, output, routed))
    return out if many else out[0]


def _add(choice: _Choice, chunk) -> None:
    choice.ids += [int(t) for t in chunk.token_ids]
    choice.text += chunk.text or ""
    if choice.own is not None:
        choice.shown += choice.own.add(chunk.token_ids, chunk.finished, chunk.finish_reason)
    if chunk.logprobs:
        choice.logprobs += chunk.logprobs
    if chunk.finished:
        choice.finish_reason = chunk.finish_reason


def _event(body) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _events(answers: _Answers, requests, choices, many: bool):
    n = [len(c) for c in choices]
    offsets = [sum(n[:i]) for i in range(len(n))]
    try:
        async for i, chunk in requests.chunks():
            choice = choices[i][chunk.index]
            _add(choice, chunk)
            output, routed = None, None
            if chunk.finished and all(c.finish_reason is not None for c in choices[i]):
                output = await asyncio.to_thread(requests.streams[i].result, 30)
                if answers.request.return_routed_experts and output is not None:
                    routed = output.outputs[chunk.index].routed_experts
            index = offsets[i] + chunk.index if many else None
            yield _event(answers.answer(choice, output, routed, index))
    except ServerClosing:
        yield _event(shutting_down().response_body())
    except Exception as exc:
        yield _event(APIError(f"generation failed: {exc}", status=500).response_body())
    yield DONE
