import os

# Tests never depend on the machine's logging configuration.
os.environ.setdefault("MOONCAKE_LOG", "warn")
