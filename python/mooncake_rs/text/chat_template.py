"""Chat templates: the Jinja2 template of a model's ``tokenizer_config.json``, rendered in
a sandbox.

A chat template is code that arrives with a model directory, so it is rendered in
``jinja2.sandbox.ImmutableSandboxedEnvironment``: no attribute access to internals
(``__class__``, ``__globals__``...), no mutation of the objects passed in, no imports.
The helpers templates commonly call (``raise_exception``, ``strftime_now``, a ``tojson``
that keeps non-ASCII text) are provided; nothing else is.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Sequence

from ..errors import InvalidArgument

__all__ = ["ChatTemplate", "normalize_messages"]


class _TemplateRaised(Exception):
    """A template's own ``raise_exception(msg)``: the messages broke one of its rules."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # Jinja's built-in tojson escapes <, >, & and ' for HTML; a prompt wants the text as is.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks OpenAI chat messages and flattens text-part lists into one string per message.

    Raises ``InvalidArgument`` naming the bad message."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgument(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"messages[{i}].role must be a string such as 'system', 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidArgument(f"messages[{i}].content[{j}]: only text parts "
                                          "({\"type\": \"text\", \"text\": ...}) are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content must be a string or a list of text parts")
        msg = {k: v for k, v in m.items() if k not in ("role", "content")}
        msg.update(role=role, content=content)
        out.append(msg)
    return out


class ChatTemplate:
    """A compiled chat template. ``render(messages, add_generation_prompt=True, **extra)``
    returns the prompt text; ``bos_token`` / ``eos_token`` are the tokenizer's."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not isinstance(source, str) or not source:
            raise InvalidArgument("a chat template must be a non-empty string")
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        # trim_blocks / lstrip_blocks: the whitespace rules the templates shipped with
        # Hugging Face models are written for.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined,
                                            autoescape=False)
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise InvalidArgument(f"the model's chat template does not compile: {e}") from None

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text for ``messages`` (already normalized: see :func:`normalize_messages`).
        A template that refuses the messages (its ``raise_exception``), or that tries
        something the sandbox forbids, raises ``InvalidArgument`` with its reason."""
        import jinja2
        from jinja2.sandbox import SecurityError

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except _TemplateRaised as e:
            raise InvalidArgument(f"the chat template refused these messages: {e}") from None
        except SecurityError as e:
            raise InvalidArgument(f"the chat template tried an unsafe operation and was stopped: {e}") from None
        except jinja2.TemplateError as e:
            raise InvalidArgument(f"the chat template failed on these messages: {e}") from None
