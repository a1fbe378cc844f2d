//! Rust-side logging: `tracing`, filtered by the `MOONCAKE_LOG` environment variable
//! (`error`, `warn` (default), `info`, `debug`, `trace`, or a full `tracing` filter such
//! as `mooncake_core::store=debug`). Logs go to stderr.

pub fn init_from_env() {
    let filter = std::env::var("MOONCAKE_LOG").unwrap_or_else(|_| "warn".to_string());
    let filter =
        tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colour codes only on a terminal: in a log file or a pipe they are noise.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // A second import (or an embedding app with its own subscriber) keeps the first one.
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).try_init();
}
