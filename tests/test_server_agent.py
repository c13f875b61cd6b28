"""Agent turns on ``hyper-gen serve`` through the official ``openai`` client, torch and MindSpore (issue 47):
structured outputs (``response_format``, vLLM's ``guided_*``), tools with a constrained ``tool_choice``
on the random-ish demo model, a multi-turn conversation with a tool result, ``chat_template_kwargs``
and ``reasoning_content``, and 400s naming the field."""

import json
import re
import signal

import jsonschema
import openai
import pytest
from test_server import Server, serve_cmd

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "rev 1234 ="}]


@pytest.fixture(scope="module", params=["torch", "mindspore"])
def server(request):
    server = Server(
        serve_cmd(request.param, "--max-batch-size", "8", "--served-model-name", "demo", "--reasoning-parser", "qwen3")
    )
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log
    assert "Traceback" not in server.log, server.log


def test_response_format_json_schema_every_choice_validates(server):
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    out = client.chat.completions.create(
        model="demo", messages=MESSAGES, n=4, seed=7, temperature=1.0, max_tokens=60, response_format=fmt
    )
    assert len(out.choices) == 4
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"
    again = client.chat.completions.create(
        model="demo", messages=MESSAGES, n=4, seed=7, temperature=1.0, max_tokens=60, response_format=fmt
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    stream = client.chat.completions.create(
        model="demo", messages=MESSAGES, n=2, seed=7, temperature=1.0, max_tokens=60, response_format=fmt, stream=True
    )
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[0], texts[1]] == [c.message.content for c in out.choices[:2]]
    json_object = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(json_object.choices[0].message.content), dict)


def test_guided_extras_on_both_endpoints(server):
    client = server.client()
    out = client.completions.create(
        model="demo",
        prompt="rev 12 =",
        max_tokens=10,
        temperature=1.0,
        seed=3,
        n=3,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert all(c.text in ("yes", "no") for c in out.choices)
    out = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"guided_regex": "[a-c]{4}"}
    )
    assert len(out.choices[0].message.content) == 4 and set(out.choices[0].message.content) <= set("abc")
    out = client.completions.create(
        model="demo",
        prompt="rev 12 =",
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA}},
    )
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


def test_schema_admitting_everything_equals_unconstrained_greedy(server):
    client = server.client()
    free = client.completions.create(model="demo", prompt="rev 4567 =", max_tokens=12, temperature=0)
    loose = client.completions.create(
        model="demo", prompt="rev 4567 =", max_tokens=12, temperature=0, extra_body={"guided_regex": "(.|\\n)*"}
    )
    assert loose.choices[0].text == free.choices[0].text


def _check_call(call):
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_tool_choice_constrains_a_valid_call_and_streams_it(server, tool_choice):
    client = server.client()
    kwargs = dict(model="demo", messages=MESSAGES, tools=[WEATHER], tool_choice=tool_choice, max_tokens=120, seed=5)
    out = client.chat.completions.create(temperature=1.0, **kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])
    calls, finish = {}, None
    for chunk in client.chat.completions.create(temperature=1.0, stream=True, **kwargs):
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function.name:
                    assert not entry["arguments"], "the name comes first"
                    entry["name"] += delta.function.name
                entry["arguments"] += delta.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert calls == {0: {"name": "get_weather", "arguments": choice.message.tool_calls[0].function.arguments}}


def test_multi_turn_with_a_tool_result(server):
    client = server.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=[WEATHER], tool_choice=named, max_tokens=120, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = client.chat.completions.create(
        model="demo",
        messages=messages,
        tools=[WEATHER],
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    prompt = second.model_extra["prompt_token_ids"]
    first_prompt = client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=[WEATHER], max_tokens=1, extra_body={"return_token_ids": True}
    ).model_extra["prompt_token_ids"]
    assert len(prompt) > len(first_prompt) + len(call.function.arguments)  # the call and its result are in the prompt
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_chat_template_kwargs_and_reasoning_content(server):
    client = server.client()
    plain = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    thinking = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": True}},
    )
    assert len(thinking.model_extra["prompt_token_ids"]) == len(plain.model_extra["prompt_token_ids"]) + len(" <think>")
    # the open <think> of the prompt: everything up to </think> is reasoning (none here in 8 tokens)
    message = thinking.choices[0].message
    assert message.model_extra.get("reasoning_content") or message.content is not None


@pytest.mark.parametrize(
    "extra, field",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"guided_regex": "([a-"}, "guided_regex"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, extra, field):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == field, err.value.body


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
            "required": ["a", "b"],
        },
    },
}


@pytest.mark.parametrize("seed", [0, 1])
def test_qwen3_coder_required_calls_parse_and_validate(seed):
    """``--tool-call-parser qwen3_coder``: ``required`` constrains the output to qwen3_coder's XML-ish
    format (not hermes' JSON), which the same parser reads back into a call whose arguments validate."""
    from types import SimpleNamespace

    from demo_task import DEMO_MODEL_DIR
    from transformers import AutoTokenizer

    from hyper_gen import generate, load_model
    from hyper_gen.server.tools import ToolCalls, check_tools, tool_grammar

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    model = load_model(DEMO_MODEL_DIR, backend="torch")
    request = SimpleNamespace(tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=None)
    functions = check_tools(request)
    grammar = tool_grammar(request, functions, "qwen3_coder")
    ids = [tokenizer("rev 123 =")["input_ids"]]
    out = generate(
        model, ids, max_new_tokens=200, tokenizer=tokenizer, structured_outputs=grammar, do_sample=True, seed=seed
    )
    text = tokenizer.decode(out.numpy()[0, len(ids[0]) :], skip_special_tokens=True)
    assert text.startswith("<tool_call>\n<function=") and text.endswith("</function>\n</tool_call>"), text
    content, calls = ToolCalls("qwen3_coder").feed(text, final=True)
    assert content == "" and len(calls) == 1, (text, calls)
    name = calls[0]["function"]["name"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), functions[name])


def test_reasoning_content_splits_at_the_think_close_whole_and_streamed(server):
    """A thinking turn (the template opens ``<think>``) whose output a regex holds to ``ddd</think>dd``:
    ``--reasoning-parser qwen3`` returns the digits before ``</think>`` as ``reasoning_content`` and the
    rest as ``content``, whole and as stream deltas, while the token ids are all the sampled text's."""
    client = server.client()
    extra = {
        "chat_template_kwargs": {"enable_thinking": True},
        "guided_regex": "[0-9]{3}</think>[0-9]{2}",
        "return_token_ids": True,
    }
    whole = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=20, temperature=0, extra_body=extra
    )
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch("[0-9]{3}", reasoning) and re.fullmatch("[0-9]{2}", message.content), message
    from demo_task import DEMO_MODEL_DIR
    from transformers import AutoTokenizer

    ids = whole.choices[0].model_extra["token_ids"]
    text = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR).decode(ids, skip_special_tokens=True)
    assert text == f"{reasoning}</think>{message.content}"
    stream = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=20, temperature=0, stream=True, extra_body=extra
    )
    parts = {"reasoning_content": "", "content": ""}
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            parts["content"] += delta.content or ""
    assert parts == {"reasoning_content": reasoning, "content": message.content}
