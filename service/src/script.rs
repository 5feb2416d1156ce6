//! The Lua scripts that decide checks on Redis.
//!
//! One decision per check, whatever the number and mix of its limits
//! ([`CHECK`] makes one per run, [`CHECK_MANY`] several, one after the other,
//! each all or nothing on its own). A decision reads every counter of its
//! check, decides, and only then charges them, so a denied
//! request consumes nothing anywhere (the seed article's sorted-set version
//! records denied requests too, which keeps a persistent client locked out).
//! The clock is Redis' `TIME`, never the callers' (N replicas, N clocks).
//! Every key gets its expiry in the same run that writes it, so no key can
//! outlive its usefulness, unlike `INCR` followed by a separate `EXPIRE`,
//! which leaves an immortal key when the caller dies between the two.
//!
//! Algorithms (one declared key per limit, all sharing the subject's hash
//! tag, which is what Redis Cluster wants):
//! - `fw`  fixed window: a counter per window aligned to Redis time, created
//!   with `PEXPIREAT` at the window's end, so the key needs no window number.
//!   A counter found without expiry (a manual `INCR`) gets it back.
//! - `swl` sliding window log: a sorted set of admitted requests (score =
//!   microseconds), trimmed to the window; exact. Members carry a per-call
//!   nonce so requests in the same microsecond stay distinct.
//! - `swc` sliding window counter: a hash `{w, c, p}` (window number, its
//!   count, the previous window's count); the estimate weighs the previous
//!   window by how much of it still overlaps. Constant memory.
//! - `tb`  token bucket as GCRA: one stored theoretical arrival time (TAT,
//!   microseconds). Emission interval `T = window / requests`, capacity
//!   `burst` units; a request of cost `k` fits when `TAT + k*T - burst*T <= now`.
//!
//! Large numbers go to Redis through `string.format('%.0f')`: Lua's default
//! number-to-string conversion keeps 14 digits, which would silently round a
//! microsecond timestamp.
//!
//! The Lua lives in `src/lua/` where Lua tools can read it: `decide.lua`
//! (the decision of one check, as a function) followed by `check.lua` or
//! `check_many.lua` (the entry points).
//!
//! Calendar windows (`fw` with a calendar) end on the next day, ISO week or
//! month edge at the limit's UTC offset, computed in the script from the
//! run's clock as `meshlimit_protocol::calendar` computes them (a test
//! compares the two on real Redis).
//!
//! Live overrides: with meshlimitd's admin API on, each limit's override
//! key (same hash tag as its counter) is declared after the counters and
//! read in the same run, so an override applies atomically with the
//! decision and fleet-wide at once.
//!
//! Epochs: a check whose receipts may come back (a reservation, a lease
//! ask) declares one epoch key per limit, its subject's (same hash tag),
//! after the override keys. The run reads it, makes it when missing, and
//! keeps it alive as long as the counters it charged; each charged
//! limit's reply carries it, and so does its receipt. A return on a
//! receipt of another epoch gives nothing back (`settle.lua`): Redis lost
//! the counters since, and the counter of the same name never held those
//! units.
//!
//! KEYS: one counter per limit; with overrides, then one override per
//!       limit; with epochs, then one epoch key per limit; then, for a
//!       lease ask with an id, its grant record.
//! ARGV: nonce, overrides (0/1), test clock key ('' in production), lease
//!       units wanted and share, whether a grant record's key follows
//!       (0/1), whether epoch keys do (see [`Epochs`]), then per limit: algorithm,
//!       requests, window_ms, cost, burst, shadow (0/1), calendar ('' or
//!       `month:120`). Laid out by [`check_args`] and [`limit_args`]
//!       (meshlimitd and the bench's redis-benchmark row alike).
//! Returns: allowed, the units leased, then per limit: fits, remaining,
//!          reset_after_ms, retry_after_ms, limit (after any override),
//!          epoch (0 when not charged or not asked); then the run's clock
//!          (microseconds), a reservation's receipt with the nonce.

/// Arguments per limit after the fixed ones (`ARGS_PER_LIMIT` in
/// `decide.lua`).
pub const ARGS_PER_LIMIT: usize = 7;
/// Values per limit in the reply after the overall decision
/// (`REPLY_PER_LIMIT` in `decide.lua`).
pub const REPLY_PER_LIMIT: usize = 6;
/// Values of a check's reply before its limits' (`allowed`, the units
/// leased).
pub const REPLY_HEAD: usize = 2;
/// Arguments per limit of [`SETTLE`] (`SETTLE_ARGS` in `settle.lua`).
pub const SETTLE_ARGS: usize = 11;

/// [`CHECK`]'s arguments before its limits': the run's nonce, whether live
/// overrides are read, the test clock key ('' in production), the lease
/// units wanted and their share (`(0, 1)`: no lease), and whether a grant
/// record's key and epoch keys follow the check's keys.
pub fn check_args(
    nonce: &str,
    overrides: bool,
    clock_key: &str,
    (want, share): (u64, u64),
    follow: Follow,
) -> [String; 7] {
    [
        nonce.to_string(),
        u8::from(overrides).to_string(),
        clock_key.to_string(),
        want.to_string(),
        share.to_string(),
        u8::from(follow.grant).to_string(),
        (follow.epochs as u8).to_string(),
    ]
}

