//! The IPv4 addresses of the netdevs, with their prefix lengths: what
//! per-peer routes match peers' RoCE v2 addresses against. sysfs does not
//! hold addresses, so the live system is read with `getifaddrs(3)`; a
//! fixture tree holds them in a file `ifaddrs` at its root, one
//! `<netdev> <a.b.c.d>/<prefix>` per line (the form `ip -o -4 addr` shows).

use std::net::Ipv4Addr;
use std::path::Path;

/// One IPv4 address of a netdev.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfAddr {
    /// The netdev (`enp1s0f0np0`).
    pub netdev: String,
    /// The address.
    pub addr: Ipv4Addr,
    /// Its prefix length (24 for a /24).
    pub prefix: u8,
}

/// The addresses of the system under `root`: `getifaddrs` for `/`, the
/// fixture file `ifaddrs` otherwise (absent: none).
pub(super) fn read(root: &Path) -> Vec<IfAddr> {
    if root == Path::new("/") {
        return live();
    }
    std::fs::read_to_string(root.join("ifaddrs"))
        .map(|s| parse(&s))
        .unwrap_or_default()
}

/// Parses `<netdev> <a.b.c.d>/<prefix>` lines; others are skipped.
pub(super) fn parse(text: &str) -> Vec<IfAddr> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let netdev = f.next()?.to_string();
            let (a, p) = f.next()?.split_once('/')?;
            Some(IfAddr {
                netdev,
                addr: a.parse().ok()?,
                prefix: p.parse().ok().filter(|&p: &u8| p <= 32)?,
            })
        })
        .collect()
}

/// The network of `addr` under a `prefix`-bit mask.
pub fn network(addr: Ipv4Addr, prefix: u8) -> Ipv4Addr {
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix.min(32)))
    };
    Ipv4Addr::from(u32::from(addr) & mask)
}

fn live() -> Vec<IfAddr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list it allocated, freed below
    // with freeifaddrs; on failure it returns -1 and leaves nothing to free.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        log::info!(
            "arx topology: getifaddrs failed ({}); per-peer routes cannot match subnets",
            std::io::Error::last_os_error()
        );
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the live list; its name is a C string
        // and its address/netmask, when non-null, point to sockaddrs of the
        // family the address names (AF_INET read as sockaddr_in).
        unsafe {
            let ifa = &*cur;
            let (a, m) = (ifa.ifa_addr, ifa.ifa_netmask);
            if !a.is_null()
                && !m.is_null()
                && i32::from((*a).sa_family) == libc::AF_INET
                && !ifa.ifa_name.is_null()
            {
                let addr = &*(a as *const libc::sockaddr_in);
                let mask = &*(m as *const libc::sockaddr_in);
                out.push(IfAddr {
                    netdev: std::ffi::CStr::from_ptr(ifa.ifa_name)
                        .to_string_lossy()
                        .into_owned(),
                    addr: Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
                    prefix: u32::from_be(mask.sin_addr.s_addr).count_ones() as u8,
                });
            }
            cur = ifa.ifa_next;
        }
    }
    // SAFETY: the list from the successful getifaddrs above, freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_fixture_form_and_masks() {
        let v = parse("enp1s0f0np0 10.0.0.10/24\nbad line\nlo 127.0.0.1/8\nx 1.2.3.4/33\n");
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].netdev, "enp1s0f0np0");
        assert_eq!(v[0].addr, Ipv4Addr::new(10, 0, 0, 10));
        assert_eq!(v[0].prefix, 24);
        assert_eq!(
            network(Ipv4Addr::new(10, 1, 2, 3), 24),
            Ipv4Addr::new(10, 1, 2, 0)
        );
        assert_eq!(
            network(Ipv4Addr::new(10, 1, 2, 3), 31),
            Ipv4Addr::new(10, 1, 2, 2)
        );
        assert_eq!(
            network(Ipv4Addr::new(10, 1, 2, 3), 0),
            Ipv4Addr::UNSPECIFIED
        );
    }

    #[test]
    fn the_live_system_has_loopback() {
        // Every Linux network namespace has lo; CI runs in one with 127.0.0.1.
        let v = live();
        assert!(
            v.iter().any(|a| a.addr.is_loopback() && a.prefix == 8),
            "{v:?}"
        );
    }
}
