//! The configuration: any TOML either validates or fails with an error
//! that names the field at fault; never a panic.
#![no_main]

use fencegate::config::{Config, ConfigError, RawConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Validation reads the files a config names (token files): a device
    // or a FIFO would be read for ever. What is fuzzed is the parsing.
    if ["/dev", "/proc", "/sys", "/run"]
        .iter()
        .any(|d| text.contains(d))
    {
        return;
    }
    let Ok(raw) = RawConfig::from_toml(text) else {
        return;
    };
    match Config::try_from(raw) {
        Ok(_) => {}
        Err(ConfigError::Invalid { field, reason }) => {
            assert!(
                !field.trim().is_empty(),
                "an error naming no field: {reason}"
            );
            assert!(
                !reason.trim().is_empty(),
                "an error on `{field}` saying nothing"
            );
        }
        Err(e) => panic!("validation failed without naming a field: {e}"),
    }
});
