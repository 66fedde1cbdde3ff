//! A KV block as it moves between workers: the payload format of the native LLM's blocks, and
//! the check that a payload fits this engine before it is written into the cache.
//!
//! Prefill/decode disaggregation copies a finished prefill's blocks out of one worker's paged
//! cache and into another's (`switchyard_workers::engine::transfer` does the bookkeeping, the
//! workers' HTTP export carries the bytes). Both backends keep a block the same way — per layer,
//! `block_size` rows of `kv_heads × head_dim` values, f32 or f16 — so the CPU and CUDA
//! backends read and write the same payloads, and a payload goes out in the dtype the cache
//! holds it (never widened or rounded on the way). One payload is one block:
//!
//! ```text
//! offset  size  field
//! 0       4     magic, "SYKV"
//! 4       1     format version, 1
//! 5       1     dtype: 1 = f32, 2 = f16 (IEEE binary16 bits)
//! 6       2     reserved, 0
//! 8       4     layers          (u32, little-endian, as every number here)
//! 12      4     KV heads
//! 16      4     head dimension
//! 20      4     block size (positions)
//! 24      ...   for each layer in order: its keys, then its values; each
//!               [block_size][kv_heads][head_dim] values, little-endian
//! ```
//!
//! A payload another engine made is input: an importer refuses one whose header is not its own
//! shape and dtype, or whose length is not what that header implies ([`KvPayloadError`]), and
//! the import stops there (the rest of the prompt is prefilled). The header cannot tell two
//! models of the same shape apart; the router pairs workers serving the same model name.

use crate::config::ModelConfig;
use crate::kv::KvPrecision;

/// The first bytes of every payload.
pub const MAGIC: [u8; 4] = *b"SYKV";

/// The payload format this build writes and reads.
pub const VERSION: u8 = 1;

/// Bytes of a payload's header.
pub const HEADER_BYTES: usize = 24;

/// What a block of a paged cache is made of: the shape and dtype a payload must match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvBlockShape {
    /// How values are stored.
    pub precision: KvPrecision,
    /// Decoder layers, each with its keys and values.
    pub layers: usize,
    /// Key/value heads per position.
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Positions per block.
    pub block_size: usize,
}

impl std::fmt::Display for KvBlockShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} blocks of {} positions × {} layers × {} KV heads × {} dimensions",
            self.precision, self.block_size, self.layers, self.kv_heads, self.head_dim
        )
    }
}

/// Why a payload was not made or not taken in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvPayloadError {
    /// Shorter than a header, or not one of ours.
    #[error("not a KV block payload ({0})")]
    NotAPayload(String),
    /// Written by another version of the format.
    #[error("KV block payload format version {0}; this worker reads version {VERSION}")]
    Version(u8),
    /// Of another model's shape, or another dtype.
    #[error("a KV block payload of {theirs}; this engine's are {ours}")]
    Shape {
        /// What the payload's header says (or its unknown dtype code).
        theirs: String,
        /// This engine's blocks.
        ours: KvBlockShape,
    },
    /// The header's shape, but not its number of bytes.
    #[error("a KV block payload of {len} bytes; its shape takes {expected}")]
    Length {
        /// The payload's bytes.
        len: usize,
        /// What the shape takes, header included.
        expected: usize,
    },
    /// A block number outside the cache.
    #[error("block {block} is outside the cache of {blocks} blocks")]
    Block {
        /// The block asked for.
        block: u32,
        /// Blocks in the cache.
        blocks: usize,
    },
    /// The device copy failed (the CUDA backend).
    #[error("copying the KV block: {0}")]
    Device(String),
}

impl KvBlockShape {
    /// The blocks of a `block_size`-position cache of `config`'s model, stored in `precision`.
    pub fn of(config: &ModelConfig, block_size: usize, precision: KvPrecision) -> KvBlockShape {
        KvBlockShape {
            precision,
            layers: config.num_layers,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            block_size,
        }
    }

    /// Values of one layer's keys (or values) in a block.
    pub fn layer_values(&self) -> usize {
        self.block_size * self.kv_heads * self.head_dim
    }

    /// Bytes of one layer's keys (or values) in a block.
    pub fn layer_bytes(&self) -> usize {
        self.layer_values() * self.precision.bytes()
    }

    /// Bytes of a whole payload, header included.
    pub fn payload_bytes(&self) -> usize {
        HEADER_BYTES + 2 * self.layers * self.layer_bytes()
    }

