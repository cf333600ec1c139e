"""A model's own chat template, rendered with the semantics of transformers' ``apply_chat_template``.

``ChatTemplate.from_model_dir(dir)`` finds the template where transformers
looks for it (``chat_template.jinja``, ``chat_template.json``, or the
``chat_template`` key of ``tokenizer_config.json``; a list of named templates
picks ``default``) together with the special tokens the template may use
(``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``). ``render`` uses
the same jinja2 set-up as transformers: a sandboxed environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``tojson`` filter that does not escape HTML, and ``raise_exception`` /
``strftime_now`` globals. Tokenize the result without adding special tokens
(the template already wrote them), as transformers does.

``chat_token_ids(template, tokenizer, messages)`` is that text's token ids;
``end_of_turn_ids`` gives the token ids that end an assistant turn: the
``eos_token_id`` of ``generation_config.json`` and ``config.json`` (an int or a
list) and the id of the tokenizer's ``eos_token``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The messages do not fit the template (it called ``raise_exception``) or the template is broken."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat_template: not a valid jinja2 template (line {exc.lineno}: {exc.message})") \
            from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatTemplateError(f"{where}: a list of templates without one named 'default' (found {sorted(map(str, named))})")
    raise ChatTemplateError(f"{where}: expected a string or a list of named templates, got {type(value).__name__}")


def normalize_content(content) -> str:
    """A message's content as the template sees it: a string, or text parts joined with newlines.

    ``[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]`` becomes
    ``"a\\nb"`` (what vLLM passes to string-content templates). ValueError
    for any other part type.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"content[{i}]: only {{\"type\": \"text\", \"text\": str}} parts are supported, "
                                 f"got {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"content: expected a string or a list of text parts, got {type(content).__name__}")


class ChatTemplate:
    """A compiled chat template plus the special tokens it may reference. Immutable; thread-safe."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if isinstance(v, str)}
        self._template = _compile(source)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, override: str | None = None) -> ChatTemplate | None:
        """The template of a Hugging Face model directory, or None when it has none.

        ``override`` (a path to a ``.jinja`` file, or the template text itself)
        replaces the directory's template; the special tokens still come from
        ``tokenizer_config.json`` / ``special_tokens_map.json``.
        """
        root = Path(model_dir)
        tok_cfg = _read_json(root / "tokenizer_config.json")
        specials = {}
        for source in (_read_json(root / "special_tokens_map.json"), tok_cfg):
            for name in SPECIAL_TOKENS:
                text = _token_text(source.get(name))
                if text is not None:
                    specials[name] = text
        if override is not None:
            path = Path(override)
            try:
                is_file = path.is_file()
            except OSError:  # a template text too long to be a path
                is_file = False
            return cls(path.read_text() if is_file else override, specials)
        if (root / "chat_template.jinja").is_file():
            source = (root / "chat_template.jinja").read_text()
        elif (root / "chat_template.json").is_file():
            source = _pick_template(_read_json(root / "chat_template.json").get("chat_template"),
                                    str(root / "chat_template.json"))
        else:
            source = _pick_template(tok_cfg.get("chat_template"), str(root / "tokenizer_config.json"))
        return None if source is None else cls(source, specials)

    def render(self, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
        """The conversation as the prompt text the model was trained on.

        ``messages``: ``{"role": ..., "content": str | [text parts], ...}``
        dicts (other keys are passed through to the template). With
        ``add_generation_prompt`` the text ends with the header of an
        assistant turn. ``kwargs`` reach the template as variables (they win
        over the special tokens, as in transformers). ChatTemplateError when
        the template raises or fails; ValueError for unsupported content.
        """
        msgs = []
        for i, m in enumerate(messages):
            m = dict(m)
            if "content" in m and m["content"] is not None:
                try:
                    m["content"] = normalize_content(m["content"])
                except ValueError as exc:
                    raise ValueError(f"messages[{i}].{exc}") from None
            msgs.append(m)
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=msgs, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from None
        except (TypeError, AttributeError, KeyError, IndexError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {type(exc).__name__}: {exc}") from None


def end_of_turn_ids(model_dir: str | Path, token_id: Callable[[str], int | None]) -> tuple[int, ...]:
    """Token ids that end a turn: ``eos_token_id`` from generation_config.json and config.json, and the id
    (through ``token_id``) of tokenizer_config.json's ``eos_token``. Sorted, without duplicates."""
    root = Path(model_dir)
    ids: set[int] = set()
    for cfg in (_read_json(root / "generation_config.json"), _read_json(root / "config.json")):
        eos = cfg.get("eos_token_id")
        for t in eos if isinstance(eos, list) else [eos]:
            if isinstance(t, int) and not isinstance(t, bool):
                ids.add(t)
    text = _token_text(_read_json(root / "tokenizer_config.json").get("eos_token"))
    if text is not None:
        t = token_id(text)
        if t is not None:
            ids.add(t)
    return tuple(sorted(ids))


def chat_token_ids(template: ChatTemplate, tokenizer, messages: Iterable[Mapping[str, Any]],
                   add_generation_prompt: bool = True) -> list[int]:
    """The prompt ids of a conversation, as transformers' ``apply_chat_template(..., tokenize=True)`` gives
    them: the rendered text encoded without added special tokens. ``tokenizer``: the engine's
    ``Tokenizer`` (anything with ``encode(text, add_special_tokens=...)``). Used by ``tierkv serve``."""
    return tokenizer.encode(template.render(messages, add_generation_prompt), add_special_tokens=False)


def apply_chat_template(model_dir: str | Path, messages: Iterable[Mapping[str, Any]],
                        add_generation_prompt: bool = True) -> str:
    """Render ``messages`` with ``model_dir``'s own template (ValueError when it has none); a shortcut for
    ``ChatTemplate.from_model_dir(model_dir).render(messages, add_generation_prompt)``."""
    template = ChatTemplate.from_model_dir(model_dir)
    if template is None:
        raise ValueError(f"chat_template: {model_dir} has none (no chat_template.jinja, chat_template.json or "
                         "tokenizer_config.json chat_template)")
    return template.render(messages, add_generation_prompt)
