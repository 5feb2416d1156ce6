//! `scope: local` rules through the flow, on the fake host: a busy
//! client's requests are spent from the worker's draw with no shared-data
//! hostcall, and the counter stays exact across workers (two workers on
//! one host share its shared data, as two VMs in one Envoy do).

use super::*;

/// A local rule of `requests` a minute per `x-api-key`, on every path.
fn local_config(requests: u64) -> Config {
    crate::config::parse(
        format!(
            r#"{{"client_id": {{"headers": ["x-api-key"]}}, "rules": [
              {{"name": "edge", "scope": "local",
                "limits": [{{"name": "m", "requests": {requests}, "window": "60s"}}]}}]}}"#
        )
        .as_bytes(),
    )
    .unwrap()
}

/// Another worker (VM) of the same Envoy: the same host's shared data.
const ROOT_2: u32 = 2;

/// A request from `id` through `worker`, in a new context; whether it was
/// admitted (its response's headers added).
fn admitted_by(worker: &Worker, host: &FakeHost, context: &mut u32, id: &str) -> bool {
    *context += 1;
    let mut stream = worker.stream(*context);
    *host.request.borrow_mut() = FakeRequest::default()
        .with_header(":path", b"/api")
        .with_header("x-api-key", id.as_bytes());
    host.enter(stream.context_id);
    let step = worker.on_request_headers(host, &mut stream, true);
    let admitted = step == Step::Continue;
    if admitted {
        worker.on_response_headers(host, &mut stream);
    }
    worker.on_stream_end(host, &stream);
    admitted
}

/// The RateLimit header the last admitted response got.
fn last_rate_limit(host: &FakeHost) -> String {
    let headers = host.response_headers.borrow();
    let last = headers.iter().rev().find(|(_, k, _)| k == "ratelimit");
    last.map(|(_, _, v)| v.clone()).unwrap_or_default()
}

fn tick(worker: &Worker, host: &FakeHost, root: u32) {
    host.enter(root);
    worker.on_tick(host);
}

#[test]
fn a_busy_clients_requests_are_spent_from_the_workers_draw_without_shared_data() {
    let h = harness_with(local_config(1_000_000));
    h.host.now.set(60_000 * 1_000);
    let mut context = 100;
    // The first request counts in shared data; the second draws too; the
    // next ones spend the draw. Their headers count down one at a time:
    // the units this worker holds are the client's.
    for n in 1..=6 {
        assert!(admitted_by(&h.worker, &h.host, &mut context, "a"));
        let calls = h.host.take_hostcalls();
        let counted = calls.contains(&"get_shared_data") || calls.contains(&"set_shared_data");
        assert_eq!(counted, n <= 2, "request {n}: {calls:?}");
        let want = format!("\"edge/m\";r={};t=60", 1_000_000 - n);
        assert_eq!(last_rate_limit(&h.host), want, "request {n}");
    }
    assert_eq!(h.calls(), 0);
    // Hits reach the stat in bulk, at the latest on the tick.
    tick(&h.worker, &h.host, ROOT);
    assert_eq!(h.stat("local_allowed"), 6);
}

#[test]
fn a_small_local_limit_is_never_drawn_from() {
    let h = harness_with(local_config(20));
    let mut context = 100;
    let admitted = (0..25)
        .filter(|_| admitted_by(&h.worker, &h.host, &mut context, "a"))
        .count();
    assert_eq!(admitted, 20);
    assert_eq!(h.worker.local_draws.held(), 0);
    assert_eq!((h.stat("local_allowed"), h.stat("local_denied")), (20, 5));
}

/// Two workers, one client alternating between them: never more than the
/// limit, and by the time both stopped holding units, exactly the limit.
#[test]
fn two_workers_drawing_on_one_counter_admit_exactly_the_limit() {
    let h = harness_with(local_config(1_000));
    let other = Worker::new(&h.host, local_config(1_000), ROOT_2);
    let mut context = 100;
    let mut admitted = 0;
    let mut first_refused = None;
    for i in 0..1_200 {
        let worker = if i % 2 == 0 { &h.worker } else { &other };
        if admitted_by(worker, &h.host, &mut context, "a") {
            admitted += 1;
        } else if first_refused.is_none() {
            first_refused = Some(admitted);
        }
        assert!(admitted <= 1_000);
    }
    assert_eq!(admitted, 1_000);
    assert!(
        first_refused.is_some_and(|a| a >= 1_000 - 64),
        "refused before the tail: {first_refused:?}"
    );
    assert!(h.worker.local_draws.held() + other.local_draws.held() == 0);
}

#[test]
fn units_an_idle_worker_drew_go_back_on_its_tick_for_the_other_worker() {
    let h = harness_with(local_config(1_000));
    let other = Worker::new(&h.host, local_config(1_000), ROOT_2);
    let mut context = 100;
    for _ in 0..10 {
        assert!(admitted_by(&h.worker, &h.host, &mut context, "a"));
    }
    let held = h.worker.local_draws.held();
    assert!(held > 0, "the first worker holds a draw");
    // The client moves to the other worker. A tick finds the draw used
    // since the last one; the next finds it idle and gives it back.
    tick(&h.worker, &h.host, ROOT);
    tick(&h.worker, &h.host, ROOT);
    assert_eq!(h.worker.local_draws.held(), 0);
    let moved = (0..1_100)
        .filter(|_| admitted_by(&other, &h.host, &mut context, "a"))
        .count();
    assert_eq!(moved, 1_000 - 10, "every unit back but the ten spent");
}

/// The worker's clock is reused between reads (`flow::clock`), at most a
/// tick apart: a draw is still never spent past its window's end.
#[test]
fn a_draw_is_never_spent_after_its_window() {
    let h = harness_with(local_config(1_000));
    let mut context = 100;
    // A draw taken in the last two seconds of a minute's window.
    h.host.now.set(60_000 * 1_000 + 58_000);
    for _ in 0..3 {
        assert!(admitted_by(&h.worker, &h.host, &mut context, "a"));
    }
    assert!(h.worker.local_draws.held() > 0);
    // A request every 250 ms, on the tick's period, into the next window.
    for step in 1..=12 {
        h.advance(250);
        tick(&h.worker, &h.host, ROOT);
        h.host.take_hostcalls();
        assert!(admitted_by(&h.worker, &h.host, &mut context, "a"));
        let counted = h.host.take_hostcalls().contains(&"set_shared_data");
        if step * 250 == 2_000 {
            assert!(
                counted,
                "the new window's first request: not from the old draw"
            );
        }
    }
    // The new window's counter: its five requests, no more (what this
    // worker drew in it counts as the client's).
    assert_eq!(last_rate_limit(&h.host), "\"edge/m\";r=995;t=59");
}
