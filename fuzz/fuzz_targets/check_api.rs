//! Any bytes as a check request (meshlimitd's decoder and validation) and
//! as a check answer (the filter's decoder, one check or a batch, with
//! per-check errors): decoded or refused, never a panic; and an accepted
//! request's subjects always become safe key tags.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(request) = serde_json::from_slice::<meshlimit_protocol::CheckRequest>(data) {
        if meshlimitd::app::validate(&request).is_ok() {
            for check in &request.checks {
                let tag = meshlimitd::keys::subject_tag(&check.subject);
                assert!(!tag.contains(['{', '}']));
                assert!(tag.len() <= 66);
            }
        }
    }
    for status in [None, Some(200), Some(503), Some(504)] {
        let _ = meshlimit::decision::read_answer(status, Some(data), 1, false);
        // A batch: each outcome decided, refused or unavailable on its own,
        // or the whole answer unusable; never more outcomes than checks.
        // Settlements: one outcome each, answered or failed.
        if let Ok(batch) =
            meshlimit::decision::read_batch_answer(status, Some(data), &[1, 2, 0], 2, false)
        {
            assert_eq!(batch.results.len(), 3);
            assert_eq!(batch.settled.len(), 2);
        }
    }
});
