//! Where a worker's time goes, measured inside the VM: `make bench-timers`
//! only (cargo feature `profile-timers`; in any other build every timer is
//! `None` and compiles away).
//!
//! Each proxy-wasm callback, and each costly hostcall the filter makes, is
//! timed on Envoy's clock and added to two counters, `meshlimit.profile.
//! <site>.us` (microseconds) and `meshlimit.profile.<site>.calls`. A
//! callback's time includes the hostcalls it makes, so its time minus
//! theirs is the filter's own code. What Envoy does around a callback
//! (creating the context, crossing into the VM) is in no timer: Envoy's
//! CPU per request minus the callbacks' time is that.
//!
//! The builds that skip a step (`make bench-profile`) price a step by the
//! difference between two Envoys, which the machine's drift and the
//! difference between two processes blur by a few percent; these timers
//! split one Envoy's time in one run. Each timer reads the clock twice (a
//! hostcall each), so the profiled build runs slower than the shipped one;
//! read the shares, not the total.

use std::cell::RefCell;

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Whether this build times anything.
const ON: bool = cfg!(feature = "profile-timers");

/// The counters are added to once this many times were recorded at a site
/// (a metric hostcall per request would be a timer's own cost again).
const RECORDS_PER_FLUSH: u64 = 64;

/// What is timed.
#[derive(Debug, Clone, Copy)]
pub(super) enum Site {
    /// `on_http_request_headers` that let the request go on (a lease hit,
    /// a local decision) or paused it (a call).
    RequestGoesOn,
    RequestPaused,
    ResponseHeaders,
    /// The stream's end (`Drop`), and its creation.
    StreamEnd,
    StreamCreated,
    /// The root's `on_http_call_response` (a batch's answer), its wake-up
    /// (`on_queue_ready`, which sends batches) and its tick.
    BatchAnswer,
    Wake,
    Tick,
    /// Hostcalls: the request's header map, a call dispatched, the
    /// answer's body, shared data read and written, a response header
    /// added, a paused request resumed.
    ReadHeaders,
    Dispatch,
    ReadAnswer,
    SharedGet,
    SharedSet,
    AddHeader,
    /// The last site: [`Site::COUNT`] counts from it.
    Resume,
}

impl Site {
    /// Sites, counted from the last one (new sites go before it).
    const COUNT: usize = Site::Resume as usize + 1;

    fn name(self) -> &'static str {
        match self {
            Site::RequestGoesOn => "request_goes_on",
            Site::RequestPaused => "request_paused",
            Site::ResponseHeaders => "response_headers",
            Site::StreamEnd => "stream_end",
            Site::StreamCreated => "stream_created",
            Site::BatchAnswer => "batch_answer",
            Site::Wake => "wake",
            Site::Tick => "tick",
            Site::ReadHeaders => "hostcall.read_headers",
            Site::Dispatch => "hostcall.dispatch",
            Site::ReadAnswer => "hostcall.read_answer",
            Site::SharedGet => "hostcall.shared_get",
            Site::SharedSet => "hostcall.shared_set",
            Site::AddHeader => "hostcall.add_header",
            Site::Resume => "hostcall.resume",
        }
    }
}

/// One site's time since its last flush, and its counters once defined.
#[derive(Clone, Copy, Default)]
struct Tally {
    ns: u64,
    records: u64,
    /// Metric ids plus one (0: not defined yet).
    us_metric: u32,
    calls_metric: u32,
}

thread_local! {
    static TALLIES: RefCell<[Tally; Site::COUNT]> = RefCell::new([Tally::default(); Site::COUNT]);
}

fn now_ns() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// A running timer: its time is recorded when it is dropped.
pub(super) struct Timer {
    site: Site,
    started_ns: u64,
}

/// Starts timing `site` (nothing, in a build without the feature).
pub(super) fn start(site: Site) -> Option<Timer> {
    ON.then(|| Timer {
        site,
        started_ns: now_ns(),
    })
}

/// Times `f` at `site`.
pub(super) fn timed<T>(site: Site, f: impl FnOnce() -> T) -> T {
    let _timer = start(site);
    f()
}

impl Timer {
    /// Records the time so far at another site instead (a callback whose
    /// site depends on how it ended).
    pub(super) fn finish_as(mut self, site: Site) {
        self.site = site;
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        let ns = now_ns().saturating_sub(self.started_ns);
        let site = self.site;
        TALLIES.with(|tallies| {
            let Ok(mut tallies) = tallies.try_borrow_mut() else {
                return;
            };
            let Some(t) = tallies.get_mut(site as usize) else {
                return;
            };
            t.ns = t.ns.saturating_add(ns);
            t.records += 1;
            if t.records < RECORDS_PER_FLUSH {
                return;
            }
            if t.us_metric == 0 {
                let define = |what: &str| {
                    hostcalls::define_metric(
                        MetricType::Counter,
                        &format!("meshlimit.profile.{}.{what}", site.name()),
                    )
                    .map_or(0, |id| id.saturating_add(1))
                };
                t.us_metric = define("us");
                t.calls_metric = define("calls");
            }
            let add = |metric: u32, n: u64| {
                if let Some(id) = metric.checked_sub(1) {
                    let _ = hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
                }
            };
            add(t.us_metric, t.ns / 1000);
            add(t.calls_metric, t.records);
            // The nanoseconds under a microsecond wait for the next flush.
            t.ns %= 1000;
            t.records = 0;
        });
    }
}
