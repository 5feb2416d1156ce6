use super::slot::Lease;
use super::*;
use crate::flow::observer::Observer;
use crate::shared::store::le_words;

/// What a worker busy with the client asks for: enough that its own
/// pace does not bound its draws (see the test of that bound).
const BUSY: u64 = 1_000;

const ASK: AskFor = AskFor {
    miss_ms: 100,
    renewal_ms: 100,
    window_bound_interval_ms: None,
};

const CONFIG: LeaseConfig = LeaseConfig {
    slots: 16,
    max_units: 1000,
    interval_ms: 1000,
    share: 2,
};

fn keep(until_ms: u64) -> Reclaim {
    Reclaim::Keep { until_ms }
}

fn at(fingerprint: u64) -> Place {
    Place {
        fingerprint,
        slot: 3,
        alternate: 4,
    }
}

/// A request of cost 1 from a worker with no draw.
fn take(slot: Slot, fp: u64, now: u64) -> (Slot, Take) {
    let (next, take) = slot.take(at(fp), 1, now, BUSY, ASK, None);
    (next.unwrap_or(slot), take)
}

/// A reclaim that gives units back.
fn gives_back(units: u64, expired: bool) -> Reclaim {
    Reclaim::Back { units, expired }
}

/// The draw a hit gave.
fn drawn(take: Take) -> Draw {
    match take {
        Take::Hit(draw) | Take::Renew { draw, .. } => draw,
        Take::Miss { .. } | Take::Occupied => panic!("no draw: {take:?}"),
    }
}

fn grant(units: u64, expires_ms: u64) -> Grant {
    Grant {
        lease_id: 7,
        units,
        expires_ms,
        reset_at_ms: expires_ms,
        renewal: false,
        beyond: 0,
        // A window counts its units past its end (a longer limit, a
        // sliding window): what the slot drops of it is counted.
        outlives_expiry: true,
    }
}

#[test]
fn one_ask_at_a_time_per_slot() {
    let (slot, t) = take(Slot::default(), 1, 20);
    assert_eq!(t, Take::Miss { want: BUSY });
    let (slot, t) = take(slot, 1, 30);
    assert_eq!(t, Take::Miss { want: 0 });
    // The ask expired unanswered: ask again.
    let (_, t) = take(slot, 1, 200);
    assert_eq!(t, Take::Miss { want: BUSY });
    // Not busy: nothing to write.
    assert_eq!(
        Slot::default().take(at(1), 1, 20, 0, ASK, None),
        (None, Take::Miss { want: 0 })
    );
}

#[test]
fn a_lease_admits_until_it_is_empty_or_expired() {
    let slot = Slot::default().install(1, grant(2, 500), 10).unwrap();
    let (slot, t) = take(slot, 1, 20);
    let first = drawn(t);
    assert_eq!(
        (first.drawn, first.left, first.reset_at_ms, first.slot),
        (1, 0, 500, 3)
    );
    // The worker comes back with its draw spent: accounted, and another.
    let (next, t) = slot.take(at(1), 1, 30, BUSY, ASK, Some(&first));
    let (slot, second) = (next.unwrap(), drawn(t));
    assert_eq!(
        (second.left, slot.current.units, slot.current.lent),
        (0, 0, 1)
    );
    // Spent; the renewal the first draw asked for (half the lease
    // was left) is still out: the request calls without asking.
    let (next, t) = slot.take(at(1), 1, 40, BUSY, ASK, Some(&second));
    assert_eq!(t, Take::Miss { want: 0 });
    let slot = next.unwrap();
    assert_eq!(
        (slot.current.units, slot.current.lent),
        (0, 0),
        "every draw accounted for"
    );
    let full = Slot::default().install(1, grant(5, 500), 10).unwrap();
    let (_, t) = take(full, 1, 500);
    assert!(matches!(t, Take::Miss { .. }), "expired at 500");
    // A cost above what is left calls.
    let (_, t) = full.take(at(1), 6, 20, BUSY, ASK, None);
    assert!(matches!(t, Take::Miss { .. }));
}

