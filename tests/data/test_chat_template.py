"""Chat templates rendered with jinja2 directly match transformers' apply_chat_template(tokenize=False)
character for character; template errors and bad template files are one-line DataErrors."""

import datetime
import json

import pytest

from m2r2_jax.data.chat_template import (
    chat_prompt,
    compile_chat_template,
    load_chat_template,
    render_chat,
)
from m2r2_jax.errors import DataError

# (1) SmolLM2's ChatML template, exactly as its tokenizer_config.json decodes (real newlines inside
# the jinja string literals), with a default system turn.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

# (2) Llama-3 style: bos_token, {%- -%} whitespace control, | trim, a default system header.
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{%- if system_message %}
{{- "\\n" + system_message }}
{%- endif %}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# (3) Mistral style: bos/eos tokens, an optional system turn folded into the first user turn, and
# raise_exception when roles do not alternate.
MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# (4) tojson (with its options), {% continue %} / {% break %}, namespace, dict, tools, None-valued
# keys, reasoning aliases, undefined pad_token, a {% generation %} block, and block tags on their
# own indented lines (so trim_blocks and lstrip_blocks shape the output, no {%- -%} anywhere).
TOOLS_JSON = """{% set ns = namespace(turns=0, skipped=0) %}
{% if tools is not none %}
<tools>{{ tools | tojson }}</tools>
{% endif %}
{% if pad_token is defined %}pad={{ pad_token }}{% else %}no pad{% endif %}

{% for message in messages %}
    {% if message['role'] == 'system' and not use_system %}
        {% set ns.skipped = ns.skipped + 1 %}
        {% continue %}
    {% endif %}
    {% if message['content'] == 'STOP' %}
        {% break %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
<turn n="{{ ns.turns }}">{{ message | tojson(sort_keys=True) }}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}
    {% endif %}
    {% if 'tool_calls' in message %}
calls: {{ message['tool_calls'] | tojson(indent=2) }}
    {% endif %}
    {% if message.reasoning_content is defined %}
<think>{{ message.reasoning_content }}|{{ message.thinking }}</think>
    {% endif %}
</turn>
{% endfor %}
{{ dict(turns=ns.turns, skipped=ns.skipped) | tojson(separators=(',', ':')) }}
{% if add_generation_prompt %}
<turn role="assistant">
{% endif %}"""

TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "mistral": MISTRAL, "tools_json": TOOLS_JSON}

SYSTEM = {"role": "system", "content": "  You are terse & <careful>.  "}
CONVERSATIONS = {
    "one_user": [{"role": "user", "content": "Hello there!"}],
    "system_user": [SYSTEM, {"role": "user", "content": "Hi."}],
    "multi_turn": [
        {"role": "user", "content": "What's 2+2?\n"},
        {"role": "assistant", "content": " 4. "},
        {"role": "user", "content": "And \"3+3\" — in 日本語? é"},
    ],
    "system_multi_turn": [
        SYSTEM,
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
    ],
}

SPECIAL = {
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "unk_token": None,
               "pad_token": None},
}
DEFAULT_SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None}