    /// The header of this shape's payloads.
    pub fn header(&self) -> [u8; HEADER_BYTES] {
        let mut header = [0u8; HEADER_BYTES];
        header[..4].copy_from_slice(&MAGIC);
        header[4] = VERSION;
        header[5] = dtype_code(self.precision);
        let numbers = [self.layers, self.kv_heads, self.head_dim, self.block_size];
        for (at, number) in (8..).step_by(4).zip(numbers) {
            // Shapes that do not fit 32 bits do not exist; saturate rather than wrap so that a
            // payload of one is refused, never taken for another shape.
            let number = u32::try_from(number).unwrap_or(u32::MAX);
            header[at..at + 4].copy_from_slice(&number.to_le_bytes());
        }
        header
    }

    /// A new payload: this shape's header, with room for its data.
    pub fn start_payload(&self) -> Vec<u8> {
        let mut payload = Vec::with_capacity(self.payload_bytes());
        payload.extend_from_slice(&self.header());
        payload
    }

    /// The data of `payload` (its layers' keys and values, after the header) when it is a
    /// payload of this shape.
    ///
    /// # Errors
    ///
    /// [`KvPayloadError`] saying how the payload differs.
    pub fn data<'a>(&self, payload: &'a [u8]) -> Result<&'a [u8], KvPayloadError> {
        let Some((header, data)) = payload.split_first_chunk::<HEADER_BYTES>() else {
            return Err(KvPayloadError::NotAPayload(format!("{} bytes", payload.len())));
        };
        if header[..4] != MAGIC {
            return Err(KvPayloadError::NotAPayload(format!("it starts {:02x?}", &header[..4])));
        }
        if header[4] != VERSION {
            return Err(KvPayloadError::Version(header[4]));
        }
        if *header != self.header() {
            return Err(KvPayloadError::Shape {
                theirs: describe(header),
                ours: *self,
            });
        }
        let expected = self.payload_bytes();
        if payload.len() != expected {
            return Err(KvPayloadError::Length {
                len: payload.len(),
                expected,
            });
        }
        Ok(data)
    }
}

fn dtype_code(precision: KvPrecision) -> u8 {
    match precision {
        KvPrecision::F32 => 1,
        KvPrecision::F16 => 2,
    }
}

