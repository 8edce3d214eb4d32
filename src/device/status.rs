//! The one place where a failed call is recorded and translated.
//!
//! Both device sides record the first failure of an instance the same way:
//! `ctrl.status` (an `ARX_STATUS_*` code, first one wins) with the details in
//! `err_peer`, `err_lane`, `err_seq` and `err_flag` — the kernel in
//! `kernels/device.cuh` (`arx_fail`), the host side through [`record`].
//! [`error`] turns what was recorded into an [`Error`] for either side.
//!
//! Conventions for `err_peer`/`err_lane`: a peer and lane whose flag was
//! missing or wrong; `err_peer` = this rank with `err_lane` = `u32::MAX`:
//! this rank's own sends (or staging) did not finish.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::abi;
use crate::dtype::CallDesc;
use crate::error::Error;
use crate::layout::{flag_seq, peer_flags, Layout, Region};
use crate::protocol::{self, Recorded};
use crate::proxy::Link;

/// Records a failure unless one was recorded before (the first one stays).
pub(crate) fn record(region: &Region, code: u32, peer: u32, lane: u32, seq: u64, flag: u64) {
    protocol::record(region, code, peer, lane, seq, flag);
}

/// The error recorded in the control block, if any.
pub(crate) fn error(region: &Region, layout: &Layout, link: &Link) -> Option<Error> {
    let ctrl = region.ctrl();
    let Recorded {
        code: status,
        peer,
        lane,
        seq,
        flag,
    } = protocol::recorded(region)?;
    let me = layout.rank();
    let own = lane == u32::MAX && peer as usize == me;
    Some(match status {
        abi::ARX_STATUS_MISMATCH => {
            // Relaxed: written by this rank's own device side before it
            // recorded the failure (same thread, or the kernel before the
            // synchronize that precedes this read).
            let ours = ctrl.meta((seq & 1) as usize).load(Ordering::Relaxed);
            Error::CallMismatch {
                seq,
                rank: me,
                ours: CallDesc::of_flag(ours),
                peer: peer as usize,
                theirs: CallDesc::of_flag(flag),
            }
        }
        abi::ARX_STATUS_ABORTED => link.error().unwrap_or_else(|| Error::Kernel {
            seq,
            detail: format!("rank {me}: aborted (abort word set) while waiting"),
        }),
        abi::ARX_STATUS_TIMEOUT => {
            // Relaxed: written once at start-up, before any thread or kernel
            // that reads it was started.
            let waited = Duration::from_nanos(ctrl.timeout_ns().load(Ordering::Relaxed));
            if own {
                Error::Timeout {
                    during: "a call (waiting for this rank's own sends)",
                    waited,
                    detail: format!(
                        "rank {me}, call {seq}: its own proxy reports sends complete only up to call {} \
                         (or the staging did not finish); the local NIC has not completed them \
                         (are the peers' NICs acknowledging?){}",
                        protocol::sent_through(region),
                        own_wait(flag)
                    ),
                }
            } else {
                let what = if lane == u32::MAX {
                    "no flag was missing when the deadline passed".to_string()
                } else if flag_seq(flag) == seq as u32 {
                    // (The host side looks once more after the deadline.)
                    format!(
                        "peer {peer} lane {lane} had not arrived when the deadline passed (it \
                         arrived just after)"
                    )
                } else {
                    format!(
                        "peer {peer} lane {lane} had not arrived when the deadline passed (its \
                         flag there: call {})",
                        flag_seq(flag)
                    )
                };
                // Relaxed: as for the mismatch above.
                let ours = ctrl.meta((seq & 1) as usize).load(Ordering::Relaxed);
                Error::Timeout {
                    during: "a call (waiting for peers' flags)",
                    waited,
                    detail: format!(
                        "rank {me}, call {seq}, {}: {what}; all flags now: {}",
                        CallDesc::of_flag(ours),
                        peer_flags(region, layout, seq)
                    ),
                }
            }
        }
        abi::ARX_STATUS_INTERNAL => Error::Kernel {
            seq,
            detail: format!(
                "rank {me}: a device-side wait failed with no cause recorded: an internal \
                 invariant of arx broke (a bug; please report it with this message and \
                 ARX_LOG=debug output); the output was filled with NaN"
            ),
        },
        other => Error::Kernel {
            seq,
            detail: format!("rank {me}: unknown status {other} in the control block"),
        },
    })
}