#[test]
fn the_last_units_of_a_lease_are_drawn_one_request_at_a_time() {
    // A small lease (the last units of a window): a worker that drew
    // more than its request would hold units while the client's next
    // requests land on another worker and are refused.
    let mut slot = Slot::default()
        .install(1, grant(DRAW_HALF_FROM - 1, 5_000), 10)
        .unwrap();
    for n in 0..DRAW_HALF_FROM - 1 {
        let (next, t) = take(slot, 1, 20 + n);
        let d = drawn(t);
        assert_eq!((d.drawn, d.left), (1, 0), "draw {n}");
        slot = next;
    }
    // A heavier request draws its cost, no more.
    let slot = Slot::default()
        .install(1, grant(3 * DRAW_HALF_FROM - 1, 5_000), 10)
        .unwrap();
    let (next, t) = slot.take(at(1), 3, 20, BUSY, ASK, None);
    assert_eq!(drawn(t).drawn, 3);
    // From a large one, half (of the 44 left).
    assert_eq!(drawn(take(next.unwrap(), 1, 21).1).drawn, 22);
    // From a small one granted with plenty left beyond it, half too,
    // to its last units: a worker refused for what another holds would
    // be admitted by its call.
    assert!(plenty_beyond(5, 80) && !plenty_beyond(5, 79));
    let plenty = Grant {
        beyond: 80,
        ..grant(5, 5_000)
    };
    let mut slot = Slot::default().install(1, plenty, 10).unwrap();
    for (n, half) in [3, 1, 1].into_iter().enumerate() {
        let (next, t) = take(slot, 1, 20 + n as u64);
        assert_eq!(drawn(t).drawn, half, "draw {n}");
        slot = next;
    }
    assert_eq!(Slot::decode(Some(&slot.encode())), slot);
    // A request heavier than half of such a lease draws its cost.
    let slot = Slot::default().install(1, plenty, 10).unwrap();
    let (_, t) = slot.take(at(1), 4, 20, BUSY, ASK, None);
    assert_eq!((drawn(t).drawn, drawn(t).left), (4, 0));
}

/// A worker that sees few of the client's requests (one of a
/// replica's workers with few of its connections) drew half the lease
/// on its first request and sat on it, while the workers the client's
/// requests did reach ran out and refused them: units stranded to the
/// end of a burst (the two-replica test admitted 1971 of 2000 once).
/// From a lease without plenty beyond it, a worker draws at most a
/// quarter of what it asks for, about what it spends in a tick.
#[test]
fn a_worker_draws_no_more_than_its_own_pace_spends_in_a_tick() {
    let slot = Slot::default().install(1, grant(200, 5_000), 10).unwrap();
    // Not busy on this worker: it asks for nothing, and draws its
    // request's cost alone.
    let (next, t) = slot.take(at(1), 1, 20, 0, ASK, None);
    assert_eq!((drawn(t).drawn, drawn(t).left), (1, 0));
    // Busy at 40 units an interval: 10, not 100.
    let (next, t) = next.unwrap().take(at(1), 1, 21, 40, ASK, None);
    assert_eq!((drawn(t).drawn, next.unwrap().current.units), (10, 189));
    // Never less than the request's cost.
    let (_, t) = slot.take(at(1), 3, 21, 4, ASK, None);
    assert_eq!(drawn(t).drawn, 3);
    // Far from the limit, the worker's pace does not matter: a worker
    // refused for what another holds would be admitted by its call.
    let plenty = Grant {
        beyond: 3_200,
        ..grant(200, 5_000)
    };
    let slot = Slot::default().install(1, plenty, 10).unwrap();
    let (_, t) = slot.take(at(1), 1, 20, 0, ASK, None);
    assert_eq!(drawn(t).drawn, 100);
}

#[test]
fn workers_draw_half_of_what_is_left_and_put_back_what_they_leave() {
    let slot = Slot::default().install(1, grant(40, 5_000), 10).unwrap();
    let (slot, t) = take(slot, 1, 20);
    let a = drawn(t);
    assert_eq!(
        (a.drawn, a.left, slot.current.units, slot.current.lent),
        (20, 19, 20, 20)
    );
    // A heavier request, for which what is left is small, draws its
    // cost.
    let (next, t) = slot.take(at(1), 4, 21, BUSY, ASK, None);
    let (slot, b) = (next.unwrap(), drawn(t));
    assert_eq!(
        (b.drawn, b.left, slot.current.units, slot.current.lent),
        (4, 0, 16, 24)
    );
    // `a` idles with 19 left: back in the slot.
    let slot = slot.put_back(&a).unwrap();
    assert_eq!((slot.current.units, slot.current.lent), (35, 4));
    // A draw of another lease has nowhere to go: `b` spent what it drew.
    let stale = Draw { lease_id: 99, ..b };
    assert_eq!(slot.put_back(&stale), None);
}

