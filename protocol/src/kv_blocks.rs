//! The binary answer of a KV export that carries the blocks' keys and values.
//!
//! A decode worker whose engine needs a block's contents to take it in asks
//! [`KV_EXPORT_PATH`](crate::api::KV_EXPORT_PATH) with
//! [`KvExportRequest::payloads`](crate::api::KvExportRequest::payloads) set; a prefill worker
//! whose engine can copy its blocks out answers them in this framing, with the content type
//! [`KV_BLOCKS_CONTENT_TYPE`] (any other worker answers the names-only JSON
//! [`KvExportResponse`](crate::api::KvExportResponse), which such a decode worker must not import
//! from). This module owns the framing, not what a payload holds: that is the exporting
//! engine's format, which the importing engine checks.
//!
//! ```text
//! u32, little-endian   H: bytes of the JSON header that follows
//! H bytes              the header, a KvBlocksHeader as JSON:
//!                      {"block_hashes": [u64, ...], "payload_bytes": [u64, ...]}
//! the payloads         each block's payload in the header's order, of the lengths it gives,
//!                      and nothing after them
//! ```
//!
//! Binary rather than JSON with base64: a block of a real model is megabytes, which base64
//! would grow by a third and make both sides encode and decode.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// The content type of an export answer in this framing.
pub const KV_BLOCKS_CONTENT_TYPE: &str = "application/x-switchyard-kv-blocks";

/// The JSON header of an answer in this framing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvBlocksHeader {
    /// The exported blocks' sequence hashes: a prefix of those asked for, in order.
    pub block_hashes: Vec<u64>,
    /// The byte length of each block's payload, in the same order.
    pub payload_bytes: Vec<u64>,
}

/// Exported blocks with their payloads, as read from an answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvBlocks {
    /// The blocks' sequence hashes.
    pub block_hashes: Vec<u64>,
    /// Each block's payload, in the same order (views of the answer's body, not copies).
    pub payloads: Vec<Bytes>,
}

impl KvBlocks {
    /// Bytes of payload in all.
    pub fn payload_bytes(&self) -> u64 {
        self.payloads.iter().map(|payload| payload.len() as u64).sum()
    }
}

/// Why an answer in this framing could not be read or written.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvBlocksError {
    /// The body ends before the header or a payload does.
    #[error("the KV blocks answer is truncated: {0}")]
    Truncated(String),
    /// The header is not a [`KvBlocksHeader`].
    #[error("the KV blocks header does not parse: {0}")]
    Header(String),
    /// The header's lists disagree, or the payloads do not fill the body exactly.
    #[error("the KV blocks answer is inconsistent: {0}")]
    Inconsistent(String),
}

/// The answer body for `block_hashes` and their `payloads` (as many, in the same order).
///
/// # Errors
///
/// [`KvBlocksError::Inconsistent`] when the two lists differ in length, or the header would not
/// fit its 32-bit length.
pub fn encode(block_hashes: &[u64], payloads: &[Vec<u8>]) -> Result<Vec<u8>, KvBlocksError> {
    if block_hashes.len() != payloads.len() {
        return Err(KvBlocksError::Inconsistent(format!(
            "{} block hashes and {} payloads",
            block_hashes.len(),
            payloads.len()
        )));
    }
    let header = KvBlocksHeader {
        block_hashes: block_hashes.to_vec(),
        payload_bytes: payloads.iter().map(|payload| payload.len() as u64).collect(),
    };
    let header = serde_json::to_vec(&header).map_err(|err| KvBlocksError::Header(err.to_string()))?;
    let header_len = u32::try_from(header.len())
        .map_err(|_| KvBlocksError::Inconsistent(format!("a header of {} bytes", header.len())))?;
    let total = 4 + header.len() + payloads.iter().map(Vec::len).sum::<usize>();
    let mut body = Vec::with_capacity(total);
    body.extend_from_slice(&header_len.to_le_bytes());
    body.extend_from_slice(&header);
    for payload in payloads {
        body.extend_from_slice(payload);
    }
    Ok(body)
}

