//! Calendar months (UTC) for monthly quotas, and the file that keeps a month's usage across
//! restarts.
//!
//! A quota counts the tokens of the current calendar month in UTC and starts again at zero
//! when the month turns. The usage file (`[tenants] usage_file`) holds the month and each
//! tenant's tokens in it as JSON; it is replaced whole (written beside, then renamed), so a
//! crash leaves the old file or the new one, never half of one.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// A calendar month in UTC, e.g. `2026-11`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Month {
    year: i32,
    month: u8,
}

impl Month {
    /// The month `now` falls in.
    pub(crate) fn of(now: SystemTime) -> Month {
        let date = time::OffsetDateTime::from(now).date();
        Month {
            year: date.year(),
            month: u8::from(date.month()),
        }
    }

    /// Time from `now` to the first instant of the next month.
    pub(crate) fn remaining(self, now: SystemTime) -> Duration {
        let (year, month) = if self.month == 12 {
            (self.year + 1, time::Month::January)
        } else {
            (
                self.year,
                time::Month::try_from(self.month + 1).unwrap_or(time::Month::January),
            )
        };
        let next = time::Date::from_calendar_date(year, month, 1)
            .map(|date| date.midnight().assume_utc())
            .map(SystemTime::from);
        match next {
            Ok(next) => next.duration_since(now).unwrap_or(Duration::ZERO),
            Err(_) => Duration::ZERO,
        }
    }
}

impl std::fmt::Display for Month {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:04}-{:02}", self.year, self.month)
    }
}

/// The usage file's contents.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct UsageFile {
    /// The month counted, e.g. `2026-11`.
    pub(crate) month: String,
    /// Each tenant's tokens (prompt + completion) in that month.
    pub(crate) tokens: BTreeMap<String, u64>,
}

impl UsageFile {
    /// Reads the file; a missing file is an empty month.
    pub(crate) fn load(path: &Path) -> Result<Option<UsageFile>, String> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|err| format!("{}: not a usage file: {err}", path.display())),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(format!("{}: cannot read: {err}", path.display())),
        }
    }

    /// Replaces the file with these contents.
    pub(crate) fn save(&self, path: &Path) -> std::io::Result<()> {
        let mut staged = path.as_os_str().to_owned();
        staged.push(".new");
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(&staged, json)?;
        std::fs::rename(&staged, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `YYYY-MM-DDTHH:MM:SSZ` as a time.
    fn at(text: &str) -> SystemTime {
        let number = |range: std::ops::Range<usize>| text[range].parse::<u16>().expect("digits");
        let month = time::Month::try_from(number(5..7) as u8).expect("a month");
        let date = time::Date::from_calendar_date(i32::from(number(0..4)), month, number(8..10) as u8).expect("a date");
        let moment = date
            .with_hms(number(11..13) as u8, number(14..16) as u8, number(17..19) as u8)
            .expect("a time");
        SystemTime::from(moment.assume_utc())
    }

    #[test]
    fn months_turn_at_midnight_utc() {
        let now = at("2026-11-30T23:59:30Z");
        let month = Month::of(now);
        assert_eq!(month.to_string(), "2026-11");
        assert_eq!(month.remaining(now), Duration::from_secs(30));
        let december = at("2026-12-31T23:00:00Z");
        assert_eq!(Month::of(december).to_string(), "2026-12");
        assert_eq!(Month::of(december).remaining(december), Duration::from_secs(3600));
        assert!(Month::of(at("2027-01-01T00:00:00Z")) > Month::of(december));
    }

    #[test]
    fn the_file_round_trips_and_a_missing_one_is_empty() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("usage.json");
        assert_eq!(UsageFile::load(&path), Ok(None));
        let usage = UsageFile {
            month: "2026-11".into(),
            tokens: [("acme".to_string(), 1234)].into(),
        };
        usage.save(&path).expect("saves");
        assert_eq!(UsageFile::load(&path), Ok(Some(usage)));
        std::fs::write(&path, b"{").expect("write");
        assert!(UsageFile::load(&path).unwrap_err().contains("usage.json"));
    }
}