/// A draw put back after its lease left the slot loses its units left:
/// counted when a window still counts them, and the slot is written for
/// that count; a lease whose expiry ended every window owes nothing.
#[test]
fn a_draw_put_back_with_its_lease_gone_counts_its_units_dropped() {
    let slot = Slot::default().install(1, grant(40, 5_000), 10).unwrap();
    let (slot, t) = take(slot, 1, 20);
    let draw = drawn(t);
    assert_eq!(draw.left, 19);
    let stale = Draw {
        lease_id: 99,
        ..draw
    };
    let written = slot.put_back(&stale).expect("written for the count");
    assert_eq!(written.dropped_units, 19);
    assert_eq!(written.encode(), slot.encode(), "nothing else changed");
    let owes_nothing = Draw {
        outlives_expiry: false,
        ..stale
    };
    assert_eq!(slot.put_back(&owes_nothing), None);
    // Brought to a take, the same.
    let (written, _) = slot.take(at(1), 1, 30, BUSY, ASK, Some(&stale));
    assert_eq!(written.map(|s| s.dropped_units), Some(19));
    assert_eq!(slot.dropped_units, 0, "its own draw settled");
}

/// A lease whose owner has not taken its units out 2 s past its end is
/// abandoned: the next lease or check in its slot overwrites it, and its
/// units, when a window still counts them, are counted dropped.
#[test]
fn an_abandoned_lease_overwritten_counts_its_units_dropped() {
    let slot = Slot::default().install(1, grant(8, 1_000), 10).unwrap();
    let (slot, t) = take(slot, 1, 20);
    let slot = slot.put_back(&drawn(t)).unwrap();
    assert_eq!((slot.current.units, slot.current.lent), (7, 0));
    // Before 2 s past its end, a grant sets it aside for its owner.
    let newer = Grant {
        lease_id: 8,
        ..grant(5, 4_000)
    };
    let aside = slot.install(1, newer, 2_900).unwrap();
    assert_eq!((aside.previous.lease_id, aside.dropped_units), (7, 0));
    // After, the grant takes its place; so does another check.
    let over = slot.install(1, newer, 3_000).unwrap();
    assert_eq!((over.current.lease_id, over.dropped_units), (8, 7));
    let other = slot.install(2, newer, 3_000).unwrap();
    assert_eq!((other.fingerprint, other.dropped_units), (2, 7));
    let owes_nothing = Slot::default()
        .install(
            1,
            Grant {
                outlives_expiry: false,
                ..grant(8, 1_000)
            },
            10,
        )
        .unwrap();
    assert_eq!(
        owes_nothing.install(2, newer, 3_000).unwrap().dropped_units,
        0
    );
}

#[test]
fn draws_out_keep_a_lease_from_going_back_until_they_are_accounted_for() {
    let slot = Slot::default().install(1, grant(40, 5_000), 10).unwrap();
    let (slot, t) = take(slot, 1, 20);
    let a = drawn(t);
    // Idle in the slot, but `a` still holds units: not yet, nor before
    // half an interval (a draw still out was hit within two ticks).
    assert_eq!(slot.reclaim(7, 1_500, 1000), (None, keep(2_000)));
    assert_eq!(slot.install(1, grant(3, 9_000), 1_500), None);
    let back = slot.put_back(&a).unwrap();
    let (next, r) = back.reclaim(7, 1_500, 1000);
    assert_eq!(r, gives_back(39, false));
    assert_eq!(
        next.unwrap()
            .install(1, grant(3, 9_000), 1_500)
            .map(|s| s.current.units),
        Some(3)
    );
    // Expired: the draws get a little time to come back, then the slot
    // goes back without them.
    assert_eq!(slot.reclaim(7, 5_100, 1000), (None, keep(5_000)));
    let (_, r) = slot.reclaim(7, 5_000 + DRAWS_BACK_WITHIN_MS, 1000);
    assert_eq!(r, gives_back(20, true));
    // Spent in draws and accounted for: nothing to give back.
    let spent = Slot {
        current: Lease {
            units: 0,
            lent: 0,
            ..slot.current
        },
        ..slot
    };
    assert_eq!(spent.reclaim(7, 5_100, 1000), (None, Reclaim::Gone));
}

