//! The do-nothing filter of `make bench`: it reads the client id as
//! meshlimit's benched configuration does (the `x-api-key` header, else
//! the `key` query parameter, which is in `:path`) and lets the request go
//! on. Reading the one header that carries the id, when it is there, is the
//! least any filter deciding by the client must do (a lookup that finds
//! nothing copies nothing, and would not be a fair floor for the Zipf mix,
//! whose ids are in the query). Built with the same SDK, runtime and VM settings as meshlimit, it is
//! the practical limit of any Rust wasm filter: what crossing into a VM
//! for each request costs Envoy.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, MapType};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream;

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        // Read, as a filter deciding by it would; the value is not used.
        if let Ok(None) = hostcalls::get_map_value(MapType::HttpRequestHeaders, "x-api-key") {
            let _ = hostcalls::get_map_value(MapType::HttpRequestHeaders, ":path");
        }
        Action::Continue
    }
}
