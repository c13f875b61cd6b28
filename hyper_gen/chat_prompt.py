"""A conversation as prompt ids: the tokenizer's chat template (or plain "Role: text" lines), with
the oldest turns dropped until the prompt and the reply fit the model's context.

Every rank of a chat job runs this on the same messages and gets the same ids, so only the text
travels between ranks, never the tokens."""

from __future__ import annotations

from typing import List, Optional, Tuple


def format_conversation(tokenizer, messages) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])


def fit_context(tokenizer, messages, context: Optional[int], max_new_tokens: int) -> Tuple[List[dict], object]:
    """(messages, prompt ids (1, T) numpy) with the oldest turns dropped until the prompt and
    ``max_new_tokens`` fit the model's ``context`` (None: no limit); ids None when even the last
    message does not fit. A leading system message is kept: it says who the assistant is."""
    system = messages[:1] if messages and messages[0].get("role") == "system" else []
    turns = messages[len(system) :]
    while True:
        text = format_conversation(tokenizer, system + turns)
        ids = tokenizer(text, return_tensors="np", add_special_tokens=False)["input_ids"]
        if context is None or ids.shape[1] + max_new_tokens <= context:
            return system + turns, ids
        if len(turns) <= 1:
            return [], None
        turns = turns[2:] if len(turns) > 2 else turns[-1:]  # drop the oldest user/assistant pair