#[test]
fn a_grant_replaces_a_spent_lease_whose_draws_are_out_and_each_goes_back_on_its_own() {
    let slot = Slot::default().install(1, grant(16, 5_000), 10).unwrap();
    let (slot, t) = take(slot, 1, 20);
    let a = drawn(t); // 8 of 16, 7 left in it
    let (next, t) = slot.take(at(1), 8, 21, BUSY, ASK, None);
    let slot = next.unwrap();
    let b = drawn(t); // the last 8, all spent
    assert_eq!((slot.current.units, slot.current.lent), (0, 16));
    // Spent in the slot, draws out: a new lease goes in, the old aside.
    let newer = Grant {
        lease_id: 8,
        ..grant(6, 5_000)
    };
    let slot = slot.install(1, newer, 30).unwrap();
    assert_eq!((slot.current.lease_id, slot.current.units), (8, 6));
    assert_eq!((slot.previous.lease_id, slot.previous.lent), (7, 16));
    // Draws come from the new lease; old draws go back to the old one.
    let (slot, t) = take(slot, 1, 31);
    assert_eq!(drawn(t).lease_id, 8);
    let slot = slot.put_back(&a).unwrap();
    assert_eq!((slot.previous.units, slot.previous.lent), (7, 8));
    // Still a draw out of the old lease: it waits, and so does a third.
    assert_eq!(slot.reclaim(7, 40, 1000), (None, keep(40)));
    let third = Grant {
        lease_id: 9,
        ..grant(6, 5_000)
    };
    let spent_new = Slot {
        current: Lease {
            units: 0,
            ..slot.current
        },
        ..slot
    };
    assert_eq!(spent_new.install(1, third, 40), None);
    // Accounted for: its owner takes back what the draws left, at once.
    let slot = slot.put_back(&b).unwrap();
    let (next, r) = slot.reclaim(7, 41, 1000);
    assert_eq!(r, gives_back(7, false));
    let slot = next.unwrap();
    assert_eq!(slot.previous, Lease::default());
    assert_eq!(slot.reclaim(8, 41, 1000), (None, keep(1_031)));
}

#[test]
fn checks_whose_entries_collide_are_both_watched() {
    let mut seen = Observer::new(64);
    // 5 and 69 share their first entry; the second way keeps both.
    for now in [10, 20, 30] {
        seen.observe(5, 1, now, &CONFIG);
        seen.observe(69, 1, now, &CONFIG);
    }
    // Each asks for its pace (3 units in 30 ms, read over 125).
    assert_eq!(seen.observe(5, 1, 40, &CONFIG).0, 24);
    assert_eq!(seen.observe(69, 1, 40, &CONFIG).0, 24);
    // A third takes the way seen longest ago, and holding no draw.
    seen.keep_draw(5, test_draw(5));
    let (want, evicted) = seen.observe(133, 1, 50, &CONFIG);
    assert_eq!((want, evicted), (0, None));
    assert_eq!(seen.spend(5, 1, 50).map(|d| d.left), Some(2), "kept");
    assert_eq!(seen.observe(69, 1, 60, &CONFIG).0, 0, "69 starts over");
}

fn test_draw(slot: u64) -> Draw {
    Draw {
        slot,
        lease_id: 7,
        drawn: 3,
        left: 3,
        rest: 0,
        expires_ms: 1_000,
        reset_at_ms: 1_000,
        last_hit_ms: 10,
        outlives_expiry: true,
    }
}

