//! The proxy-wasm glue: reads each callback, hands it to [`crate::flow`],
//! and carries out the [`Step`] it returns. Nothing is decided here.
//!
//! Every hostcall goes through [`host::WasmHost`] (which uses
//! `proxy_wasm::hostcalls`, returning `Result`, and the panic-free
//! wrappers in [`abi`]), never through the SDK's trait helpers, which
//! `unwrap()`: a panic would trap the VM and break every later request on
//! this worker.

mod abi;
mod host;
mod timers;

use std::rc::Rc;

use log::error;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel};

use crate::config;
use crate::flow::{self, Step, Worker};
use host::WasmHost;
use timers::Site;

proxy_wasm::main! {{
    // Debug: the decision log may write at debug (`decision_log.level`);
    // nothing else does, and Envoy drops what its wasm level hides.
    proxy_wasm::set_log_level(LogLevel::Debug);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root { context_id, worker: None })
    });
}}

/// A worker's root context: configuration, and group commit's batches.
struct Root {
    context_id: u32,
    worker: Option<Rc<Worker>>,
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(bytes) => bytes.unwrap_or_default(),
            Err(e) => {
                error!("cannot read the plugin configuration: {e:?}");
                return false;
            }
        };
        match config::parse(&bytes) {
            Ok(config) => {
                self.worker = Some(Rc::new(Worker::new(&WasmHost, config, self.context_id)));
                true
            }
            Err(e) => {
                // One line naming the field; Envoy then refuses the config.
                error!("{e}");
                false
            }
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let _timer = timers::start(Site::Wake);
        // The queue only carries wake-ups; the checks are in the batcher.
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        if let Some(worker) = &self.worker {
            worker.on_wake(&WasmHost);
        }
    }

    fn on_tick(&mut self) {
        let _timer = timers::start(Site::Tick);
        if let Some(worker) = &self.worker {
            worker.on_tick(&WasmHost);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let _timer = timers::start(Site::StreamCreated);
        // The SDK panics on None, so an unconfigured plugin gets a stream
        // that does nothing (Envoy does not send traffic to it anyway).
        let worker = self.worker.clone();
        let state = worker.as_ref().map(|w| w.stream(context_id));
        Some(Box::new(Stream { worker, state }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

impl Context for Root {
    /// The configuration is replaced or removed: what the worker holds
    /// goes back first; false keeps the root until it calls `proxy_done`.
    fn on_done(&mut self) -> bool {
        match &self.worker {
            Some(worker) => worker.on_done(&WasmHost),
            None => true,
        }
    }

    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, _: usize) {
        let _timer = timers::start(Site::BatchAnswer);
        if let Some(worker) = &self.worker {
            worker.on_batch_answer(&WasmHost, token, headers, body_size);
        }
    }
}

/// One HTTP stream.
struct Stream {
    worker: Option<Rc<Worker>>,
    state: Option<flow::Stream>,
}

impl Stream {
    /// Carries out a step; `paused` says the request is paused.
    fn perform(step: Step, paused: bool) -> Action {
        if flow::perform(&WasmHost, step, paused) {
            Action::Continue
        } else {
            Action::Pause
        }
    }
}

impl Context for Stream {
    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, _: usize) {
        if let (Some(worker), Some(state)) = (&self.worker, &mut self.state) {
            if worker.owns_call(state, token) {
                let step = worker.on_call_answer(&WasmHost, state, headers, body_size);
                Self::perform(step, true);
            } else {
                // A top-up or settlement this stream sent for its worker.
                worker.on_batch_answer(&WasmHost, token, headers, body_size);
            }
        }
    }
}

/// Pause when the flow says the data must wait.
fn action(go_on: bool) -> Action {
    if go_on {
        Action::Continue
    } else {
        Action::Pause
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let timer = timers::start(Site::RequestGoesOn);
        let action = match (&self.worker, &mut self.state) {
            (Some(worker), Some(state)) => Self::perform(
                worker.on_request_headers(&WasmHost, state, end_of_stream),
                false,
            ),
            _ => Action::Continue,
        };
        if let (Some(timer), Action::Pause) = (timer, action) {
            timer.finish_as(Site::RequestPaused);
        }
        action
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        match (&self.worker, &mut self.state) {
            (Some(worker), Some(state)) => Self::perform(
                worker.on_request_body(&WasmHost, state, size, end_of_stream),
                false,
            ),
            _ => Action::Continue,
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let _timer = timers::start(Site::ResponseHeaders);
        match (&self.worker, &mut self.state) {
            (Some(worker), Some(state)) => action(worker.on_response_headers(&WasmHost, state)),
            _ => Action::Continue,
        }
    }

    fn on_http_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        match (&self.worker, &self.state) {
            (Some(worker), Some(state)) => {
                action(worker.on_response_body(&WasmHost, state, size, end_of_stream))
            }
            _ => Action::Continue,
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _timer = timers::start(Site::StreamEnd);
        if let (Some(worker), Some(state)) = (&self.worker, &self.state) {
            worker.on_stream_end(&WasmHost, state);
        }
    }
}
