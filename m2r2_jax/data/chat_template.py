"""Chat prompts rendered with a model's own chat template, as Hugging Face transformers renders them.

    template = load_chat_template("path/to/tokenizer_config.json")   # or a .jinja file, or a model dir
    text = chat_prompt(template, "Write a sonnet.", system="You are a poet.",
                       special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    text = render_chat(template, messages, add_generation_prompt=True, special_tokens=...)

`render_chat` gives the same string as transformers'
`tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` without
importing transformers: the template runs in a jinja2 immutable sandbox (chat templates come from
the Hub and are untrusted code) with the same options transformers uses — `trim_blocks`,
`lstrip_blocks`, the loop-controls extension (`{% break %}`, `{% continue %}`), a no-op
`{% generation %}` block, the globals `raise_exception`, `strftime_now`, `dict` and `namespace`, and
a `tojson` filter that does not HTML-escape. The template sees `messages`, `tools`, `documents`,
`add_generation_prompt`, the special tokens that are set (a None token is left undefined, as
transformers leaves it) and any extra keyword arguments, which override special tokens of the same
name. Messages are passed as plain data with None-valued keys dropped, and a message's reasoning
(`reasoning_content`, `thinking` or `reasoning`) is visible under both `reasoning_content` and
`thinking`, as transformers does.

Compiled templates are cached by their text. Every problem — a syntax error, the template calling
`raise_exception("...")`, an undefined variable used wrongly, an unreadable template file — is a
`DataError` with one line naming it.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from m2r2_jax.errors import DataError

# The tokenizer attributes transformers passes to a chat template (its `special_tokens_map`).
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)
# Files looked for, in order, when load_chat_template is given a model directory.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
# Older jinja2 releases have known sandbox escapes; transformers refuses them too.
MIN_JINJA = (3, 1, 6)
# Names under which a message's reasoning arrives; templates read the first (and gpt-oss's `thinking`).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


# --------------------------------------------------------------------------------------------
# The jinja2 environment
# --------------------------------------------------------------------------------------------


class _DictFactory:
    """The template's `dict`: builds plain dicts, and exposes nothing of the `dict` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, keys, value=None):
        return dict.fromkeys(keys, value)


