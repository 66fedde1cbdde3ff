//! Bounds-checked reads of integers from byte slices.
//!
//! Every hand-written parser in this crate reads through these helpers, which return `None`
//! instead of panicking when an offset (computed from hostile input) is past the end or
//! overflows, so a parser turns a short buffer into an error with `?`/`ok_or`.

/// `len` bytes at `at`, if all are present.
pub(crate) fn bytes(b: &[u8], at: usize, len: usize) -> Option<&[u8]> {
    b.get(at..at.checked_add(len)?)
}

/// `N` bytes at `at` as an array.
pub(crate) fn array<const N: usize>(b: &[u8], at: usize) -> Option<[u8; N]> {
    bytes(b, at, N)?.try_into().ok()
}

/// The byte at `at`.
pub(crate) fn u8_at(b: &[u8], at: usize) -> Option<u8> {
    b.get(at).copied()
}

/// Big-endian u16 at `at`.
pub(crate) fn be16(b: &[u8], at: usize) -> Option<u16> {
    array(b, at).map(u16::from_be_bytes)
}

/// Big-endian u24 at `at`.
pub(crate) fn be24(b: &[u8], at: usize) -> Option<u32> {
    let [x, y, z] = array(b, at)?;
    Some(u32::from_be_bytes([0, x, y, z]))
}

/// Big-endian u32 at `at`.
pub(crate) fn be32(b: &[u8], at: usize) -> Option<u32> {
    array(b, at).map(u32::from_be_bytes)
}

/// Big-endian u64 at `at`.
pub(crate) fn be64(b: &[u8], at: usize) -> Option<u64> {
    array(b, at).map(u64::from_be_bytes)
}

/// Little-endian u16 at `at`.
pub(crate) fn le16(b: &[u8], at: usize) -> Option<u16> {
    array(b, at).map(u16::from_le_bytes)
}

/// Little-endian u32 at `at`.
pub(crate) fn le32(b: &[u8], at: usize) -> Option<u32> {
    array(b, at).map(u32::from_le_bytes)
}

/// Little-endian u64 at `at`.
pub(crate) fn le64(b: &[u8], at: usize) -> Option<u64> {
    array(b, at).map(u64::from_le_bytes)
}

/// A four-character code for messages, non-printable bytes shown as `?`.
pub(crate) fn fourcc(b: [u8; 4]) -> String {
    b.iter()
        .map(|&c| {
            if c.is_ascii_graphic() || c == b' ' {
                c as char
            } else {
                '?'
            }
        })
        .collect()
}
