//! GID choice: each lane device's RoCE v2 GID, resolved from that device's
//! own GID table (RoCE v2, IPv4-mapped, on the device's own netdev; VLAN and
//! other upper devices skipped), or taken from `ARX_GID_INDEX`.

use std::fmt::Write as _;

use super::{DeviceInfo, GidEntry, PortInfo, WARN};
use crate::config::Config;
use crate::error::{Error, Result};

/// Resolves the GID of `d`'s port `port`, per device.
pub(super) fn resolve_gid(
    d: &DeviceInfo,
    port: &PortInfo,
    cfg: &Config,
    notes: &mut Vec<String>,
) -> Result<(GidEntry, String)> {
    let own = |e: &GidEntry| e.ndev.as_ref().is_some_and(|n| d.netdevs.contains(n));
    if let Some(ix) = cfg.gid_index {
        let Some(e) = port.gids.iter().find(|e| e.index == ix) else {
            return Err(Error::Topology(format!(
                "ARX_GID_INDEX={ix}, but {} port {} has no readable GID at index {ix} \
                 (readable: {}); unset ARX_GID_INDEX to resolve it per device, or pick one \
                 from `show_gids`",
                d.name,
                port.port,
                port.gids
                    .iter()
                    .map(|e| e.index.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        };
        notes.push(format!(
            "{}: GID index {ix} from ARX_GID_INDEX (override)",
            d.name
        ));
        if !(e.is_roce_v2() && e.is_ipv4_mapped() && own(e)) {
            notes.push(format!(
                "{WARN}{}: ARX_GID_INDEX={ix} is {} {} on {}, not a RoCE v2 IPv4 GID on {}",
                d.name,
                e.kind.as_deref().unwrap_or("of unknown type"),
                format_gid(&e.gid),
                e.ndev.as_deref().unwrap_or("?"),
                d.netdevs.join("/")
            ));
        }
        let nd = e
            .ndev
            .clone()
            .or_else(|| d.netdevs.first().cloned())
            .unwrap_or_default();
        return Ok((e.clone(), nd));
    }
    let mut skipped = Vec::new();
    for e in &port.gids {
        if !e.is_roce_v2() {
            continue;
        }
        if !e.is_ipv4_mapped() {
            continue;
        }
        if !own(e) {
            skipped.push(format!(
                "index {} on {} (not the device's own netdev)",
                e.index,
                e.ndev.as_deref().unwrap_or("an unreadable netdev")
            ));
            continue;
        }
        if !skipped.is_empty() {
            notes.push(format!("{}: skipped GID {}", d.name, skipped.join(", ")));
        }
        let nd = e.ndev.clone().unwrap_or_default();
        notes.push(format!(
            "{}: GID index {} = {} (RoCE v2, IPv4-mapped, on {})",
            d.name,
            e.index,
            format_gid(&e.gid),
            nd
        ));
        return Ok((e.clone(), nd));
    }
    let table = if port.gids.is_empty() {
        "no readable GIDs".to_string()
    } else {
        port.gids
            .iter()
            .map(|e| {
                format!(
                    "{}: {} {} on {}",
                    e.index,
                    e.kind.as_deref().unwrap_or("?"),
                    format_gid(&e.gid),
                    e.ndev.as_deref().unwrap_or("?")
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    Err(Error::Topology(format!(
        "{} port {}: no RoCE v2 IPv4-mapped GID on its own netdev {} (found {table}). \
         Give {} an IPv4 address (ip addr add <a.b.c.d/nn> dev {}; netplan apply), \
         or set ARX_GID_INDEX",
        d.name,
        port.port,
        if d.netdevs.is_empty() {
            "(none found)".to_string()
        } else {
            d.netdevs.join("/")
        },
        d.netdevs
            .first()
            .map(String::as_str)
            .unwrap_or("the netdev"),
        d.netdevs.first().map(String::as_str).unwrap_or("<netdev>"),
    )))
}

/// Whether `lane`'s GID is still what start-up resolved, read again from
/// the sysfs tree under `root` (`/` for the live system) the same way: after
/// a link flap or a netplan re-apply the IPv4 RoCE v2 GID can move to
/// another index or change address (FACTS.md), and a QP built on the old one
/// fails. None when it is unchanged; otherwise what changed, for the error
/// of the failed QP.
pub fn gid_drift(root: &std::path::Path, lane: &super::LaneDevice, cfg: &Config) -> Option<String> {
    let d = super::sysfs::read_device(root, &lane.name);
    let then = format!(
        "GID[{}] {} on {}",
        lane.gid_index,
        format_gid(&lane.gid),
        lane.netdev
    );
    let Some(port) = d.ports.iter().find(|p| p.port == lane.port) else {
        return Some(format!(
            "{} port {} is gone from sysfs (it had {then} at start-up)",
            lane.name, lane.port
        ));
    };
    match resolve_gid(&d, port, cfg, &mut Vec::new()) {
        Ok((g, _)) if g.index == lane.gid_index && g.gid == lane.gid => None,
        Ok((g, nd)) => Some(format!(
            "{}'s RoCE v2 GID changed since start-up: {then} then, GID[{}] {} on {nd} now              (a link flap or netplan re-apply?); restart the job so that every rank              resolves it again",
            lane.name,
            g.index,
            format_gid(&g.gid)
        )),
        Err(e) => Some(format!(
            "{} no longer has the GID it had at start-up ({then}): {e}",
            lane.name
        )),
    }
}

/// Formats a GID as sysfs does, with an IPv4 suffix when IPv4-mapped.
pub fn format_gid(g: &[u8; 16]) -> String {
    let mut s = String::new();
    for i in 0..8 {
        if i > 0 {
            s.push(':');
        }
        let _ = write!(s, "{:02x}{:02x}", g[2 * i], g[2 * i + 1]);
    }
    let e = GidEntry {
        index: 0,
        gid: *g,
        kind: None,
        ndev: None,
    };
    if e.is_ipv4_mapped() {
        let _ = write!(s, " ({}.{}.{}.{})", g[12], g[13], g[14], g[15]);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::test_util::{has_note, names, sel};

    #[test]
    fn missing_rocev2_gid_is_a_clear_error() {
        let e = sel("no_rocev2", &[]).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, Error::Topology(_)), "{e:?}");
        for needle in [
            "rocep1s0f0",
            "no RoCE v2 IPv4-mapped GID",
            "enp1s0f0np0",
            "ip addr add",
            "ARX_GID_INDEX",
            "2: IB/RoCE v1",
        ] {
            assert!(m.contains(needle), "missing {needle:?} in {m}");
        }
    }

    #[test]
    fn gid_index_is_resolved_per_device() {
        let s = sel("spark_gid_3_and_4", &[]).unwrap();
        assert_eq!(names(&s), ["rocep1s0f0", "roceP2p1s0f0"]);
        assert_eq!(s.lanes[0].gid_index, 3);
        assert_eq!(s.lanes[1].gid_index, 4);
        assert_eq!(s.lanes[1].gid[12..], [10, 0, 2, 10]);
    }

    #[test]
    fn vlan_ipv6_and_unreadable_gids_are_skipped() {
        let s = sel("spark_vlan", &[]).unwrap();
        assert_eq!(s.lanes[0].gid_index, 8);
        assert_eq!(s.lanes[0].netdev, "enp1s0f0np0");
        assert_eq!(s.lanes[0].gid[12..], [10, 0, 0, 10]);
        assert_eq!(s.lanes[1].gid_index, 3);
        assert!(has_note(&s, "enp1s0f0np0.100"), "{:#?}", s.notes);
    }

    #[test]
    fn arx_gid_index_override_is_honoured() {
        let s = sel("spark_both", &[("ARX_GID_INDEX", "2")]).unwrap();
        assert!(s.lanes.iter().all(|l| l.gid_index == 2));
        assert!(has_note(&s, "ARX_GID_INDEX"));
        // Index 2 is RoCE v1 here: honoured, with a warning.
        assert!(s.warnings().any(|n| n.contains("not a RoCE v2 IPv4 GID")));

        let e = sel("spark_both", &[("ARX_GID_INDEX", "5")]).unwrap_err();
        assert!(e.to_string().contains("no readable GID at index 5"), "{e}");
    }
}
