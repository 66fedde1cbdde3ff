//! A worker's SSE stream through the usage tap, the reader that watches a tenant's stream for
//! the usage the worker reports: any bytes, cut into any frames, with a small limit on an event
//! not yet ended so that short inputs reach the refusal too.
//!
//! Nothing may panic; the tap never holds more than its limit; without taking the usage chunk
//! out, the client gets exactly the worker's bytes (up to where an oversized event was
//! refused); taking it out only ever removes bytes.

//!
//! The input: a first byte whose low bit says whether the usage chunk is taken out, a second
//! that sets the limit (16 bytes a step, from 16), then the stream, cut into frames at each
//! 0xFF byte (a byte no UTF-8 text holds), so that seeds are plain SSE text.

#![no_main]

use libfuzzer_sys::fuzz_target;
use switchyard::fuzzing::tap_usage;

fuzz_target!(|data: &[u8]| {
    let [flags, limit, stream @ ..] = data else {
        return;
    };
    let strip = flags & 1 == 1;
    let limit = (usize::from(*limit) + 1) * 16;
    let frames: Vec<&[u8]> = stream.split(|&byte| byte == 0xFF).collect();
    let sent: Vec<u8> = frames.concat();
    let stream = tap_usage(frames.iter().copied(), strip, limit);
    assert!(
        stream.most_held <= limit,
        "held {} bytes past the limit {limit}",
        stream.most_held
    );
    assert!(stream.out.len() <= sent.len(), "the tap added bytes");
    if !strip {
        if stream.refused {
            assert!(sent.starts_with(&stream.out), "what passed is not the worker's bytes");
        } else {
            assert_eq!(stream.out, sent, "the client did not get the worker's bytes");
        }
    }
});
