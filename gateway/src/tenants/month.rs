//! Calendar months (UTC) for monthly quotas, and the file that keeps a month's usage across
//! restarts.
//!
//! A quota counts the tokens of the current calendar month in UTC and starts again at zero
//! when the month turns. The usage file (`[tenants] usage_file`) holds the month and each
//! tenant's tokens in it as JSON; it is replaced whole (written beside and flushed to the disk,
//! renamed over the old one, then the folder flushed), so a crash or a power loss leaves the
//! old file or the new one, never half of one. A file that is damaged anyway (a disk or a
//! person) is moved aside with an error log, and the month's usage starts from zero: losing
//! the count is better than a gateway that does not start.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
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
    /// Reads the file; a missing file is an empty month, and so is a damaged one, which is
    /// renamed aside (`FILE.damaged-UNIXSECONDS`) with an error log.
    pub(crate) fn load(path: &Path) -> Result<Option<UsageFile>, String> {
        match std::fs::read(path) {
            Ok(bytes) => match serde_json::from_slice(&bytes) {
                Ok(usage) => Ok(Some(usage)),
                Err(err) => {
                    set_aside(path, &err.to_string());
                    Ok(None)
                }
            },
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(format!("{}: cannot read: {err}", path.display())),
        }
    }

    /// Replaces the file with these contents, durably: the new contents reach the disk before
    /// the rename, and the rename before this returns.
    pub(crate) fn save(&self, path: &Path) -> std::io::Result<()> {
        // The periodic save and the one at exit may overlap; they share the staging file.
        static SAVING: Mutex<()> = Mutex::new(());
        let _one_at_a_time = SAVING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut staged = path.as_os_str().to_owned();
        staged.push(".new");
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        let mut file = std::fs::File::create(&staged)?;
        file.write_all(&json)?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&staged, path)?;
        // The rename lives in the folder: flushed, it survives a power loss too.
        let folder = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        std::fs::File::open(folder)?.sync_all()
    }
}

/// Moves a damaged usage file aside for a person to look at, and says so.
fn set_aside(path: &Path, why: &str) {
    let seconds = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|since| since.as_secs())
        .unwrap_or(0);
    let mut aside = path.as_os_str().to_owned();
    aside.push(format!(".damaged-{seconds}"));
    let aside = std::path::PathBuf::from(aside);
    match std::fs::rename(path, &aside) {
        Ok(()) => tracing::error!(
            path = %path.display(),
            moved_to = %aside.display(),
            error = why,
            "the usage file is damaged; moved aside, this month's usage counts from zero"
        ),
        Err(err) => tracing::error!(
            path = %path.display(),
            error = why,
            rename_error = %err,
            "the usage file is damaged and cannot be moved aside; this month's usage counts from zero and the next save replaces it"
        ),
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
        let files = std::fs::read_dir(dir.path()).expect("dir").count();
        assert_eq!(files, 1, "nothing staged is left beside the file");
    }

    #[test]
    fn a_damaged_file_is_set_aside_and_the_month_starts_empty() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("usage.json");
        // Empty, as a power loss can leave a file that was renamed before its data reached
        // the disk; then half of one.
        for damaged in [&b""[..], &b"{\"month\": \"2026-11\", \"tok"[..]] {
            std::fs::write(&path, damaged).expect("write");
            assert_eq!(UsageFile::load(&path), Ok(None));
            assert!(!path.exists(), "the damaged file was moved aside");
            let aside: Vec<String> = std::fs::read_dir(dir.path())
                .expect("dir")
                .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
                .filter(|name| name.starts_with("usage.json.damaged-"))
                .collect();
            assert!(!aside.is_empty(), "kept aside for a look");
            for name in aside {
                assert_eq!(std::fs::read(dir.path().join(&name)).expect("read"), damaged);
                std::fs::remove_file(dir.path().join(name)).expect("clean");
            }
        }
    }
}
