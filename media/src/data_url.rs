//! From request text to bytes: `data:` URLs and bare base64.
//!
//! OpenAI-style requests carry media inline: `image_url.url` / `video_url.url` as RFC 2397 data
//! URLs (`data:image/png;base64,iVBOR...`) and `input_audio.data` as bare base64. This module
//! decodes both with the `base64` crate, accepting the standard and URL-safe alphabets, with or
//! without padding, and ignoring ASCII whitespace (line-wrapped base64 is common). A remote
//! `http(s)://` URL is not fetched here: it is reported as not a data URL, and whether to fetch
//! it is the gateway's decision.

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD_PAD_INDIFFERENT, URL_SAFE_PAD_INDIFFERENT};

use crate::error::MediaError;

/// A decoded `data:` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataUrl {
    /// The media type as written, lowercased and without parameters (`image/png`); RFC 2397's
    /// default `text/plain` when the URL names none.
    pub mime: String,
    /// The decoded bytes.
    pub bytes: Vec<u8>,
}

/// Decodes a base64 `data:` URL (`data:<media type>[;<param>...];base64,<data>`).
///
/// Errors: [`MediaError::NotDataUrl`] for anything that is not a `data:` URL with a comma (a
/// remote URL, a file path, ...), [`MediaError::NotBase64`] for a data URL without `;base64`
/// (percent-encoded text), [`MediaError::BadBase64`] when the data does not decode.
pub fn decode_data_url(url: &str) -> Result<DataUrl, MediaError> {
    let url = url.trim();
    let scheme_ok = url.get(..5).is_some_and(|s| s.eq_ignore_ascii_case("data:"));
    if !scheme_ok {
        let shown: String = url.chars().take(40).collect();
        let more = if url.chars().count() > 40 { "..." } else { "" };
        return Err(MediaError::NotDataUrl(format!(
            "`{shown}{more}` (expected `data:<media type>;base64,<data>`)"
        )));
    }
    let rest = &url[5..];
    let Some((meta, data)) = rest.split_once(',') else {
        return Err(MediaError::NotDataUrl("no comma before the data".to_owned()));
    };
    let mut params = meta.split(';');
    let mime = params.next().unwrap_or_default().trim().to_ascii_lowercase();
    let base64 = params.any(|p| p.trim().eq_ignore_ascii_case("base64"));
    let mime = if mime.is_empty() { "text/plain".to_owned() } else { mime };
    if !base64 {
        return Err(MediaError::NotBase64(meta.chars().take(80).collect()));
    }
    Ok(DataUrl {
        mime,
        bytes: decode_base64(data)?,
    })
}

/// Decodes base64 text (as in `input_audio.data`): standard or URL-safe alphabet, padding
/// optional, ASCII whitespace ignored.
pub fn decode_base64(data: &str) -> Result<Vec<u8>, MediaError> {
    let data = data.trim();
    let cleaned;
    let data = if data.bytes().any(|b| b.is_ascii_whitespace()) {
        cleaned = data.bytes().filter(|b| !b.is_ascii_whitespace()).collect::<Vec<u8>>();
        &cleaned[..]
    } else {
        data.as_bytes()
    };
    if data.is_empty() {
        return Err(MediaError::BadBase64("no data".to_owned()));
    }
    let url_safe = data.iter().any(|&b| b == b'-' || b == b'_');
    let engine = if url_safe {
        &URL_SAFE_PAD_INDIFFERENT
    } else {
        &STANDARD_PAD_INDIFFERENT
    };
    engine.decode(data).map_err(|e| MediaError::BadBase64(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_urls() {
        let u = decode_data_url("data:image/PNG;base64,aGVsbG8=").unwrap();
        assert_eq!(
            u,
            DataUrl {
                mime: "image/png".into(),
                bytes: b"hello".to_vec()
            }
        );
        // Parameters, no padding, whitespace, upper-case scheme.
        let u = decode_data_url(" DATA:audio/wav;name=a.wav;base64,aGVs\nbG8 ").unwrap();
        assert_eq!((u.mime.as_str(), &u.bytes[..]), ("audio/wav", &b"hello"[..]));
        // URL-safe alphabet.
        assert_eq!(decode_data_url("data:;base64,-_8").unwrap().bytes, vec![0xfb, 0xff]);
        assert_eq!(decode_data_url("data:;base64,-_8").unwrap().mime, "text/plain");
    }

    #[test]
    fn data_url_errors() {
        let e = decode_data_url("https://example.com/cat.png").unwrap_err();
        assert!(matches!(e, MediaError::NotDataUrl(_)), "{e}");
        assert!(e.to_string().contains("https://example.com/cat.png"), "{e}");
        assert!(matches!(
            decode_data_url("data:image/png;base64"),
            Err(MediaError::NotDataUrl(_))
        ));
        assert!(matches!(decode_data_url("dat"), Err(MediaError::NotDataUrl(_))));
        assert!(matches!(decode_data_url("daté:x"), Err(MediaError::NotDataUrl(_))));
        let e = decode_data_url("data:text/plain,hello%20world").unwrap_err();
        assert!(matches!(e, MediaError::NotBase64(_)), "{e}");
        assert!(e.to_string().contains("not base64"), "{e}");
        let e = decode_data_url("data:image/png;base64,@@@@").unwrap_err();
        assert!(matches!(e, MediaError::BadBase64(_)), "{e}");
        assert!(matches!(
            decode_data_url("data:image/png;base64,"),
            Err(MediaError::BadBase64(_))
        ));
    }

    #[test]
    fn bare_base64() {
        assert_eq!(decode_base64("AAEC").unwrap(), vec![0, 1, 2]);
        assert!(matches!(decode_base64("A"), Err(MediaError::BadBase64(_))));
        assert!(matches!(decode_base64("  "), Err(MediaError::BadBase64(_))));
        assert!(matches!(decode_base64("AA=A"), Err(MediaError::BadBase64(_))));
    }
}