#[test]
fn a_check_whose_slot_another_holds_takes_its_alternate() {
    use crate::host::fake::FakeStore;
    let store = FakeStore::default();
    let leases = Leases {
        keys: &crate::shared::keys::Keys::new("test"),
        config: CONFIG,
        seed: (1, 2),
        store: &store,
        dropped: &std::cell::Cell::new(0),
    };
    let a = leases.place(&"limits", "a");
    assert_ne!(a.slot, a.alternate);
    // Another check's lease in a's slot.
    let other = Place {
        fingerprint: a.fingerprint ^ 1,
        ..a
    };
    let (_, _, at) = leases.take(other, 1, 10, BUSY, ASK, None);
    assert_eq!(at.slot, a.slot);
    assert!(leases.install(other, grant(5, 5_000), 10));
    // a asks in its alternate; its grant goes there and serves it.
    let (take, kept, at) = leases.take(a, 1, 20, BUSY, ASK, None);
    assert_eq!(
        (take, kept, at.slot),
        (Take::Miss { want: BUSY }, None, a.alternate)
    );
    assert!(leases.install(
        at,
        Grant {
            lease_id: 9,
            ..grant(4, 5_000)
        },
        20
    ));
    let (take, _, at) = leases.take(a, 1, 30, BUSY, ASK, None);
    let draw = drawn(take);
    assert_eq!(
        (draw.lease_id, draw.slot, at.slot),
        (9, a.alternate, a.alternate)
    );
    // Spent, the draw is accounted for in the slot it came from.
    let (take, kept, _) = leases.take(a, 1, 40, BUSY, ASK, Some(Draw { left: 0, ..draw }));
    assert_eq!((drawn(take).drawn, kept), (1, None));
}

#[test]
fn a_lease_down_to_half_asks_once_for_the_next_which_replaces_it() {
    let slot = Slot::default().install(1, grant(64, 5_000), 10).unwrap();
    let (slot, t) = take(slot, 1, 20);
    assert!(matches!(t, Take::Hit(_)), "64 left: {t:?}");
    let (slot, t) = take(slot, 1, 21);
    assert!(
        matches!(t, Take::Renew { units: BUSY, .. }),
        "32 left: {t:?}"
    );
    let (slot, t) = take(slot, 1, 22);
    assert!(matches!(t, Take::Hit(_)), "one ask at a time: {t:?}");
    let (slot, t) = take(slot, 1, 23);
    assert!(matches!(t, Take::Hit(_)), "8 left: {t:?}");
    // A grant that is no renewal finds units and goes back; a renewal
    // waits its turn, and takes over once the lease is spent.
    let newer = Grant {
        lease_id: 8,
        ..grant(6, 5_000)
    };
    assert_eq!(slot.install(1, newer, 30), None);
    let renewed = Grant {
        renewal: true,
        ..newer
    };
    let slot = slot.install(1, renewed, 30).unwrap();
    assert_eq!((slot.current.lease_id, slot.current.units), (7, 7));
    assert_eq!((slot.next.lease_id, slot.next.units), (8, 6));
    assert_eq!(slot.install(1, renewed, 30), None, "one waits at a time");
    let (next, t) = slot.take(at(1), 7, 31, BUSY, ASK, None);
    let slot = next.unwrap();
    assert_eq!(drawn(t).lease_id, 7, "the last units of the first");
    let (slot, t) = take(slot, 1, 32);
    assert_eq!(drawn(t).lease_id, 8);
    assert_eq!((slot.previous.lease_id, slot.next.lease_id), (7, 0));
    // Not drawn from, a waiting lease goes back when idle.
    let waiting = Slot {
        next: Lease {
            lease_id: 9,
            units: 4,
            lent: 0,
            last_hit_ms: 40,
            ..slot.current
        },
        ..slot
    };
    assert_eq!(waiting.reclaim(9, 1_040, 1000).1, gives_back(4, false));
}

