//! Panic-free wrappers for the hostcalls whose status depends on the state
//! of a dispatched call, and for reading the request's header map.
//!
//! The SDK's `hostcalls` return `Result`, but `panic!` on any status they do
//! not expect. After a timed-out or reset call Envoy has no response header
//! map or body, and reading one returns `BadArgument`: through the SDK that
//! is a panic, which traps the VM (seen with Envoy 1.40: a response whose
//! headers arrived and whose body came after the timeout). These wrappers
//! declare the same ABI imports and turn every non-OK status into `None`.

use std::ptr::null_mut;

use proxy_wasm::types::{BufferType, MapType};

use crate::host::HeaderMap;

const STATUS_OK: u32 = 0;

#[link(wasm_import_module = "env")]
#[allow(clashing_extern_declarations)] // same imports as the SDK, u32 status
extern "C" {
    fn proxy_get_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
}

/// Takes ownership of a buffer the host allocated through the SDK's
/// `proxy_on_memory_allocate` (the global allocator).
fn owned(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        return Vec::new();
    }
    // SAFETY: the host wrote `size` bytes into memory it obtained from our
    // allocator for exactly this call, and hands ownership to us.
    unsafe { Vec::from_raw_parts(data, size, size) }
}

/// A header of the dispatched call's response, if there is one.
pub fn call_response_header(name: &str) -> Option<Vec<u8>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: pointers to live locals; the host fills them on success.
    let status = unsafe {
        proxy_get_header_map_value(
            MapType::HttpCallResponseHeaders,
            name.as_ptr(),
            name.len(),
            &mut data,
            &mut size,
        )
    };
    (status == STATUS_OK).then(|| owned(data, size))
}

/// Up to `max` bytes of the dispatched call's response body.
pub fn call_response_body(max: usize) -> Option<Vec<u8>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: as above.
    let status = unsafe {
        proxy_get_buffer_bytes(
            BufferType::HttpCallResponseBody,
            0,
            max,
            &mut data,
            &mut size,
        )
    };
    (status == STATUS_OK).then(|| owned(data, size))
}

/// Every header of the current request, decoded without trusting the
/// encoding (the SDK's `get_map_bytes` panics on an unexpected status and
/// unwraps as it decodes).
pub fn request_headers() -> Option<HeaderMap> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: pointers to live locals; the host fills them on success.
    let status =
        unsafe { proxy_get_header_map_pairs(MapType::HttpRequestHeaders, &mut data, &mut size) };
    if status != STATUS_OK {
        return None;
    }
    HeaderMap::parse(owned(data, size))
}
