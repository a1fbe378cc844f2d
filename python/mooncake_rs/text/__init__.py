"""Text for the front door: tokenizers, chat templates, streaming detokenization, stop strings.

Needs the ``tokenizers`` library (and ``jinja2`` for chat templates): ``pip install
"mooncake-rs[http]"``. ``import mooncake_rs`` does not import this package.
"""

from __future__ import annotations

from .chat_template import ChatTemplate, normalize_messages
from .detokenizer import IncrementalDetokenizer
from .stop import StopStrings
from .tokenizer import Tokenizer

__all__ = ["Tokenizer", "ChatTemplate", "IncrementalDetokenizer", "StopStrings", "normalize_messages"]