#[test]
fn a_worker_spends_its_draw_with_no_store_and_gives_it_back_when_idle() {
    let mut seen = Observer::new(64);
    assert_eq!(seen.observe(1, 1, 10, &CONFIG), (0, None));
    let draw = test_draw(3);
    assert_eq!(seen.spend(1, 1, 20), None, "no draw yet");
    seen.keep_draw(1, draw);
    assert_eq!(seen.spend(1, 2, 20).map(|d| d.left), Some(1));
    assert_eq!(seen.spend(1, 2, 30), None, "too little left");
    assert_eq!(seen.spend(1, 1, 30).map(|d| d.left), Some(0));
    assert_eq!(seen.spend(2, 1, 30), None, "another check's");
    // Busy within the idle time: kept.
    assert!(seen.due_draws(200, 250).is_empty());
    let due = seen.due_draws(280, 250);
    assert_eq!(due.len(), 1);
    assert_eq!((due[0].0, due[0].1.left, due[0].1.drawn), (1, 0, 3));
    assert_eq!(seen.take_draw(1), None, "taken out");
    // Expired draws are due at once, and admit nothing.
    seen.keep_draw(
        1,
        Draw {
            last_hit_ms: 990,
            ..draw
        },
    );
    assert_eq!(seen.spend(1, 1, 1_000), None);
    assert_eq!(seen.due_draws(1_000, 250).len(), 1);
    // A check taking an entry hands back the draw it held (both ways
    // holding draws: the one seen longest ago goes).
    seen.keep_draw(1, draw);
    seen.observe(1 + 64, 1, 40, &CONFIG);
    seen.keep_draw(1 + 64, draw);
    let (_, evicted) = seen.observe(1 + 128, 1, 50, &CONFIG);
    assert_eq!(evicted, Some(draw));
    assert_eq!(seen.spend(1, 1, 50), None, "1 was seen first");
    assert!(seen.spend(1 + 64, 1, 50).is_some());
}

#[test]
fn units_are_never_overwritten_by_another_check_or_another_grant() {
    let slot = Slot::default().install(1, grant(5, 500), 10).unwrap();
    let (next, t) = slot.take(at(2), 1, 20, BUSY, ASK, None);
    assert_eq!((next, t), (None, Take::Occupied));
    assert_eq!(slot.install(2, grant(3, 500), 20), None);
    assert_eq!(slot.install(1, grant(3, 500), 20), None);
    // Spent, the slot takes a new grant (for any check).
    let spent = Slot {
        current: Lease {
            units: 0,
            ..slot.current
        },
        ..slot
    };
    let next = spent.install(2, grant(3, 900), 20).unwrap();
    assert_eq!((next.fingerprint, next.current.units), (2, 3));
}

#[test]
fn expired_or_idle_leases_give_their_units_back_once() {
    let slot = Slot::default().install(1, grant(5, 5000), 10).unwrap();
    // Not due before an interval after it was granted: no look needed
    // until then, and it goes back then.
    assert_eq!(slot.reclaim(7, 500, 1000), (None, keep(1_010)));
    assert_eq!(slot.reclaim(7, 1_009, 1000), (None, keep(1_010)));
    assert_eq!(slot.reclaim(8, 500, 1000), (None, Reclaim::Gone));
    let (next, r) = slot.reclaim(7, 1010, 1000);
    assert_eq!(r, gives_back(5, false));
    let next = next.unwrap();
    assert_eq!(next.reclaim(7, 1020, 1000).1, Reclaim::Gone);
    let (_, r) = slot.reclaim(7, 5000, 1000);
    assert_eq!(r, gives_back(5, true));
    // A hit keeps it from going idle.
    let (hit, _) = take(slot, 1, 900);
    assert_eq!(hit.reclaim(7, 1500, 1000).1, keep(2_000));
    // An expiry before that comes first.
    let (soon, _) = take(
        Slot::default().install(1, grant(5, 1_200), 10).unwrap(),
        1,
        900,
    );
    assert_eq!(soon.reclaim(7, 1_000, 1000).1, keep(1_200));
}

#[test]
fn units_whose_owner_is_gone_free_their_slot_after_expiry() {
    let slot = Slot::default().install(1, grant(5, 500), 10).unwrap();
    let newer = Grant {
        lease_id: 8,
        ..grant(3, 900)
    };
    let aside = slot.install(1, newer, 600).unwrap();
    assert_eq!((aside.current.lease_id, aside.current.units), (8, 3));
    assert_eq!(
        aside.reclaim(7, 600, 1000).1,
        gives_back(5, true),
        "its owner may still take them out"
    );
    let next = slot.install(1, grant(3, 5_000), 2_500).unwrap();
    assert_eq!(next.current.units, 3);
    let (next, _) = slot.take(at(2), 1, 2_500, BUSY, ASK, None);
    assert!(next.is_some(), "another check may take the slot");
}

