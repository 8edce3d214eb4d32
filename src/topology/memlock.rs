//! RLIMIT_MEMLOCK: about how much RDMA registration locks, and a check whose
//! error says how to raise the limit (shell, containers, Slurm).

use crate::error::{Error, Result};

pub(super) fn human(b: u64) -> String {
    if b == u64::MAX {
        "unlimited".into()
    } else if b >= 1 << 30 {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    } else if b >= 1 << 20 {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{} KiB", b >> 10)
    }
}

pub(super) fn check_memlock_with(needed: usize, soft: u64, hard: u64) -> Result<()> {
    if soft == u64::MAX || soft >= needed as u64 {
        return Ok(());
    }
    Err(Error::Topology(format!(
        "RLIMIT_MEMLOCK is {} (hard {}), but RDMA registration needs {} locked: raise it \
         before starting the ranks, on every node: `memlock unlimited` for the user in \
         /etc/security/limits.conf (or limits.d; log in again: ranks started over ssh get \
         it too), `ulimit -l unlimited` in the launching shell (up to the hard limit; this \
         node only), `--ulimit memlock=-1` for containers (docker/podman); under Slurm, \
         which by default gives a job the submitting shell's limit, either that shell's \
         limit raised or PropagateResourceLimitsExcept=MEMLOCK in slurm.conf with slurmd \
         run under LimitMEMLOCK=infinity",
        human(soft),
        human(hard),
        human(needed as u64)
    )))
}

/// Locked bytes one instance registers, about: send\[2\]\[slot\] and
/// recv\[2\]\[world\]\[slot\], each slot rounded up to this kernel's page
/// as the layout does, plus a page-rounded control block and flags (an
/// estimate for reports; the fabric checks the real region size).
pub fn memlock_needed(slot_bytes: usize, world: usize) -> usize {
    let page = crate::layout::page_size().unwrap_or(crate::abi::ARX_SECTION_ALIGN as usize);
    memlock_needed_with(slot_bytes, world, page)
}

/// [`memlock_needed`] for a kernel whose page is `page` bytes.
fn memlock_needed_with(slot_bytes: usize, world: usize, page: usize) -> usize {
    let page = page.max(crate::abi::ARX_SECTION_ALIGN as usize);
    slot_bytes
        .div_ceil(page)
        .saturating_mul(page)
        .saturating_mul(2)
        .saturating_mul(world.saturating_add(1))
        // The control block and the flags: a page each, under 1 MiB for
        // every page size arm64 kernels use (4, 16, 64 KiB).
        .saturating_add(1 << 20)
}

/// Fails with an explanation when RLIMIT_MEMLOCK is below `needed` bytes.
pub fn check_memlock(needed: usize) -> Result<()> {
    let (soft, hard) = memlock_limits()?;
    check_memlock_with(needed, soft, hard)
}

/// This process's RLIMIT_MEMLOCK, `(soft, hard)` in bytes, `u64::MAX` for
/// unlimited (what [`check_memlock`] judges).
pub fn memlock_limits() -> Result<(u64, u64)> {
    memlock_limit().map_err(|e| Error::Os {
        call: "getrlimit(RLIMIT_MEMLOCK)",
        object: "this process".into(),
        detail: e,
    })
}

/// `getrlimit(RLIMIT_MEMLOCK)`: (soft, hard) in bytes, `u64::MAX` for
/// unlimited.
pub(super) fn memlock_limit() -> Result<(u64, u64), String> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid, writable rlimit for the duration of the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    // rlim_t is u64 on Linux targets, but not by definition.
    #[allow(clippy::unnecessary_cast)]
    let conv = |v: libc::rlim_t| {
        if v == libc::RLIM_INFINITY {
            u64::MAX
        } else {
            v as u64
        }
    };
    Ok((conv(r.rlim_cur), conv(r.rlim_max)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_estimate_rounds_slots_to_the_page() {
        // 8 KiB slots, 2 ranks: 6 slots of 8 KiB on a 4 KiB kernel, of
        // 64 KiB on a 64 KiB kernel (the layout rounds each slot up).
        assert_eq!(memlock_needed_with(8192, 2, 4096), 6 * 8192 + (1 << 20));
        assert_eq!(memlock_needed_with(8192, 2, 16384), 6 * 16384 + (1 << 20));
        assert_eq!(memlock_needed_with(8192, 2, 65536), 6 * 65536 + (1 << 20));
        // The estimate covers the real region at every page size.
        for page in [4096, 16384, 65536] {
            for (slot, world) in [(1, 2), (8192, 3), (1 << 20, 8), (65537, 16)] {
                let l = crate::layout::Layout::with_page(world, 0, slot, page).unwrap();
                assert!(
                    memlock_needed_with(slot, world, page) >= l.region_bytes(),
                    "slot {slot}, {world} ranks, page {page}"
                );
            }
        }
    }

    #[test]
    fn memlock_message_says_how_to_raise_it() {
        let e = check_memlock_with(64 << 20, 8 << 20, 8 << 20).unwrap_err();
        let m = e.to_string();
        for needle in [
            "8.0 MiB",
            "64.0 MiB",
            "ulimit -l unlimited",
            "--ulimit memlock=-1",
            "PropagateResourceLimitsExcept=MEMLOCK",
            "LimitMEMLOCK=infinity",
            "limits.conf",
        ] {
            assert!(m.contains(needle), "missing {needle:?} in {m}");
        }
        assert!(check_memlock_with(64 << 20, u64::MAX, u64::MAX).is_ok());
        assert!(check_memlock_with(64 << 20, 64 << 20, 64 << 20).is_ok());
        assert!(check_memlock(0).is_ok());
    }

    #[test]
    fn memlock_limit_reads() {
        let (soft, hard) = memlock_limit().unwrap();
        assert!(soft <= hard);
    }
}