/// Reads an answer body in this framing. The body comes from another worker: every length is
/// checked against what is there, and the payloads must fill the rest of the body exactly.
///
/// # Errors
///
/// A [`KvBlocksError`] saying what is wrong with the body.
pub fn decode(body: Bytes) -> Result<KvBlocks, KvBlocksError> {
    let Some((length, rest)) = body.split_first_chunk::<4>() else {
        return Err(KvBlocksError::Truncated(format!(
            "{} bytes, no header length",
            body.len()
        )));
    };
    let header_len = u32::from_le_bytes(*length) as usize;
    if header_len > rest.len() {
        return Err(KvBlocksError::Truncated(format!(
            "a header of {header_len} bytes in {} bytes",
            rest.len()
        )));
    }
    let header: KvBlocksHeader =
        serde_json::from_slice(&rest[..header_len]).map_err(|err| KvBlocksError::Header(err.to_string()))?;
    if header.block_hashes.len() != header.payload_bytes.len() {
        return Err(KvBlocksError::Inconsistent(format!(
            "{} block hashes and {} payload lengths",
            header.block_hashes.len(),
            header.payload_bytes.len()
        )));
    }
    let mut at = 4 + header_len;
    let mut payloads = Vec::with_capacity(header.payload_bytes.len());
    for (index, &length) in header.payload_bytes.iter().enumerate() {
        let end = usize::try_from(length)
            .ok()
            .and_then(|length| at.checked_add(length))
            .filter(|end| *end <= body.len())
            .ok_or_else(|| {
                KvBlocksError::Truncated(format!(
                    "payload {index} of {length} bytes at byte {at} of {}",
                    body.len()
                ))
            })?;
        payloads.push(body.slice(at..end));
        at = end;
    }
    if at != body.len() {
        return Err(KvBlocksError::Inconsistent(format!(
            "{} bytes after the last payload",
            body.len() - at
        )));
    }
    Ok(KvBlocks {
        block_hashes: header.block_hashes,
        payloads,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_and_payloads_round_trip() {
        let payloads = vec![vec![1, 2, 3], Vec::new(), vec![9; 1000]];
        let body = encode(&[7, 8, 9], &payloads).expect("encodes");
        let blocks = decode(Bytes::from(body)).expect("decodes");
        assert_eq!(blocks.block_hashes, [7, 8, 9]);
        assert_eq!(blocks.payloads, payloads);
        assert_eq!(blocks.payload_bytes(), 1003);
        let empty = decode(Bytes::from(encode(&[], &[]).expect("encodes"))).expect("decodes");
        assert_eq!(empty, KvBlocks::default());
    }

    #[test]
    fn a_body_that_lies_about_its_lengths_is_refused() {
        assert_eq!(
            encode(&[1], &[]),
            Err(KvBlocksError::Inconsistent("1 block hashes and 0 payloads".into()))
        );
        let body = encode(&[7, 8], &[vec![1; 10], vec![2; 10]]).expect("encodes");
        // Cut anywhere: too short for the header or a payload.
        for cut in [0, 3, 10, body.len() - 1] {
            let err = decode(Bytes::copy_from_slice(&body[..cut])).expect_err("truncated");
            assert!(matches!(err, KvBlocksError::Truncated(_)), "cut at {cut}: {err}");
        }
        // A byte more than the payloads account for.
        let mut longer = body.clone();
        longer.push(0);
        assert!(matches!(
            decode(Bytes::from(longer)),
            Err(KvBlocksError::Inconsistent(_))
        ));
        // A header length past the body, a huge payload length, lists of different lengths.
        let mut huge_header = body.clone();
        huge_header[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode(Bytes::from(huge_header)),
            Err(KvBlocksError::Truncated(_))
        ));
        let forged = |header: &str| {
            let mut body = (header.len() as u32).to_le_bytes().to_vec();
            body.extend_from_slice(header.as_bytes());
            body.extend_from_slice(&[0; 16]);
            decode(Bytes::from(body))
        };
        assert!(matches!(
            forged(r#"{"block_hashes":[1],"payload_bytes":[18446744073709551615]}"#),
            Err(KvBlocksError::Truncated(_))
        ));
        assert!(matches!(
            forged(r#"{"block_hashes":[1,2],"payload_bytes":[16]}"#),
            Err(KvBlocksError::Inconsistent(_))
        ));
        assert!(matches!(forged("{not json"), Err(KvBlocksError::Header(_))));
        assert!(forged(r#"{"block_hashes":[1],"payload_bytes":[16]}"#).is_ok());
    }
}