#[test]
fn ended_leases_give_way_to_a_grant_and_a_live_one_waiting_aside_does_not() {
    // The spent lease (draws out) waits aside; the one in use ends
    // with its window; so does the aside one.
    let spent = Slot::default().install(1, grant(1, 1_000), 10).unwrap();
    let (spent, taken) = take(spent, 1, 20);
    assert!(matches!(taken, Take::Hit(_)));
    assert_eq!(spent.current.lent, 1);
    let in_use = Grant {
        lease_id: 8,
        ..grant(5, 1_000)
    };
    let both = spent.install(1, in_use, 30).unwrap();
    assert_eq!((both.previous.lease_id, both.current.lease_id), (7, 8));
    // The next window's grant goes in: the ended one in use waits
    // aside, the older ended one gives way.
    let next_window = Grant {
        lease_id: 9,
        ..grant(4, 61_000)
    };
    let installed = both.install(1, next_window, 1_000).unwrap();
    assert_eq!(
        (installed.previous.lease_id, installed.current.lease_id),
        (8, 9)
    );
    // While the aside lease is live, an ended current one cannot
    // take its place.
    let live_aside = Slot {
        previous: Lease {
            expires_ms: 5_000,
            ..both.previous
        },
        ..both
    };
    assert_eq!(live_aside.install(1, next_window, 1_000), None);
}

/// A lease on a second and a minute (or of a sliding window, or of a
/// token bucket) ends before every window it was charged in does: its
/// units still count there until its owner gives them back. On a loaded
/// machine owners' ticks come late, and several leases of a busy client
/// end before one runs (seen end to end: the minute counted 637 for 583
/// admitted). Each ended lease that gives way to a grant keeps its units
/// in the slot for its owner, and a draw of it put back late lands there
/// too; the grants still go in (holding them back sent a busy client to
/// meshlimitd for every request around each boundary).
#[test]
fn ended_leases_that_give_way_keep_their_units_for_their_owners() {
    let lease = |lease_id: u64, expires_ms: u64| Grant {
        lease_id,
        ..grant(5, expires_ms)
    };
    let slot = Slot::default().install(1, lease(7, 1_000), 10).unwrap();
    // A draw of the first lease is out past its end.
    let (mut slot, taken) = take(slot, 1, 20);
    let draw = drawn(taken);
    assert_eq!((draw.drawn, draw.left), (1, 0));
    // Three more leases end, each granted as the last one ended: none of
    // their owners' ticks has run.
    for (id, expires_ms) in [(8, 1_500), (9, 2_000), (10, 2_500)] {
        slot = slot
            .install(1, lease(id, expires_ms), expires_ms - 500)
            .unwrap_or_else(|| panic!("grant {id} went back"));
    }
    assert_eq!(slot.current.lease_id, 10);
    slot = slot.put_back(&draw).expect("the late draw has its lease");
    // Each owner's tick, late, takes out what its lease left.
    for (id, units) in [(7, 4), (8, 5), (9, 5)] {
        let (written, reclaimed) = slot.reclaim(id, 2_600, 1000);
        assert_eq!(reclaimed, gives_back(units, true), "lease {id}");
        slot = written.unwrap();
    }
    let (written, reclaimed) = slot.reclaim(10, 2_600, 1000);
    assert_eq!(reclaimed, gives_back(5, true));
    assert!(!written.unwrap().holds_units(2_600));
}

