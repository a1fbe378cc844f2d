"""The tests' tiny model maker is the package's (``mooncake_rs.models.tiny``, the code of
``mooncake-rs make-model``); this name is kept for the tests that import it."""

from mooncake_rs.models.tiny import *  # noqa: F401,F403
from mooncake_rs.models.tiny import CHAT_TEMPLATE, CORPUS, SPECIALS  # noqa: F401
