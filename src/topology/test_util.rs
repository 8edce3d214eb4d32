//! Helpers shared by topology's unit tests: sysfs trees and hwloc XML under
//! `tests/fixtures/topology`, settings from given variables.

use std::path::{Path, PathBuf};

use super::{select_in, HwlocSource, LocalRank, Selection, ThreadCpus};
use crate::config::{Config, Overrides};
use crate::error::Result;

pub(super) fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/topology")
        .join(case)
}

pub(super) fn cfg_with(vars: &[(&str, &str)]) -> Config {
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Config::resolve_with(&Overrides::default(), move |k| {
        vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    })
    .unwrap()
}

pub(super) fn sel(case: &str, vars: &[(&str, &str)]) -> Result<Selection> {
    select_in(
        &fixture(case),
        HwlocSource::Off,
        &cfg_with(vars),
        &ThreadCpus::default(),
        &LocalRank::ALONE,
    )
}

pub(super) fn names(s: &Selection) -> Vec<&str> {
    s.lanes.iter().map(|l| l.name.as_str()).collect()
}

pub(super) fn has_note(s: &Selection, needle: &str) -> bool {
    s.notes.iter().any(|n| n.contains(needle))
}