/// What a foreign header says, for the refusal's message.
fn describe(header: &[u8; HEADER_BYTES]) -> String {
    let number = |at: usize| {
        let mut bytes = [0u8; 4];
        bytes.copy_from_slice(&header[at..at + 4]);
        u32::from_le_bytes(bytes)
    };
    let dtype = match header[5] {
        1 => "f32".to_string(),
        2 => "f16".to_string(),
        code => format!("dtype code {code}"),
    };
    let reserved = if header[6..8] == [0, 0] {
        ""
    } else {
        " (reserved bytes set)"
    };
    format!(
        "{dtype} blocks of {} positions × {} layers × {} KV heads × {} dimensions{reserved}",
        number(20),
        number(8),
        number(12),
        number(16)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RopeScaling;
    use crate::kv::PagedKv;

    fn config(kv_heads: usize) -> ModelConfig {
        ModelConfig {
            model_type: "llama".into(),
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 3,
            num_heads: 4,
            num_kv_heads: kv_heads,
            head_dim: 16,
            vocab_size: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::None,
            attention_bias: false,
            tie_word_embeddings: true,
            max_position_embeddings: 4096,
            eos_token_ids: Vec::new(),
        }
    }

    /// A cache whose block `block` holds distinct values at every layer, position and lane.
    fn filled(precision: KvPrecision, block: u32) -> PagedKv {
        let config = config(2);
        let mut kv = PagedKv::with_precision(&config, 4, 8, precision);
        let width = 2 * 16;
        for layer in 0..config.num_layers {
            for position in 0..4 {
                let row = |sign: f32| -> Vec<f32> {
                    (0..width)
                        .map(|lane| sign * (1.0 + (layer * 1000 + position * 100 + lane) as f32 / 7.0))
                        .collect()
                };
                kv.write(layer, &[block], position, &row(1.0), &row(-1.0));
            }
        }
        kv
    }

    #[test]
    fn a_block_exported_and_imported_elsewhere_holds_the_same_bytes() {
        for precision in [KvPrecision::F32, KvPrecision::F16] {
            let source = filled(precision, 3);
            let payload = source.export_block(3).expect("a block of the cache");
            let shape = source.block_shape();
            assert_eq!(payload.len(), shape.payload_bytes());
            assert_eq!(payload.len(), HEADER_BYTES + 2 * 3 * 4 * 2 * 16 * precision.bytes());
            assert_eq!(payload[..HEADER_BYTES], shape.header());
            // Another cache, of other size, at another block number.
            let mut target = PagedKv::with_precision(&config(2), 4, 16, precision);
            target.import_block(11, &payload).expect("the same shape");
            assert_eq!(target.export_block(11).expect("a block"), payload, "{precision}");
            for layer in 0..3 {
                assert_eq!(
                    target.gather(layer, &[11], 4),
                    source.gather(layer, &[3], 4),
                    "{precision}: layer {layer}'s keys and values as attention reads them"
                );
            }
            // The f32 cache's payload is its values' bytes, as computed.
            if precision == KvPrecision::F32 {
                let (keys, _) = source.gather(0, &[3], 1);
                let first: [u8; 4] = payload[HEADER_BYTES..HEADER_BYTES + 4].try_into().expect("4 bytes");
                assert_eq!(f32::from_le_bytes(first), keys[0]);
            }
        }
    }

    #[test]
    fn a_payload_of_another_shape_or_dtype_writes_nothing() {
        let payload = filled(KvPrecision::F32, 0).export_block(0).expect("a block");
        let untouched = |kv: &PagedKv| kv.gather(0, &[2], 4).0.iter().all(|v| *v == 0.0);
        let mut f16 = PagedKv::with_precision(&config(2), 4, 8, KvPrecision::F16);
        let err = f16.import_block(2, &payload).expect_err("another dtype");
        assert!(matches!(err, KvPayloadError::Shape { .. }), "{err}");
        assert!(untouched(&f16));
        let mut wider = PagedKv::with_precision(&config(4), 4, 8, KvPrecision::F32);
        assert!(matches!(
            wider.import_block(2, &payload),
            Err(KvPayloadError::Shape { .. })
        ));
        let mut longer_blocks = PagedKv::with_precision(&config(2), 8, 8, KvPrecision::F32);
        assert!(matches!(
            longer_blocks.import_block(2, &payload),
            Err(KvPayloadError::Shape { .. })
        ));
        let mut same = PagedKv::with_precision(&config(2), 4, 8, KvPrecision::F32);
        assert!(matches!(
            same.import_block(2, &payload[..payload.len() - 1]),
            Err(KvPayloadError::Length { .. })
        ));
        assert_eq!(
            same.import_block(8, &payload),
            Err(KvPayloadError::Block { block: 8, blocks: 8 })
        );
        assert!(untouched(&same));
        assert_eq!(same.export_block(8), Err(KvPayloadError::Block { block: 8, blocks: 8 }));
    }

    fn shape() -> KvBlockShape {
        KvBlockShape {
            precision: KvPrecision::F16,
            layers: 2,
            kv_heads: 2,
            head_dim: 16,
            block_size: 4,
        }
    }

    #[test]
    fn a_payload_of_its_shape_is_read_and_others_are_refused_with_the_difference() {
        let shape = shape();
        assert_eq!(shape.layer_bytes(), 4 * 2 * 16 * 2);
        assert_eq!(shape.payload_bytes(), 24 + 2 * 2 * 256);
        let mut payload = shape.start_payload();
        payload.resize(shape.payload_bytes(), 7);
        assert_eq!(shape.data(&payload).map(<[u8]>::len), Ok(1024));
        assert_eq!(
            &payload[..24],
            [
                b'S', b'Y', b'K', b'V', 1, 2, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 16, 0, 0, 0, 4, 0, 0, 0
            ]
        );

        let f32_shape = KvBlockShape {
            precision: KvPrecision::F32,
            ..shape
        };
        let err = f32_shape.data(&payload).expect_err("another dtype");
        assert_eq!(
            err.to_string(),
            "a KV block payload of f16 blocks of 4 positions × 2 layers × 2 KV heads × 16 dimensions; \
             this engine's are f32 blocks of 4 positions × 2 layers × 2 KV heads × 16 dimensions"
        );
        let wider = KvBlockShape { kv_heads: 4, ..shape };
        assert!(matches!(wider.data(&payload), Err(KvPayloadError::Shape { .. })));
        assert_eq!(
            shape.data(&payload[..100]),
            Err(KvPayloadError::Length {
                len: 100,
                expected: 1048
            })
        );
        assert!(matches!(
            shape.data(&payload[..10]),
            Err(KvPayloadError::NotAPayload(_))
        ));
        let mut foreign = payload.clone();
        foreign[0] = b'X';
        assert!(matches!(shape.data(&foreign), Err(KvPayloadError::NotAPayload(_))));
        let mut newer = payload.clone();
        newer[4] = 2;
        assert_eq!(shape.data(&newer), Err(KvPayloadError::Version(2)));
        let mut odd = payload;
        odd[5] = 9;
        let err = shape.data(&odd).expect_err("an unknown dtype");
        assert!(err.to_string().contains("dtype code 9"), "{err}");
    }
}
