//! `arx.Comm(comm, **settings)`: each keyword is a [`arx::Builder`] option
//! of the same name. A keyword or value this binding refuses is handed to
//! [`arx::Builder::refuse`], so that the refusal takes part in the start-up
//! exchange: this rank raises it, every other rank a `PeerFailedError`
//! naming this one, at once.

use std::time::Duration;

use arx::{Builder, DeviceKind, Error, FabricKind, SpinMode, Staging};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

/// The keywords, in the order the docs list them.
pub(crate) const KEYWORDS: &[&str] = &[
    "device",
    "fabric",
    "slot_bytes",
    "timeout",
    "init_timeout",
    "stall_warn",
    "spin",
    "staging",
    "devices",
    "gid_index",
    "proxy_cpu",
    "cuda_device",
];

/// A builder with every keyword of `settings` applied, or refusing the
/// first one that is unknown or whose value is refused.
pub(crate) fn builder(settings: Option<&Bound<'_, PyDict>>) -> Builder {
    // A value arx refuses is named by its keyword (the builder's method of
    // the same name).
    let mut b = Builder::default().names(|o| o.strip_prefix("Builder::").unwrap_or(o));
    let Some(settings) = settings else {
        return b;
    };
    for (k, v) in settings.iter() {
        let key: String = match k.extract() {
            Ok(s) => s,
            Err(_) => {
                return b.refuse(Error::InvalidArgument(format!(
                    "arx.Comm(): setting names are strings, got {}",
                    repr(&k)
                )))
            }
        };
        if v.is_none() {
            // None means "as if not given": the environment, then the default.
            continue;
        }
        match apply(b.clone(), &key, &v) {
            Ok(next) => b = next,
            Err(e) => return b.refuse(e),
        }
    }
    b
}

fn apply(b: Builder, key: &str, v: &Bound<'_, PyAny>) -> Result<Builder, Error> {
    Ok(match key {
        "device" => b.device(choice::<DeviceKind>("device", v)?),
        "fabric" => b.fabric(choice::<FabricKind>("fabric", v)?),
        "spin" => b.spin(choice::<SpinMode>("spin", v)?),
        "staging" => b.staging(choice::<Staging>("staging", v)?),
        "slot_bytes" => b.slot_bytes(bytes("slot_bytes", v)?),
        "timeout" => b.timeout(seconds("timeout", v)?),
        "init_timeout" => b.init_timeout(seconds("init_timeout", v)?),
        "stall_warn" => b.stall_warn(seconds("stall_warn", v)?),
        "devices" => b.devices(devices(v)?),
        "gid_index" => b.gid_index(integer("gid_index", v)?),
        "proxy_cpu" => b.proxy_cpu(integer("proxy_cpu", v)?),
        "cuda_device" => b.cuda_device(integer("cuda_device", v)?),
        other => {
            return Err(Error::InvalidArgument(format!(
                "arx.Comm() got an unknown setting '{other}'; the settings are: {}",
                KEYWORDS.join(", ")
            )))
        }
    })
}

fn repr(v: &Bound<'_, PyAny>) -> String {
    v.repr()
        .map_or_else(|_| "<unprintable>".into(), |r| r.to_string())
}

fn bad(name: &'static str, v: &Bound<'_, PyAny>, reason: &str) -> Error {
    Error::Config {
        name,
        value: repr(v),
        reason: reason.into(),
    }
}

/// A string choice, parsed by arx's own parser; its refusal names the
/// keyword instead of the environment variable.
fn choice<T>(name: &'static str, v: &Bound<'_, PyAny>) -> Result<T, Error>
where
    T: std::str::FromStr<Err = Error>,
{
    let s: String = v.extract().map_err(|_| bad(name, v, "expected a string"))?;
    s.parse::<T>().map_err(|e| match e {
        Error::Config { value, reason, .. } => Error::Config {
            name,
            value,
            reason,
        },
        e => e,
    })
}

/// A byte count: an integer, or a string with a K/M/G suffix ("64K").
fn bytes(name: &'static str, v: &Bound<'_, PyAny>) -> Result<usize, Error> {
    if v.is_instance_of::<PyString>() {
        let s: String = v.extract().map_err(|_| bad(name, v, "expected a string"))?;
        return arx::parse_bytes(name, &s);
    }
    integer(name, v)
}

/// A non-negative integer (not a bool, not a float).
fn integer<'py, T: pyo3::conversion::FromPyObjectOwned<'py>>(
    name: &'static str,
    v: &Bound<'py, PyAny>,
) -> Result<T, Error> {
    if v.is_instance_of::<pyo3::types::PyBool>() || !v.is_instance_of::<pyo3::types::PyInt>() {
        return Err(bad(name, v, "expected a non-negative integer"));
    }
    v.extract::<T>()
        .map_err(|_| bad(name, v, "expected a non-negative integer in range"))
}

/// Seconds (int or float), as `time.sleep` and `socket.settimeout` take them.
fn seconds(name: &'static str, v: &Bound<'_, PyAny>) -> Result<Duration, Error> {
    if v.is_instance_of::<pyo3::types::PyBool>() {
        return Err(bad(name, v, "expected seconds (a number)"));
    }
    let s: f64 = v
        .extract()
        .map_err(|_| bad(name, v, "expected seconds (a number)"))?;
    // The range itself is arx's (checked by the builder under
    // `Builder::<name>`); only what is no duration at all is refused here.
    Duration::try_from_secs_f64(s).map_err(|_| {
        bad(
            name,
            v,
            "expected a duration in seconds between 0.001 and 86400",
        )
    })
}

/// One or two RDMA device names: a list/tuple of strings or "a,b".
fn devices(v: &Bound<'_, PyAny>) -> Result<Vec<String>, Error> {
    let msg = "expected one or two RDMA device names, e.g. ['rocep1s0f0', 'roceP2p1s0f0']";
    if v.is_instance_of::<PyString>() {
        let s: String = v.extract().map_err(|_| bad("devices", v, msg))?;
        return Ok(s
            .split(',')
            .map(|d| d.trim().to_string())
            .filter(|d| !d.is_empty())
            .collect());
    }
    v.extract::<Vec<String>>()
        .map_err(|_| bad("devices", v, msg))
}
