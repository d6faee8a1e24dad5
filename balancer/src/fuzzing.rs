//! Entry points for the cargo-fuzz targets in `fuzz/`: the parsers that
//! take untrusted input (request bodies and paths, client request heads,
//! the config file, admin bodies, workers' answers), exposed so that a
//! fuzzer links them. Not an API: nothing here is meant to be called by
//! anything but a fuzz target, and every function must only return (never
//! panic), whatever its input.

use std::ffi::OsString;
use std::path::Path;

use bytes::Bytes;
use http::Method;

use balancer_core::spec::{Resilience, WorkerSpec};

use crate::proxy::fuzz_request_body;

/// Everything the request path does with a body and a path it is handed.
pub fn request(method: &[u8], path: &str, body: &[u8]) {
    let method = Method::from_bytes(method).unwrap_or(Method::POST);
    fuzz_request_body(&method, path, &Bytes::copy_from_slice(body));
}

/// The config file's text, as `--config` reads it, and the validation of
/// every worker it declares.
pub fn config_toml(text: &str) {
    if let Ok((_, workers)) =
        crate::cli::config_text_args(text, Path::new("fuzz.toml"), &[OsString::from("--port")])
    {
        for w in workers {
            let _ = w.validate();
        }
    }
}

/// An admin API body: a worker spec (`POST /workers`) or a resilience
/// patch (`PATCH /workers/{id}`), parsed and validated.
pub fn admin_body(body: &[u8]) {
    if let Ok(spec) = serde_json::from_slice::<WorkerSpec>(body) {
        let _ = spec.validate();
    }
    if let Ok(patch) = serde_json::from_slice::<Resilience>(body) {
        let _ = patch.validate();
        let _ = Resilience::default().merged(&patch).validate();
    }
}

/// A client's bytes as the server's fast path reads them: a plain request
/// (head, headers and `Content-Length` body) or bytes left to hyper.
pub fn client_request(wire: &[u8]) {
    let _ = crate::server::read_request(wire);
}

/// A worker's answer on the fast path: its head and its body's framing
/// (sizes, chunks, trailers).
pub fn worker_response(wire: &[u8]) {
    let _ = crate::h1::read_answer(wire);
}

/// A client's bytes and a worker's bytes through the hand-written HTTP/1.1
/// paths and through hyper: panics where ours is laxer (the one entry here
/// that may, as a finding).
#[cfg(feature = "differential")]
pub fn differential(client: &[u8], worker: &[u8]) {
    if let Err(why) = crate::differential::compare(client, worker) {
        panic!("{why}");
    }
}
