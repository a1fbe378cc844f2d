"""``Tokenizer``: a model directory's ``tokenizer.json`` (the ``tokenizers`` library) and
its ``tokenizer_config.json`` (special tokens, chat template).

Nothing is downloaded: the files must be in the directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ..errors import InvalidArgument
from .chat_template import ChatTemplate, normalize_messages

__all__ = ["Tokenizer"]


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as an AddedToken dict
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template_of(cfg: dict[str, Any], directory: Path) -> str | None:
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if isinstance(tpl, str) and tpl:
        return tpl
    side = directory / "chat_template.jinja"  # newer Hugging Face layouts keep it in its own file
    return side.read_text(encoding="utf-8") if side.is_file() else None


class Tokenizer:
    """Text <-> token ids for one model.

    ``Tokenizer.from_dir(path)`` reads ``tokenizer.json`` and, when present,
    ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``chat_template``; a
    ``chat_template.jinja`` file next to it also counts). ``encode`` applies the
    tokenizer's post-processor (the BOS it adds) unless ``add_special_tokens=False``;
    ``decode`` skips special tokens by default.
    """

    def __init__(self, tokenizer: Any, *, bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.chat_template = None if chat_template is None else ChatTemplate(
            chat_template, bos_token=bos_token or "", eos_token=eos_token or "")

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise InvalidArgument(f"{d} has no tokenizer.json: the front needs the model's fast tokenizer file "
                                  "(save it with tokenizer.save_pretrained(dir) or pass --tokenizer DIR)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exception on a bad file
            raise InvalidArgument(f"{path} could not be loaded by the tokenizers library: {e}") from None
        cfg: dict[str, Any] = {}
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise InvalidArgument(f"{cfg_path} is not valid JSON: {e}") from None
        return cls(tok, bos_token=_token_text(cfg.get("bos_token")), eos_token=_token_text(cfg.get("eos_token")),
                   chat_template=_chat_template_of(cfg, d))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Ids 0..vocab_size-1, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgument(f"text to encode must be a string, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Any, *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text of OpenAI-style ``messages``. ``InvalidArgument`` when the
        model has no chat template or the template refuses the messages."""
        if self.chat_template is None:
            raise InvalidArgument("this model has no chat template (tokenizer_config.json has no 'chat_template'); "
                                  "use /v1/completions with a prompt, or add a template to the model directory")
        return self.chat_template.render(normalize_messages(messages), add_generation_prompt=add_generation_prompt,
                                         **extra)

    def encode_chat(self, messages: Any, *, add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """``apply_chat_template`` then ``encode`` without the post-processor's specials:
        the template writes its own BOS, so it is not doubled."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra),
                           add_special_tokens=False)