def _json_filter(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson HTML-escapes <, >, & and ' — wrong for prompts; this is plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.sandbox
        import jinja2.utils
    except ImportError:
        raise DataError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from None
    version = tuple(int(p) if p.isdigit() else 0 for p in jinja2.__version__.split(".")[:3])
    if version < MIN_JINJA:
        raise DataError(f"chat templates need jinja2>=3.1.6 (sandbox fixes), found "
                        f"{jinja2.__version__}: pip install -U jinja2")

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses underscore-prefixed attributes (a way into CPython internals)."""

        def __init__(*args, **kwargs):  # self is positional-only, so namespace(self=1) still works
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                Namespace._refuse_private(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            Namespace._refuse_private(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _refuse_private(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.sandbox.SecurityError(
                    f"a chat template may not set the underscore attribute {key!r} on a namespace")

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks;
        rendering the text just renders the body (in its own scope, as transformers' block does)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _json_filter
    env.globals.update(raise_exception=raise_exception, strftime_now=_strftime_now,
                       dict=_DictFactory(), namespace=Namespace)
    return env


@functools.lru_cache(maxsize=64)
def _compiled(template: str):
    """The compiled template for this text (cached). A syntax error is a one-line DataError."""
    import jinja2

    env = _environment()
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"chat template: syntax error on line {e.lineno}: {_one_line(e.message)}") from None


def compile_chat_template(template: str):
    """Compile (and cache) a template, raising DataError if it is not a valid jinja2 template."""
    if not isinstance(template, str):
        raise DataError(f"chat template: expected the template text (a string), got {type(template).__name__}")
    return _compiled(template)


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A copy built only of JSON-like types, so the template can reach no object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and getattr(value, "shape", None) == ():
        return _plain(item())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise DataError(f"chat messages: expected a list of message dicts, got {type(messages).__name__}")
    if not messages:
        raise DataError("chat messages: the conversation is empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise DataError(f"chat messages: message {i} is a {type(message).__name__}, expected a dict "
                            f"with 'role' and 'content'")
        message = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Optional[dict[str, Optional[str]]] = None,
    **extra,
) -> str:
    """Render `messages` with a chat template, as transformers'
    `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` does.

    `special_tokens` are template variables such as bos_token/eos_token/unk_token/pad_token; a None
    value leaves the variable undefined. `extra` are further template variables (e.g. `tools=[...]`,
    `documents=[...]`, `enable_thinking=False`); they override special tokens of the same name.
    """
    import jinja2

    compiled = compile_chat_template(template)
    chat = _prepare_messages(messages)
    variables = {}
    for name, token in (special_tokens or {}).items():
        if token is not None:
            variables[name] = str(token)
    tools = extra.pop("tools", None)
    documents = extra.pop("documents", None)
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise DataError("chat template: tools must be JSON-schema dicts")
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise DataError("chat template: documents must be dicts (e.g. with 'title' and 'text')")
    variables.update(_plain(extra))
    try:
        return compiled.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:  # raise_exception, undefined variables, sandbox refusals
        raise DataError(f"chat template: {_one_line(e.message or type(e).__name__)}") from None
    except (TypeError, ValueError, LookupError, ArithmeticError) as e:  # e.g. 'text' + None
        raise DataError(f"chat template: rendering failed: {type(e).__name__}: {_one_line(e)}") from None


def chat_prompt(
    template: str,
    user_text: str,
    *,
    system: Optional[str] = None,
    special_tokens: Optional[dict[str, Optional[str]]] = None,
) -> str:
    """One user turn (after an optional system turn), ending in the assistant's generation prompt."""
    if not isinstance(user_text, str):
        raise DataError(f"chat prompt: the user text must be a string, got {type(user_text).__name__}")
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": user_text})
    return render_chat(template, messages, add_generation_prompt=True, special_tokens=special_tokens)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _template_from_json(path: Path, text: str) -> str:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(config, dict) or "chat_template" not in config:
        raise DataError(f"{path}: has no 'chat_template' entry")
    entry = config["chat_template"]
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        named = {}
        for item in entry:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise DataError(f"{path}: 'chat_template' list entries must be "
                                f"{{\"name\": str, \"template\": str}}")
            named[item["name"]] = item["template"]
        if "default" not in named:
            raise DataError(f"{path}: 'chat_template' has no template named 'default' "
                            f"(found {sorted(named)})")
        return named["default"]
    raise DataError(f"{path}: 'chat_template' must be a string or a list of "
                    f"{{\"name\", \"template\"}} entries, got {type(entry).__name__}")


def load_chat_template(path) -> str:
    """The chat template text from a `.jinja` file, a tokenizer_config.json (or chat_template.json)
    whose `chat_template` is a string or a list of {"name", "template"} entries (the "default" one
    is taken), or a model directory holding one of those. The template is compiled to check it."""
    path = Path(path)
    if path.is_dir():
        found = next((path / name for name in TEMPLATE_FILES if (path / name).is_file()), None)
        if found is None:
            raise DataError(f"{path}: no chat template here (looked for {', '.join(TEMPLATE_FILES)})")
        path = found
    if not path.is_file():
        raise DataError(f"{path}: chat template file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({_one_line(e.strerror or e)})") from None
    template = _template_from_json(path, text) if path.suffix.lower() == ".json" else text
    if not template.strip():
        raise DataError(f"{path}: the chat template is empty")
    try:
        compile_chat_template(template)
    except DataError as e:
        raise DataError(f"{path}: {e}") from None
    return template


# --------------------------------------------------------------------------------------------
# Prompts for a model
# --------------------------------------------------------------------------------------------

CHAT_TEMPLATE_MODES = ("auto", "none")


def resolve_chat_template(tokenizer, choice: str = "auto") -> Optional[str]:
    """The template prompts are rendered with: `auto` the tokenizer's own (None when it has
    none), `none` no template (raw text), anything else a template file (`load_chat_template`)."""
    if choice == "none":
        return None
    if choice == "auto":
        return None if tokenizer is None else tokenizer.chat_template
    return load_chat_template(choice)


def encode_prompt(tokenizer, text: str, template: Optional[str] = None) -> list[int]:
    """Token ids of one user prompt. With a template: the rendered chat turn, encoded without
    adding special tokens (the template writes any BOS itself, as transformers'
    `apply_chat_template` does). Without: the raw text, after BOS when the tokenizer asks for it."""
    if template is not None:
        return list(tokenizer.encode(chat_prompt(template, text, special_tokens=tokenizer.special_tokens)))
    ids = list(tokenizer.encode(text))
    return [tokenizer.bos_id] + ids if getattr(tokenizer, "add_bos", False) else ids
