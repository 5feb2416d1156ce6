//! Any bytes as an upstream's event stream, cut into chunks anywhere, with
//! any budget: the gate never panics, passes the stream's bytes in order
//! and unchanged (a prefix of them while events are held back), and never
//! passes more content deltas than the room it was given.
#![no_main]

use meshlimit::tokens::sse::SseGate;
use meshlimit::tokens::usage::UsageExpr;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&control, stream)) = data.split_first() else {
        return;
    };
    let room = u64::from(control % 8);
    let chunk = usize::from(control / 8).max(1);
    let mut gate = SseGate::new(Some(UsageExpr::single("usage.total_tokens")), 4096);
    let mut out = Vec::new();
    for piece in stream.chunks(chunk) {
        let left = room.saturating_sub(gate.deltas);
        out.extend(gate.push(piece, Some(left)).bytes);
        assert!(gate.deltas <= room);
    }
    let left = room.saturating_sub(gate.deltas);
    out.extend(gate.finish(Some(left)).bytes);
    assert!(gate.deltas <= room);
    assert!(
        stream.starts_with(&out),
        "passed bytes are the stream's, in order"
    );
});
