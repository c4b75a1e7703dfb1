#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| modelforge::fuzz::run("json_body", data));
