//! What the fuzz targets share: one runtime per process for the targets
//! that drive hyper or an async reader.

use std::sync::OnceLock;

/// A current-thread runtime made once: a new one per input would cost more
/// than most inputs.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    })
}
