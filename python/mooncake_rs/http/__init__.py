"""The OpenAI-compatible HTTP front door (``mooncake-rs serve``).

Needs the ``http`` extra (Starlette, uvicorn, tokenizers, jinja2): ``pip install
"mooncake-rs[http]"``. ``import mooncake_rs`` does not import this package. See docs/http.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import ApiError
from .front import Frontend
from .limits import FrontLimits
from .protocol import GenerateRequest, parse_chat, parse_completion

__all__ = ["ApiError", "Frontend", "FrontLimits", "GenerateRequest", "parse_chat", "parse_completion", "create_app", "ServerThread"]


if TYPE_CHECKING:
    from .app import create_app
    from .server import ServerThread


def __getattr__(name: str) -> Any:
    # The ASGI parts import Starlette / uvicorn only when asked for.
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "ServerThread":
        from .server import ServerThread

        return ServerThread
    raise AttributeError(name)
