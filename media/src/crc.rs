//! The few checksums the containers carry, table-driven.
//!
//! Ogg pages carry a CRC-32 (polynomial 0x04C11DB7, MSB first, no reflection, initial 0), FLAC
//! frame headers a CRC-8 (polynomial 0x07) and FLAC frames a CRC-16 (polynomial 0x8005); the
//! probes use them to tell a real page or frame boundary from look-alike bytes, and a cut frame
//! from a whole one. PNG's CRC-32 (the reflected IEEE one) is here for the fixtures, which must
//! write valid chunks. Each is a handful of lines, so no crate is pulled in for them.

const fn table32_msb(poly: u32) -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = (i as u32) << 24;
        let mut k = 0;
        while k < 8 {
            c = if c & 0x8000_0000 != 0 { (c << 1) ^ poly } else { c << 1 };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

const fn table16_msb(poly: u16) -> [u16; 256] {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = (i as u16) << 8;
        let mut k = 0;
        while k < 8 {
            c = if c & 0x8000 != 0 { (c << 1) ^ poly } else { c << 1 };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

const fn table8(poly: u8) -> [u8; 256] {
    let mut table = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u8;
        let mut k = 0;
        while k < 8 {
            c = if c & 0x80 != 0 { (c << 1) ^ poly } else { c << 1 };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

static OGG: [u32; 256] = table32_msb(0x04C1_1DB7);
static FLAC16: [u16; 256] = table16_msb(0x8005);
static FLAC8: [u8; 256] = table8(0x07);

/// Ogg's page CRC-32 over `data`, continuing from `crc` (start with 0).
pub(crate) fn ogg_update(mut crc: u32, data: &[u8]) -> u32 {
    for &b in data {
        crc = (crc << 8) ^ OGG[usize::from((crc >> 24) as u8 ^ b)];
    }
    crc
}

/// FLAC's frame-header CRC-8 of `data`.
pub(crate) fn flac8(data: &[u8]) -> u8 {
    data.iter().fold(0u8, |crc, &b| FLAC8[usize::from(crc ^ b)])
}

/// FLAC's frame CRC-16, one more byte. Over a whole frame including its stored CRC it ends at 0.
pub(crate) fn flac16_byte(crc: u16, b: u8) -> u16 {
    (crc << 8) ^ FLAC16[usize::from((crc >> 8) as u8 ^ b)]
}

/// FLAC's frame CRC-16 of `data`.
#[cfg(any(test, feature = "fixtures"))]
pub(crate) fn flac16(data: &[u8]) -> u16 {
    data.iter().fold(0u16, |crc, &b| flac16_byte(crc, b))
}

/// PNG's (zlib's, IEEE 802.3) CRC-32 of `data`.
#[cfg(any(test, feature = "fixtures"))]
pub(crate) fn png32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        // The usual check values of each CRC over "123456789".
        assert_eq!(png32(b"123456789"), 0xCBF4_3926);
        assert_eq!(flac8(b"123456789"), 0xF4);
        assert_eq!(flac16(b"123456789"), 0xFEE8);
        // CRC-32/MPEG-2 differs from Ogg's only in its initial value and output xor; Ogg's is
        // CRC-32/BZIP2 without them: check it against a page-style round trip instead.
        let mut data = b"OggS-like page".to_vec();
        let crc = ogg_update(0, &data);
        data.extend_from_slice(&crc.to_be_bytes());
        assert_eq!(ogg_update(0, &data), 0);
        // PNG's IEND chunk CRC.
        assert_eq!(png32(b"IEND"), 0xAE42_6082);
    }
}
