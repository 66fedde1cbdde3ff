//! KV block hashing, compatible with NVIDIA Dynamo's router.
//!
//! A prompt is cut into full blocks of `block_size` tokens; the trailing partial block is never
//! hashed. Each full block gets a *local* hash of its own tokens,
//! `xxh3_64_with_seed(LE u32 token ids, 1337)`, and a *sequence* hash that chains the block to
//! everything before it: `seq[0] = local[0]`, `seq[i] = xxh3_64_with_seed(LE(seq[i-1]) ‖
//! LE(local[i]), 1337)`. Sequence hashes identify cached prefixes; local hashes let an index
//! navigate without knowing an engine's own block ids.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed Dynamo uses for every block hash.
pub const HASH_SEED: u64 = 1337;

/// The hashes of one full block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash {
    /// Hash of this block's tokens alone.
    pub local: u64,
    /// Hash of this block chained to all blocks before it.
    pub sequence: u64,
}

/// The local hash of one block of token ids.
pub fn local_hash(tokens: &[u32]) -> u64 {
    local_hash_with_seed(tokens, HASH_SEED)
}

/// The seed of local hashes for blocks computed under LoRA adapter `lora`: `1337 +
/// xxh3_64(name)` (wrapping), so an adapter's cache never matches the base model's; without an
/// adapter it is [`HASH_SEED`]. Sequence hashes keep chaining with [`HASH_SEED`].
pub fn lora_seed(lora: Option<&str>) -> u64 {
    match lora {
        None => HASH_SEED,
        Some(name) => HASH_SEED.wrapping_add(xxhash_rust::xxh3::xxh3_64(name.as_bytes())),
    }
}

/// The local hash of one block of token ids under `seed` (see [`lora_seed`]).
pub fn local_hash_with_seed(tokens: &[u32], seed: u64) -> u64 {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for token in tokens {
        bytes.extend_from_slice(&token.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, seed)
}

/// The sequence hash of a block whose local hash is `local`, following the block whose sequence
/// hash is `parent` (`None` for the first block).
pub fn chain_hash(parent: Option<u64>, local: u64) -> u64 {
    match parent {
        None => local,
        Some(parent) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&parent.to_le_bytes());
            bytes[8..].copy_from_slice(&local.to_le_bytes());
            xxh3_64_with_seed(&bytes, HASH_SEED)
        }
    }
}

/// The hashes of every full block of `tokens`; a trailing partial block is left out.
///
/// # Panics
///
/// Panics if `block_size` is 0 (block sizes are validated when configured).
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    block_hashes_for(tokens, block_size, None)
}

/// [`block_hashes`] for blocks computed under LoRA adapter `lora` (salted local hashes).
///
/// # Panics
///
/// Panics if `block_size` is 0 (block sizes are validated when configured).
pub fn block_hashes_for(tokens: &[u32], block_size: usize, lora: Option<&str>) -> Vec<BlockHash> {
    assert!(block_size > 0, "block size must be positive");
    let seed = lora_seed(lora);
    let mut parent = None;
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            let local = local_hash_with_seed(block, seed);
            let sequence = chain_hash(parent, local);
            parent = Some(sequence);
            BlockHash { local, sequence }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_blocks_are_not_hashed() {
        assert_eq!(block_hashes(&[1, 2, 3], 4).len(), 0);
        assert_eq!(block_hashes(&[1, 2, 3, 4, 5], 4).len(), 1);
    }

    #[test]
    fn hashes_match_hand_computed_vectors() {
        let tokens: Vec<u32> = (0..8).collect();
        let hashes = block_hashes(&tokens, 4);
        let mut first = Vec::new();
        for t in 0u32..4 {
            first.extend_from_slice(&t.to_le_bytes());
        }
        let mut second = Vec::new();
        for t in 4u32..8 {
            second.extend_from_slice(&t.to_le_bytes());
        }
        let local0 = xxh3_64_with_seed(&first, 1337);
        let local1 = xxh3_64_with_seed(&second, 1337);
        let mut chained = local0.to_le_bytes().to_vec();
        chained.extend_from_slice(&local1.to_le_bytes());
        assert_eq!(
            hashes[0],
            BlockHash {
                local: local0,
                sequence: local0
            }
        );
        assert_eq!(
            hashes[1],
            BlockHash {
                local: local1,
                sequence: xxh3_64_with_seed(&chained, 1337)
            }
        );
    }

    #[test]
    fn lora_salts_local_hashes() {
        let tokens: Vec<u32> = (0..4).collect();
        let base = block_hashes(&tokens, 4);
        let salted = block_hashes_for(&tokens, 4, Some("sql-adapter"));
        let mut bytes = Vec::new();
        for t in 0u32..4 {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let seed = 1337u64.wrapping_add(xxhash_rust::xxh3::xxh3_64(b"sql-adapter"));
        assert_eq!(salted[0].local, xxh3_64_with_seed(&bytes, seed));
        assert_ne!(salted[0].sequence, base[0].sequence);
        assert_eq!(block_hashes_for(&tokens, 4, None), base);
    }

    #[test]
    fn equal_blocks_after_different_prefixes_differ_in_sequence_hash() {
        let a = block_hashes(&[1, 1, 9, 9], 2);
        let b = block_hashes(&[2, 2, 9, 9], 2);
        assert_eq!(a[1].local, b[1].local);
        assert_ne!(a[1].sequence, b[1].sequence);
    }
}