/// Two places: a third lease owed while both still hold units takes the
/// place of the one that ended first (its units are lost to its windows:
/// fewer admitted, never more); a place whose lease was taken out, or
/// spent, is used first.
#[test]
fn the_lease_owed_longest_gives_way_when_both_places_hold_units() {
    let lease = |lease_id: u64, expires_ms: u64| Grant {
        lease_id,
        ..grant(5, expires_ms)
    };
    let mut slot = Slot::default().install(1, lease(7, 1_000), 10).unwrap();
    for (id, expires_ms) in [(8, 1_200), (9, 1_400), (10, 1_600), (11, 1_800)] {
        slot = slot
            .install(1, lease(id, expires_ms), expires_ms - 200)
            .unwrap();
    }
    // 7, 8 and 9 were owed in turn; 7 gave way to 9, its units counted.
    assert_eq!(slot.owed.map(|l| l.lease_id), [9, 8]);
    assert_eq!(slot.dropped_units, 5);
    assert_eq!(slot.reclaim(7, 1_700, 1000).1, Reclaim::Gone);
    // 8's owner takes its units out: its place is the next one used,
    // though 9 ended later.
    let (taken_out, reclaimed) = slot.reclaim(8, 1_700, 1000);
    assert_eq!(reclaimed, gives_back(5, true));
    let slot = taken_out
        .unwrap()
        .install(1, lease(12, 2_000), 1_800)
        .unwrap();
    assert_eq!(slot.owed.map(|l| l.lease_id), [9, 10]);
}

#[test]
fn a_clock_stepping_back_ends_a_lease() {
    let slot = Slot::default()
        .install(1, grant(5, 60_000), 10_000)
        .unwrap();
    let (_, t) = take(slot, 1, 9_950);
    assert!(matches!(t, Take::Hit(_)), "a little skew is fine");
    let (_, t) = take(slot, 1, 5_000);
    assert!(matches!(t, Take::Miss { .. }));
    let (_, r) = slot.reclaim(7, 5_000, 1000);
    assert_eq!(r, gives_back(5, true));
}

#[test]
fn slots_round_trip_and_short_values_read_as_zero() {
    let slot = Slot::default().install(3, grant(9, 800), 10).unwrap();
    assert_eq!(Slot::decode(Some(&slot.encode())), slot);
    let (slot, _) = take(slot, 3, 20);
    let aside = Slot {
        previous: slot.current,
        asking_until_ms: 77,
        ..slot
    };
    // An owed lease keeps its id, units, lent units, expiry and whether
    // its units outlive it.
    let owed = Slot {
        owed: [
            Lease {
                lease_id: 5,
                units: 3,
                lent: 1,
                expires_ms: 700,
                outlives_expiry: true,
                ..Lease::default()
            },
            Lease::default(),
        ],
        ..aside
    };
    assert_eq!(Slot::decode(Some(&owed.encode())), owed);
    assert_eq!(Slot::decode(Some(&aside.encode())), aside);
    assert_eq!(aside.encode().len(), WORDS * 8);
    // The sizes README.md and docs/leases.md give for `leases.slots`.
    assert_eq!(WORDS * 8, 312);
    assert_eq!(Slot::decode(Some(&[1, 2, 3])), Slot::default());
}

/// Shared data outlives a filter upgrade (same `vm_id`): a slot a
/// build with another layout wrote must not be read as leases (a
/// timestamp read as units would admit what nobody charged). It reads
/// as empty: its units are lost to their window, fewer admitted.
#[test]
fn a_slot_of_another_layout_reads_as_empty() {
    for words in [WORDS - 3, WORDS - 1, WORDS + 1, WORDS + 3] {
        let bytes = le_words(&vec![1_700_000_000_000u64; words]);
        assert_eq!(Slot::decode(Some(&bytes)), Slot::default(), "{words} words");
    }
}

#[test]
fn a_renewal_near_its_windows_end_asks_for_what_the_pace_spends_before_it() {
    let window_bound = AskFor {
        window_bound_interval_ms: Some(1_000),
        ..ASK
    };
    // A token bucket's lease, or a window an interval or more from its
    // end: the whole pace.
    assert_eq!(ASK.renewal_units(100, 1_250, 10, 1_000), 100);
    assert_eq!(window_bound.renewal_units(100, 2_000, 10, 1_000), 100);
    // 250 ms left: a quarter of the pace, beyond the 10 units held.
    assert_eq!(window_bound.renewal_units(100, 1_250, 10, 1_000), 15);
    // What is held lasts until the end, or the end has passed.
    assert_eq!(window_bound.renewal_units(100, 1_250, 25, 1_000), 0);
    assert_eq!(window_bound.renewal_units(100, 900, 0, 1_000), 0);
    // Rounded up: 1 ms of a slow pace still asks for a unit.
    assert_eq!(window_bound.renewal_units(3, 1_001, 0, 1_000), 1);
}