/// What a GPU block waiting for its own part saw at the deadline
/// (`kernels/oneshot.cuh`, `wait_peers`: the flag field of an own-part
/// failure; 0 from the host side and the copy-engine wait, which say
/// nothing more).
fn own_wait(flag: u64) -> String {
    if flag == 0 {
        return String::new();
    }
    let f = |shift: u32| (flag >> shift) & 0xFFFF;
    format!(
        "; the waiting GPU block saw its own counter at {} of {}, ready_seq ...{:04x}, \
         poller ...{:04x} (low 16 bits of the calls), and {} polling",
        f(0),
        f(16),
        f(32),
        f(48) & 0x7FFF,
        if flag >> 63 != 0 { "was" } else { "was not" }
    )
}

#[cfg(test)]
mod tests {
    use super::{error, own_wait, record};
    use std::time::Duration;

    use crate::abi;
    use crate::config::Overrides;
    use crate::error::Error;
    use crate::fabric::fake::proxy_rig;

    /// What `error` makes of `code` recorded for call 7 by rank 0 of 2.
    fn recorded_as(code: u32, peer: u32, lane: u32) -> Option<Error> {
        let o = Overrides {
            timeout: Some(Duration::from_millis(250)),
            ..Default::default()
        };
        let (region, layout, _cfg, _control, proxy) = proxy_rig(64 << 10, &o);
        assert!(
            error(&region, &layout, &proxy.link()).is_none(),
            "nothing recorded yet"
        );
        record(&region, code, peer, lane, 7, 0);
        error(&region, &layout, &proxy.link())
    }

    #[test]
    fn every_recorded_code_becomes_an_error_that_names_it() {
        // The kernel's invariant check (kernels/oneshot.cuh, end of
        // wait_peers): said as a broken invariant, not as an unknown code.
        match recorded_as(abi::ARX_STATUS_INTERNAL, 0, abi::ARX_LANE_INTERNAL) {
            Some(Error::Kernel { seq: 7, detail }) => {
                assert!(detail.contains("invariant"), "{detail}");
                assert!(detail.contains("rank 0"), "{detail}");
                assert!(!detail.contains("unknown status"), "{detail}");
            }
            other => panic!("INTERNAL gave {other:?}"),
        }
        match recorded_as(abi::ARX_STATUS_TIMEOUT, 1, 0) {
            Some(Error::Timeout { detail, .. }) => {
                assert!(detail.contains("peer 1 lane 0"), "{detail}")
            }
            other => panic!("TIMEOUT gave {other:?}"),
        }
        match recorded_as(99, 1, 0) {
            Some(Error::Kernel { detail, .. }) => {
                assert!(detail.contains("unknown status 99"), "{detail}")
            }
            other => panic!("99 gave {other:?}"),
        }
    }

    #[test]
    fn own_wait_decodes_the_kernels_fields() {
        assert_eq!(own_wait(0), "");
        // Counter 3 of 11, ready_seq ...1235, poller ...1236, polling
        // (kernels/oneshot.cuh, wait_peers).
        let f = 3 | (11 << 16) | (0x1235u64 << 32) | (0x1236u64 << 48) | (1u64 << 63);
        let s = own_wait(f);
        assert!(s.contains("own counter at 3 of 11"), "{s}");
        assert!(s.contains("ready_seq ...1235"), "{s}");
        assert!(s.contains("poller ...1236"), "{s}");
        assert!(s.contains("and was polling"), "{s}");
        assert!(own_wait(f & !(1u64 << 63)).contains("was not polling"));
    }
}
