//! An encoder's feature cache: features by media id, a byte budget, least recently used out.
//!
//! Every item that enters or leaves the cache is announced as a KV event (a one-block sequence
//! named by the media id, see `switchyard_protocol::encode::media_block_hash`), so gateways know
//! which encoder already holds an item's features and can send it there again.

use bytes::Bytes;
use lru::LruCache;
use switchyard_media::MediaId;
use switchyard_protocol::encode::{media_block_hash, media_local_hash};
use switchyard_protocol::kv_events::{KvEvent, StoredBlock};

/// One cached item.
#[derive(Debug, Clone)]
pub struct Cached {
    /// Rows.
    pub tokens: u32,
    /// The features, little-endian f16.
    pub data: Bytes,
}

/// The cache; see the module docs.
#[derive(Debug)]
pub struct FeatureCache {
    entries: LruCache<MediaId, Cached>,
    budget: u64,
    used: u64,
    hits: u64,
    misses: u64,
}

impl FeatureCache {
    /// An empty cache holding at most `budget` bytes.
    pub fn new(budget: u64) -> FeatureCache {
        FeatureCache {
            entries: LruCache::unbounded(),
            budget,
            used: 0,
            hits: 0,
            misses: 0,
        }
    }

    /// The features of `id` with `tokens` rows, if cached (and marks them recently used).
    pub fn get(&mut self, id: MediaId, tokens: u32) -> Option<Cached> {
        match self.entries.get(&id) {
            Some(cached) if cached.tokens == tokens => {
                self.hits += 1;
                Some(cached.clone())
            }
            _ => {
                self.misses += 1;
                None
            }
        }
    }

    /// The features of `id` whatever their row count, if cached (a native encoder's rows are
    /// the model's own count, which the gateway's estimate may not match).
    pub fn get_any(&mut self, id: MediaId) -> Option<Cached> {
        match self.entries.get(&id) {
            Some(cached) => {
                self.hits += 1;
                Some(cached.clone())
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// Caches `id`'s features, evicting the least recently used until they fit; returns the
    /// events that announce the change. Features larger than the whole budget are not kept.
    pub fn insert(&mut self, id: MediaId, cached: Cached, events: &mut Vec<KvEvent>) {
        let size = cached.data.len() as u64;
        if size > self.budget {
            return;
        }
        let replaced = self.entries.pop(&id);
        if let Some(old) = &replaced {
            self.used -= old.data.len() as u64;
        }
        let mut removed = Vec::new();
        while self.used + size > self.budget {
            let Some((evicted, old)) = self.entries.pop_lru() else {
                break;
            };
            self.used -= old.data.len() as u64;
            removed.push(media_block_hash(evicted));
        }
        if !removed.is_empty() {
            events.push(KvEvent::Removed { block_hashes: removed });
        }
        self.used += size;
        self.entries.put(id, cached);
        if replaced.is_none() {
            let local = media_local_hash(id);
            events.push(KvEvent::Stored {
                parent: None,
                blocks: vec![StoredBlock {
                    block_hash: media_block_hash(id),
                    tokens_hash: local,
                }],
            });
        }
    }

    /// Bytes held.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Items held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Lookups that found the item, and those that did not.
    pub fn hits_and_misses(&self) -> (u64, u64) {
        (self.hits, self.misses)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(bytes: usize) -> Cached {
        Cached {
            tokens: 1,
            data: Bytes::from(vec![0; bytes]),
        }
    }

    #[test]
    fn least_recently_used_goes_first_and_changes_are_announced() {
        let mut cache = FeatureCache::new(250);
        let mut events = Vec::new();
        cache.insert(MediaId(1), item(100), &mut events);
        cache.insert(MediaId(2), item(100), &mut events);
        assert!(cache.get(MediaId(1), 1).is_some());
        cache.insert(MediaId(3), item(100), &mut events);
        assert!(cache.get(MediaId(2), 1).is_none(), "2 was least recently used");
        assert!(cache.get(MediaId(1), 1).is_some());
        assert!(cache.get(MediaId(1), 2).is_none(), "another size is another encode");
        assert_eq!(cache.used(), 200);
        assert_eq!(events.iter().filter(|e| matches!(e, KvEvent::Stored { .. })).count(), 3);
        assert_eq!(
            events.last(),
            Some(&KvEvent::Stored {
                parent: None,
                blocks: vec![StoredBlock {
                    block_hash: media_block_hash(MediaId(3)),
                    tokens_hash: media_local_hash(MediaId(3)),
                }],
            })
        );
        assert!(events.contains(&KvEvent::Removed {
            block_hashes: vec![media_block_hash(MediaId(2))]
        }));
        cache.insert(MediaId(9), item(1000), &mut events);
        assert_eq!(cache.len(), 2, "larger than the budget: not kept");
        assert_eq!(cache.hits_and_misses(), (2, 2));
    }
}