@pytest.fixture(scope="module")
def hf_tokenizer():
    """A transformers tokenizer built locally around a tiny word-level tokenizers.Tokenizer."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel

    def make(special):
        words = ["<unk>"] + sorted({t for t in special.values() if t is not None} - {"<unk>"})
        core = tokenizers.Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        kwargs = {k: v for k, v in special.items() if v is not None}
        return transformers.PreTrainedTokenizerFast(tokenizer_object=core, **kwargs)

    return make


def _hf_render(make, template, messages, special, add_generation_prompt, **kwargs):
    tok = make(special)
    tok.chat_template = template
    return tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=add_generation_prompt, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_matches_transformers(hf_tokenizer, name, conversation, add_generation_prompt):
    template, messages = TEMPLATES[name], CONVERSATIONS[conversation]
    special = SPECIAL.get(name, DEFAULT_SPECIAL)
    extra = {"use_system": True} if name == "tools_json" else {}
    expected = _hf_render(hf_tokenizer, template, messages, special, add_generation_prompt, **extra)
    got = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                      special_tokens=special, **extra)
    assert got == expected
    assert expected  # the comparison is not between two empty strings


def test_chatml_default_system_turn_exactly():
    got = chat_prompt(CHATML, "Hi")
    assert got == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                   "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    got = chat_prompt(CHATML, "Hi", system="Be brief.")
    assert got == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\n")


@pytest.mark.parametrize("system", [None, "Be brief."])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_prompt_matches_transformers(hf_tokenizer, name, system):
    special = SPECIAL.get(name, DEFAULT_SPECIAL)
    messages = ([] if system is None else [{"role": "system", "content": system}])
    messages.append({"role": "user", "content": "Tell me a story."})
    expected = _hf_render(hf_tokenizer, TEMPLATES[name], messages, special, True)
    assert chat_prompt(TEMPLATES[name], "Tell me a story.", system=system, special_tokens=special) == expected


def test_tools_extras_none_keys_and_reasoning_match_transformers(hf_tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "description": "a < b & 'c'",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [
        SYSTEM,
        {"role": "user", "content": "add é"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"x": 1}}],
         "reasoning": "think first"},
        {"role": "tool", "content": "2", "tool_calls": None},
        {"role": "assistant", "content": "It is 2.", "thinking": "easy", "name": None},
        {"role": "user", "content": "STOP"},
        {"role": "user", "content": "never rendered"},
    ]
    special = dict(DEFAULT_SPECIAL, pad_token="<pad>")
    for use_system in (True, False):
        for agp in (True, False):
            expected = _hf_render(hf_tokenizer, TOOLS_JSON, messages, special, agp,
                                  tools=tools, use_system=use_system)
            got = render_chat(TOOLS_JSON, messages, add_generation_prompt=agp, special_tokens=special,
                              tools=tools, use_system=use_system)
            assert got == expected
    assert '"description": "a < b & \'c\'"' in got  # tojson does not HTML-escape
    assert "é" in got and "\\u00e9" not in got  # nor escape non-ASCII
    assert "pad=<pad>" in got and "never rendered" not in got
    # Extra variables override special tokens of the same name, as in transformers.
    assert "pad=X" in render_chat(TOOLS_JSON, messages, special_tokens=special, pad_token="X")


def test_none_special_token_is_undefined():
    t = "{{ bos_token }}|{{ pad_token is defined }}|{{ pad_token }}"
    assert render_chat(t, [{"role": "user", "content": "x"}],
                       special_tokens={"bos_token": "<s>", "pad_token": None}) == "<s>|False|"


def test_strftime_now():
    before = datetime.datetime.now().strftime("%Y-%m-%d")
    got = render_chat("{{ strftime_now('%Y-%m-%d') }}", [{"role": "user", "content": "x"}])
    assert got in {before, datetime.datetime.now().strftime("%Y-%m-%d")}


def test_raise_exception_is_one_line_data_error():
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(DataError) as e:
        render_chat(MISTRAL, bad, special_tokens=DEFAULT_SPECIAL)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == ("chat template: After the optional system message, conversation roles must alternate "
                   "user/assistant/user/assistant/...")
    with pytest.raises(DataError, match="Only user and assistant roles are supported"):
        render_chat(MISTRAL, [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}],
                    special_tokens=DEFAULT_SPECIAL)


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m['content'] }}",  # unclosed for
    "{{ messages[0]['content'] }",  # unbalanced braces
    "{% if add_generation_prompt %}x{% endfor %}",
    "{% frobnicate %}",  # unknown tag
])
def test_syntax_error_is_one_line_data_error(template):
    with pytest.raises(DataError) as e:
        render_chat(template, [{"role": "user", "content": "x"}])
    msg = str(e.value)
    assert msg.startswith("chat template: syntax error on line ") and "\n" not in msg


@pytest.mark.parametrize("template, fragment", [
    ("{{ messages[0]['content'] + 1 }}", "rendering failed: TypeError"),
    ("{{ messages.append(1) }}", "chat template:"),  # immutable sandbox
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore"),
    ("{{ ''.__class__.__mro__ }}", "chat template:"),
    ("{{ nothing.here }}", "'nothing' is undefined"),
])
def test_render_problems_are_one_line_data_errors(template, fragment):
    with pytest.raises(DataError) as e:
        render_chat(template, [{"role": "user", "content": "x"}])
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("messages, fragment", [
    ([], "empty"),
    ("hello", "expected a list"),
    ([["user", "hi"]], "message 0 is a list"),
])
def test_bad_messages(messages, fragment):
    with pytest.raises(DataError, match=fragment):
        render_chat(CHATML, messages)


def test_compiled_once_per_template_text():
    assert compile_chat_template(CHATML) is compile_chat_template(str(CHATML))
    assert compile_chat_template(CHATML) is not compile_chat_template(LLAMA3)


def test_load_jinja_file(tmp_path):
    f = tmp_path / "chat_template.jinja"
    f.write_text(LLAMA3, encoding="utf-8")
    assert load_chat_template(f) == LLAMA3
    assert load_chat_template(tmp_path) == LLAMA3  # a model directory


def test_load_tokenizer_config_string_and_list(tmp_path):
    f = tmp_path / "tokenizer_config.json"
    f.write_text(json.dumps({"bos_token": "<s>", "chat_template": CHATML}), encoding="utf-8")
    assert load_chat_template(f) == CHATML
    assert load_chat_template(tmp_path) == CHATML
    f.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": TOOLS_JSON},
                                               {"name": "default", "template": MISTRAL}]}))
    assert load_chat_template(f) == MISTRAL


@pytest.mark.parametrize("name, content, fragment", [
    ("missing.jinja", None, "chat template file not found"),
    ("t.json", "{not json", "not valid JSON"),
    ("t.json", json.dumps({"bos_token": "<s>"}), "has no 'chat_template' entry"),
    ("t.json", json.dumps({"chat_template": 3}), "must be a string or a list"),
    ("t.json", json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]}),
     "no template named 'default'"),
    ("t.json", json.dumps({"chat_template": [{"name": "default"}]}), "list entries must be"),
    ("t.jinja", "   \n", "the chat template is empty"),
    ("t.jinja", "{% for m in messages %}", "syntax error on line 1"),
    ("t.json", json.dumps({"chat_template": "{{ x }"}), "syntax error"),
])
def test_load_errors_are_one_line(tmp_path, name, content, fragment):
    f = tmp_path / name
    if content is not None:
        f.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_chat_template(f)
    msg = str(e.value)
    assert fragment in msg and str(f) in msg and "\n" not in msg


def test_load_directory_without_template(tmp_path):
    with pytest.raises(DataError, match="no chat template here"):
        load_chat_template(tmp_path)


def test_load_non_utf8(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(DataError, match="not UTF-8"):
        load_chat_template(f)
