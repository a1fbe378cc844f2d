//! Checks of plain arguments that every front end (the Python glue, a CLI) passes the
//! same way: seconds that must be a positive duration, lists that must pair up. Their
//! error is an [`ArgumentError`] (category `InvalidArgument`) whose message says what
//! to pass instead.

use std::time::Duration;

use crate::{Categorized, ErrorCategory};

/// A malformed argument; the message names it and what it must be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ArgumentError(pub String);

impl Categorized for ArgumentError {
    fn category(&self) -> ErrorCategory {
        ErrorCategory::InvalidArgument
    }
}

/// `secs` seconds (argument `what`) as a duration. NaN, zero and negative are refused;
/// anything too large to represent (1e300, inf) means "no deadline" and becomes
/// `Duration::MAX` (whoever adds it to an instant adds it checked); a positive value
/// below a nanosecond is one nanosecond (not zero, which elsewhere means "poll").
pub fn positive_secs(what: &str, secs: f64) -> Result<Duration, ArgumentError> {
    if secs.is_nan() || secs <= 0.0 {
        return Err(ArgumentError(format!("{what} must be a positive number of seconds, got {secs}")));
    }
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if d.is_zero() => Ok(Duration::from_nanos(1)),
        Ok(d) => Ok(d),
        Err(_) => Ok(Duration::MAX),
    }
}

/// A wait of `secs` seconds: zero or less polls (`Duration::ZERO`), NaN is refused,
/// otherwise as [`positive_secs`].
pub fn wait_secs(what: &str, secs: f64) -> Result<Duration, ArgumentError> {
    if secs <= 0.0 {
        return Ok(Duration::ZERO);
    }
    positive_secs(what, secs)
}

/// Checks that two per-item lists (named `a` and `b`) have one entry each per item.
pub fn same_len(a: &str, a_len: usize, b: &str, b_len: usize) -> Result<(), ArgumentError> {
    if a_len != b_len {
        return Err(ArgumentError(format!("{a} has {a_len} entries, {b} {b_len}: one each per request")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positive_secs_refuses_nan_zero_and_negative() {
        for bad in [f64::NAN, 0.0, -0.0, -1.5, f64::NEG_INFINITY] {
            let e = positive_secs("timeout_s", bad).unwrap_err();
            assert!(e.0.starts_with("timeout_s must be a positive number of seconds"), "{e}");
            assert_eq!(e.category(), ErrorCategory::InvalidArgument);
        }
    }

    #[test]
    fn positive_secs_converts_and_clamps_huge_to_no_deadline() {
        assert_eq!(positive_secs("t", 1.5).unwrap(), Duration::from_millis(1500));
        assert_eq!(positive_secs("t", 1e300).unwrap(), Duration::MAX);
        assert_eq!(positive_secs("t", f64::INFINITY).unwrap(), Duration::MAX);
        // Smaller than a nanosecond: positive, so the shortest deadline, not none.
        assert_eq!(positive_secs("t", 1e-12).unwrap(), Duration::from_nanos(1));
    }

    #[test]
    fn wait_secs_polls_at_zero_or_less_and_refuses_nan() {
        assert_eq!(wait_secs("t", 0.0).unwrap(), Duration::ZERO);
        assert_eq!(wait_secs("t", -3.0).unwrap(), Duration::ZERO);
        assert_eq!(wait_secs("t", 0.25).unwrap(), Duration::from_millis(250));
        assert!(wait_secs("t", f64::NAN).is_err());
    }

    #[test]
    fn same_len_names_both_lists() {
        assert!(same_len("a", 3, "b", 3).is_ok());
        assert_eq!(same_len("a", 3, "b", 2).unwrap_err().0, "a has 3 entries, b 2: one each per request");
    }
}
