//! `arxConfig_t` to [`arx::Builder`].
//!
//! The struct is checked field by field here (framing, enum values, signs);
//! ranges are checked by arx itself, in the one place it checks builder
//! options and `ARX_*` variables alike (an out-of-range value is refused
//! naming the `Builder` method, see docs/C.md). A config refused here does
//! not leave the other ranks waiting: [`Builder::refuse`] makes this rank
//! take part in the first collective step with its refusal, so every peer
//! fails at once with `arxPeerFailed`.

use std::ffi::{c_int, CStr};
use std::time::Duration;

use arx::{Builder, DeviceKind, Error, FabricKind, SpinMode, Staging};

use crate::types::{arxConfig_t, ARX_CONFIG_MAGIC, ARX_CONFIG_UNDEF_INT, ARX_VERSION_CODE};

/// The oldest `arxConfig_t.version` this library reads (0.1.0).
const FIRST_VERSION: u32 = 100;

fn bad(field: &'static str, value: impl ToString, reason: impl Into<String>) -> Error {
    Error::Config {
        name: field,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// A set `int` field, or None when it holds `ARX_CONFIG_UNDEF_INT`.
fn set(v: c_int) -> Option<c_int> {
    (v != ARX_CONFIG_UNDEF_INT).then_some(v)
}

/// A set field that must not be negative.
fn non_negative(field: &'static str, v: c_int) -> Result<Option<usize>, Error> {
    match set(v) {
        None => Ok(None),
        Some(v) if v < 0 => Err(bad(
            field,
            v,
            "must not be negative (ARX_CONFIG_UNDEF_INT leaves it unset)",
        )),
        Some(v) => Ok(Some(v as usize)),
    }
}

/// A set enum field: its value among `choices` (index = C value).
fn choice<T: Copy>(field: &'static str, v: c_int, choices: &[T]) -> Result<Option<T>, Error> {
    match set(v) {
        None => Ok(None),
        Some(i) => usize::try_from(i)
            .ok()
            .and_then(|i| choices.get(i).copied())
            .map(Some)
            .ok_or_else(|| {
                bad(
                    field,
                    i,
                    format!(
                        "expected 0 to {} or ARX_CONFIG_UNDEF_INT",
                        choices.len() - 1
                    ),
                )
            }),
    }
}

/// The `arxConfig_t` field behind a builder option (arx names the option
/// it refuses; the C caller wrote the field).
fn field_of(option: &'static str) -> &'static str {
    match option {
        "Builder::device" => "arxConfig_t.device",
        "Builder::fabric" => "arxConfig_t.fabric",
        "Builder::staging" => "arxConfig_t.staging",
        "Builder::spin" => "arxConfig_t.spin",
        "Builder::slot_bytes" => "arxConfig_t.slotBytes",
        "Builder::timeout" => "arxConfig_t.timeoutMs",
        "Builder::init_timeout" => "arxConfig_t.initTimeoutMs",
        "Builder::stall_warn" => "arxConfig_t.stallWarnMs",
        "Builder::cuda_device" => "arxConfig_t.cudaDevice",
        "Builder::gid_index" => "arxConfig_t.gidIndex",
        "Builder::proxy_cpu" => "arxConfig_t.proxyCpu",
        "Builder::devices" => "arxConfig_t.rdmaDevices",
        other => other,
    }
}

fn millis(field: &'static str, v: c_int) -> Result<Option<Duration>, Error> {
    Ok(non_negative(field, v)?.map(|ms| Duration::from_millis(ms as u64)))
}

/// The builder for `config` (NULL: every setting from the environment or
/// its default), or the error that this rank refuses start-up with.
///
/// # Safety
/// `config` is NULL or points to a readable `arxConfig_t` whose first
/// `size` bytes are initialised, as `ARX_CONFIG_INITIALIZER` makes it;
/// `rdmaDevices`, if not NULL, is a NUL-terminated string.
pub(crate) unsafe fn builder(config: *const arxConfig_t) -> Result<Builder, Error> {
    let mut b = Builder::default().names(field_of);
    if config.is_null() {
        return Ok(b);
    }
    // Only `size` is read before it is known to match: an older or newer
    // program's struct may be shorter.
    // SAFETY: `config` is readable for at least its `size` field (the
    // caller's contract).
    let size = unsafe { std::ptr::addr_of!((*config).size).read() };
    if size != std::mem::size_of::<arxConfig_t>() {
        return Err(bad(
            "arxConfig_t.size",
            size,
            format!(
                "this library's arxConfig_t has {} bytes: initialise it with ARX_CONFIG_INITIALIZER from its arx.h",
                std::mem::size_of::<arxConfig_t>()
            ),
        ));
    }
    // SAFETY: `size` says the whole struct is there (the caller's contract).
    let c = unsafe { &*config };
    if c.magic != ARX_CONFIG_MAGIC {
        return Err(bad(
            "arxConfig_t.magic",
            format!("{:#x}", c.magic),
            format!(
                "expected ARX_CONFIG_MAGIC ({ARX_CONFIG_MAGIC:#x}): initialise it with ARX_CONFIG_INITIALIZER"
            ),
        ));
    }
    if !(FIRST_VERSION..=ARX_VERSION_CODE as u32).contains(&c.version) {
        return Err(bad(
            "arxConfig_t.version",
            c.version,
            format!(
                "this library reads versions {FIRST_VERSION} to {ARX_VERSION_CODE} \
                 (ARX_CONFIG_INITIALIZER sets the version of the arx.h compiled with)"
            ),
        ));
    }
    use DeviceKind as D;
    use FabricKind as F;
    if let Some(d) = choice("arxConfig_t.device", c.device, &[D::Auto, D::Host, D::Gpu])? {
        b = b.device(d);
    }
    if let Some(f) = choice("arxConfig_t.fabric", c.fabric, &[F::Auto, F::Shm, F::Verbs])? {
        b = b.fabric(f);
    }
    let stagings = [Staging::Sm, Staging::CopyEngine];
    if let Some(s) = choice("arxConfig_t.staging", c.staging, &stagings)? {
        b = b.staging(s);
    }
    let spins = [SpinMode::Adaptive, SpinMode::Hot, SpinMode::Nap];
    if let Some(s) = choice("arxConfig_t.spin", c.spin, &spins)? {
        b = b.spin(s);
    }
    if let Some(n) = non_negative("arxConfig_t.slotBytes", c.slotBytes)? {
        b = b.slot_bytes(n);
    }
    if let Some(t) = millis("arxConfig_t.timeoutMs", c.timeoutMs)? {
        b = b.timeout(t);
    }
    if let Some(t) = millis("arxConfig_t.initTimeoutMs", c.initTimeoutMs)? {
        b = b.init_timeout(t);
    }
    if let Some(t) = millis("arxConfig_t.stallWarnMs", c.stallWarnMs)? {
        b = b.stall_warn(t);
    }
    if let Some(d) = non_negative("arxConfig_t.cudaDevice", c.cudaDevice)? {
        b = b.cuda_device(d);
    }
    if let Some(g) = non_negative("arxConfig_t.gidIndex", c.gidIndex)? {
        b = b.gid_index(g as u32);
    }
    if let Some(p) = non_negative("arxConfig_t.proxyCpu", c.proxyCpu)? {
        b = b.proxy_cpu(p);
    }
    if !c.rdmaDevices.is_null() {
        // SAFETY: a NUL-terminated string (the caller's contract).
        let s = unsafe { CStr::from_ptr(c.rdmaDevices) };
        let s = s
            .to_str()
            .map_err(|_| bad("arxConfig_t.rdmaDevices", s.to_string_lossy(), "not UTF-8"))?;
        // Read as ARX_DEVICES is; arx checks the list (one or two names).
        b = b.devices(
            s.split(',')
                .map(|d| d.trim().to_string())
                .filter(|d| !d.is_empty())
                .collect(),
        );
    }
    Ok(b)
}
