//! The little the decision logic needs from the host, as traits, so that all
//! of it runs (and is unit-tested) natively without Envoy.

/// Read access to the request being decided.
pub trait RequestView {
    /// Raw bytes of a request header (lower-case name). Bytes, not a
    /// `String`: Envoy passes obs-text through, and a UTF-8 conversion that
    /// fails must never be able to trap the VM.
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// Envoy's `source.address` property (`ip:port`).
    fn source_address(&self) -> Option<String>;
}

/// The `i`-th little-endian u64 of a shared-data value, if it has one.
/// Values in shared data are sequences of such words.
pub fn le_word(bytes: &[u8], i: usize) -> Option<u64> {
    bytes
        .get(i * 8..i * 8 + 8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
}

/// Why a shared-data operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// Another worker wrote the key since we read it: retry.
    CasMismatch,
    /// Anything else the host reported.
    Failed,
}

/// proxy-wasm shared data: one byte string per key, shared by every worker
/// of the VM, with compare-and-swap. It has no expiry, which is why callers
/// use a fixed set of keys.
pub trait SharedStore {
    /// The value and its CAS token.
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError>;
    /// Writes when `cas` still matches (or unconditionally with `None`).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

#[cfg(test)]
pub mod fake {
    //! In-memory doubles of the host traits, for unit tests.
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashMap;

    #[derive(Default, Clone)]
    pub struct FakeRequest {
        pub headers: Vec<(String, Vec<u8>)>,
        pub source: Option<String>,
    }

    impl FakeRequest {
        pub fn with_header(mut self, name: &str, value: &[u8]) -> Self {
            self.headers.push((name.to_string(), value.to_vec()));
            self
        }
        pub fn from_source(mut self, addr: &str) -> Self {
            self.source = Some(addr.to_string());
            self
        }
    }

    impl RequestView for FakeRequest {
        fn header(&self, name: &str) -> Option<Vec<u8>> {
            self.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        }
        fn source_address(&self) -> Option<String> {
            self.source.clone()
        }
    }

    /// Shared data with CAS tokens, plus a switch to inject CAS conflicts.
    #[derive(Default)]
    pub struct FakeStore {
        pub data: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        pub conflicts_left: RefCell<u32>,
        pub broken: bool,
    }

    impl SharedStore for FakeStore {
        fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
            if self.broken {
                return Err(StoreError::Failed);
            }
            Ok(match self.data.borrow().get(key) {
                Some((v, cas)) => (Some(v.clone()), Some(*cas)),
                None => (None, None),
            })
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            if self.broken {
                return Err(StoreError::Failed);
            }
            let mut left = self.conflicts_left.borrow_mut();
            if *left > 0 {
                *left -= 1;
                return Err(StoreError::CasMismatch);
            }
            let mut data = self.data.borrow_mut();
            let current = data.get(key).map(|(_, c)| *c);
            // Envoy's rule: a non-zero token must match an existing entry's.
            if let (Some(c), Some(cur)) = (cas, current) {
                if c != 0 && c != cur {
                    return Err(StoreError::CasMismatch);
                }
            }
            let next = current.unwrap_or(0) + 1;
            data.insert(key.to_string(), (value.to_vec(), next));
            Ok(())
        }
    }
}