/// The keys that follow a check's counters and override keys.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Follow {
    /// Its lease ask's grant record (an ask with an id), last.
    pub grant: bool,
    /// One epoch key per limit, before it, when receipts may come back.
    pub epochs: Epochs,
}

/// When a check's run reads (and makes) its subjects' epochs: only for
/// receipts that can come back, so a subject never leased nor reserving
/// keeps no epoch key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Epochs {
    /// No epoch keys declared.
    #[default]
    None = 0,
    /// The check asks for receipts (a reservation).
    Receipts = 1,
    /// The check asks for a lease: epochs if one is granted.
    IfLeased = 2,
}

impl Epochs {
    /// Whether epoch keys follow the check's keys.
    pub fn declared(self) -> bool {
        self != Epochs::None
    }
}

/// A limit's [`ARGS_PER_LIMIT`] arguments, as every script takes them.
pub fn limit_args(limit: &meshlimit_protocol::Limit) -> [String; ARGS_PER_LIMIT] {
    [
        limit.algorithm.short_name().to_string(),
        limit.requests.to_string(),
        limit.window_ms.to_string(),
        limit.cost.to_string(),
        limit.capacity().to_string(),
        u8::from(limit.shadow).to_string(),
        calendar_arg(limit),
    ]
}

/// A limit's calendar as the scripts take it: `month:120`, or "".
pub fn calendar_arg(limit: &meshlimit_protocol::Limit) -> String {
    limit.calendar.map_or_else(String::new, |c| {
        format!("{}:{}", c.unit.as_str(), c.utc_offset_minutes)
    })
}

/// One check per run.
pub const CHECK: &str = concat!(
    include_str!("lua/decide.lua"),
    include_str!("lua/check.lua")
);

/// Several checks in one run, decided one after the other, each on its own
/// and all or nothing exactly as [`CHECK`] decides it; one `TIME` for all.
///
/// ARGV: nonce, overrides, test clock key, number of checks, then per
/// check: its number of limits, lease units wanted and share, whether a
/// grant record's key follows, whether epoch keys do, and its limits'
/// arguments as for [`CHECK`]. KEYS:
/// every check's keys, in order. Returns every check's reply, concatenated
/// in order, then the run's clock (a reservation's receipt; check `c` of
/// the run used nonce `<nonce>.<c>`).
pub const CHECK_MANY: &str = concat!(
    include_str!("lua/decide.lua"),
    include_str!("lua/check_many.lua")
);

/// Settles reservations: charges or gives back the difference between
/// the units reserved and used, in the counters and windows the
/// reservations were charged to (token budgets). A refund is a settlement
/// at 0 units used: what a check spread over Cluster slots uses when one
/// slot denies.
pub const SETTLE: &str = concat!(
    include_str!("lua/decide.lua"),
    include_str!("lua/settle.lua")
);

/// Reads, sets or deletes a live override (the admin API).
pub const OVERRIDE: &str = include_str!("lua/override.lua");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lua_names_the_same_argument_layout() {
        let lua = include_str!("lua/decide.lua");
        assert!(lua.contains(&format!("local ARGS_PER_LIMIT = {ARGS_PER_LIMIT}\n")));
        assert!(lua.contains(&format!("local REPLY_PER_LIMIT = {REPLY_PER_LIMIT}\n")));
        // The reply's head: the decision, then the units leased.
        assert!(lua.contains("local out = { allowed, leased }") && REPLY_HEAD == 2);
        // No stray literal stride left behind.
        assert!(!CHECK_MANY.contains("* 7") && !CHECK.contains("* 7"));
        let settle = include_str!("lua/settle.lua");
        assert!(settle.contains(&format!("local SETTLE_ARGS = {SETTLE_ARGS}\n")));
        assert!(settle.contains(&format!(
            "local SETTLEMENT_ID_MS = {}\n",
            meshlimit_protocol::bounds::SETTLEMENT_ID_MS
        )));
        assert!(lua.contains(&format!(
            "local GRANT_RECORD_MS = {}\n",
            meshlimit_protocol::bounds::GRANT_RECORD_MS
        )));
    }

    /// Adding an algorithm to the protocol fails here until every script
    /// decides, charges and settles it (and sizes its leases, when its
    /// units can be leased).
    #[test]
    fn every_algorithm_has_a_branch_in_every_script() {
        use meshlimit_protocol::{Algorithm, LeaseLife};
        let decide = include_str!("lua/decide.lua");
        let settle = include_str!("lua/settle.lua");
        for algorithm in Algorithm::ALL {
            let name = algorithm.short_name();
            let branch = format!("s.alg == '{name}' then");
            assert!(
                decide.matches(&branch).count() >= 2,
                "decide.lua decides and charges {algorithm:?} ({branch})"
            );
            assert!(
                settle.contains(&format!("alg == '{name}' then")),
                "settle.lua settles {algorithm:?}"
            );
            let leased = decide.contains(&format!("s.fits and s.alg == '{name}' then"));
            assert_eq!(
                leased,
                algorithm.lease_life() != LeaseLife::NotLeased,
                "decide.lua leases {algorithm:?} exactly when the protocol says it may"
            );
        }
    }
}
