"""``mooncake`` as seen by a process whose PYTHONPATH starts with mooncake_rs/compat/shim:
the Mooncake-Store-compatible facade of mooncake_rs (see mooncake_rs.compat)."""
