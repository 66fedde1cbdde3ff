//! Stop strings: ending a generation where its text first contains one of them.
//!
//! Text arrives in pieces as tokens are decoded, and a stop string can straddle pieces, so the
//! matcher holds back the end of the text that could still become a stop string and releases
//! it once it cannot. The stop string itself is never part of the output (OpenAI's behaviour).

/// Most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 16;

/// Longest stop string accepted, in bytes.
pub const MAX_STOP_BYTES: usize = 256;

/// Finds the first stop string in a stream of text pieces.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released.
    held: String,
    stopped: bool,
}

/// What the matcher releases for one piece.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text that is certainly output.
    pub text: String,
    /// Whether a stop string was found: nothing follows.
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings ignored).
    pub fn new(stops: impl IntoIterator<Item = String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Whether there is anything to match.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Takes the next piece of text and returns what can be released.
    pub fn push(&mut self, piece: &str) -> Released {
        if self.stopped {
            return Released {
                text: String::new(),
                stopped: true,
            };
        }
        if self.stops.is_empty() {
            return Released {
                text: piece.to_string(),
                stopped: false,
            };
        }
        self.held.push_str(piece);
        let first = self.stops.iter().filter_map(|stop| self.held.find(stop.as_str())).min();
        if let Some(at) = first {
            self.stopped = true;
            let text = self.held[..at].to_string();
            self.held.clear();
            return Released { text, stopped: true };
        }
        // Keep the longest tail that is the start of some stop string.
        let keep = self
            .stops
            .iter()
            .map(|stop| longest_suffix_prefix(&self.held, stop))
            .max()
            .unwrap_or(0);
        let release = self.held.len() - keep;
        let text = self.held[..release].to_string();
        self.held.drain(..release);
        Released { text, stopped: false }
    }

    /// Releases what is held back, at the end of the generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop` and ends on a
/// character boundary of `text`.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let longest = (stop.len() - 1).min(text.len());
    (1..=longest)
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && stop.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut matcher = StopMatcher::new(stops.iter().map(|s| s.to_string()));
        let mut out = String::new();
        for piece in pieces {
            let released = matcher.push(piece);
            out.push_str(&released.text);
            if released.stopped {
                return (out, true);
            }
        }
        out.push_str(&matcher.finish());
        (out, false)
    }

    #[test]
    fn a_stop_string_across_pieces_ends_the_text_before_it() {
        assert_eq!(run(&["STOP"], &["hello S", "TO", "P world"]), ("hello ".into(), true));
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
        assert_eq!(
            run(&["xyz", "b"], &["aaab", "xyz"]),
            ("aaa".into(), true),
            "the first occurrence wins"
        );
    }

    #[test]
    fn text_that_only_looks_like_a_stop_string_is_released() {
        assert_eq!(run(&["STOP"], &["ST", "ART"]), ("START".into(), false));
        assert_eq!(
            run(&["STOP"], &["ends with ST"]),
            ("ends with ST".into(), false),
            "flushed at the end"
        );
        let mut matcher = StopMatcher::new(["END".to_string()]);
        assert_eq!(matcher.push("abc E").text, "abc ", "only the possible start is held");
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(
            run(&["é!"], &["café", "!"]),
            ("caf".into(), true),
            "multi-byte characters"
        );
    }
}
