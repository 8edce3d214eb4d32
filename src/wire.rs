//! What ranks tell each other at start-up, in two records, each with its
//! byte encoding (little-endian, fixed layout, versioned; written and read
//! field by field with [`crate::codec`]) and validation:
//!
//! * [`Settings`], exchanged first, in one collective of fixed shape: the
//!   settings every rank must share, or why this rank's settings were
//!   refused. Everything start-up does afterwards (which collectives, in
//!   which order) follows from these shared settings and from data every
//!   rank receives alike, so every rank runs the same sequence.
//! * [`PeerInfo`]: who each rank is (host, pid) once the settings agree.

use crate::abi;
use crate::codec::{Reader, Writer};
use crate::config::{setting_name, Config, FabricKind};
use crate::error::{Error, Result};

/// Encoded size of a [`Settings`] record. Fixed for every version of arx:
/// it is the first collective of start-up, so that a rank running another
/// build is still named (by its magic or ABI version) instead of making
/// the collective itself mismatch.
pub const SETTINGS_BYTES: usize = 256;
/// Where the refusal message starts, and how long it may be.
const MESSAGE_AT: usize = 64;
const MESSAGE_BYTES: usize = SETTINGS_BYTES - MESSAGE_AT;

/// The settings a rank sends first, or its refusal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settings {
    magic: u32,
    abi_version: u32,
    world: u32,
    rank: u32,
    /// Why this rank's settings were refused (its own error, as text).
    refused: Option<String>,
    /// Setting codes that must be equal on every rank (zero when refused).
    device: u8,
    fabric: u8,
    staging: u8,
    /// The slot size as given; ranks compare it after rounding to the
    /// agreed page (`Layout::agreed`), not here.
    slot_bytes: u64,
    dtype_set: u32,
    /// `ARX_ALGO` ([`crate::Algo`]'s code): ranks that run different
    /// algorithms would fail at their first call where the choices differ
    /// (a size that depends on the job); agreed here instead.
    algo: u8,
}

impl Settings {
    /// This rank's record for `cfg` (or for its refusal).
    pub(crate) fn local(world: usize, rank: usize, cfg: &Result<Config>) -> Self {
        let mut s = Settings {
            magic: abi::ARX_MAGIC,
            abi_version: abi::ARX_ABI_VERSION,
            world: world as u32,
            rank: rank as u32,
            refused: None,
            device: 0,
            fabric: 0,
            staging: 0,
            slot_bytes: 0,
            dtype_set: DTYPE_SET,
            algo: 0,
        };
        match cfg {
            Ok(c) => {
                s.device = c.device.code();
                s.fabric = c.fabric.code();
                s.staging = c.staging.code();
                s.slot_bytes = c.slot_bytes as u64;
                s.algo = c.algo.code();
            }
            Err(e) => s.refused = Some(e.to_string()),
        }
        s
    }

    /// Exactly [`SETTINGS_BYTES`] bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let msg = self.refused.as_deref().unwrap_or("").as_bytes();
        let n = msg.len().min(MESSAGE_BYTES);
        Writer::with_capacity(SETTINGS_BYTES)
            .u32(self.magic)
            .u32(self.abi_version)
            .u32(SETTINGS_BYTES as u32)
            .u32(self.world)
            .u32(self.rank)
            .u8(u8::from(self.refused.is_some()))
            .u8(self.device)
            .u8(self.fabric)
            .u8(self.staging)
            .u64(self.slot_bytes)
            .u32(self.dtype_set)
            .u16(n as u16)
            .u8(self.algo)
            .pad_to(MESSAGE_AT)
            .bytes(&msg[..n])
            .pad_to(SETTINGS_BYTES)
            .finish()
    }

    /// Decodes rank `rank`'s record, checking its framing against rank 0's
    /// (`first`), so that every rank names the same odd rank.
    fn decode(rank: usize, b: &[u8], first: &[u8]) -> Result<Self> {
        let bad = |what: &'static str, theirs: String, ours: String| Error::Mismatch {
            what,
            rank,
            ours,
            theirs,
        };
        if b.len() != SETTINGS_BYTES || first.len() != SETTINGS_BYTES {
            return Err(bad(
                "settings record size (another arx build?)",
                b.len().to_string(),
                first.len().to_string(),
            ));
        }
        let (mut r, mut r0) = (Reader::new(b), Reader::new(first));
        let mut framing = [0u32; 3];
        for (field, what) in framing.iter_mut().zip([
            "magic (not an arx peer?)",
            "ABI version (another arx build?)",
            "settings record size (another arx build?)",
        ]) {
            let (theirs, ours) = (r.u32(), r0.u32());
            if theirs != ours {
                return Err(bad(what, theirs.to_string(), ours.to_string()));
            }
            *field = theirs;
        }
        let [magic, abi_version, _size] = framing;
        let (world, rank) = (r.u32(), r.u32());
        let [refused, device, fabric, staging] = r.array();
        let (slot_bytes, dtype_set) = (r.u64(), r.u32());
        let n = (r.u16() as usize).min(MESSAGE_BYTES);
        let [algo] = r.array();
        r.skip_to(MESSAGE_AT);
        let message = r.bytes(n);
        Ok(Settings {
            magic,
            abi_version,
            world,
            rank,
            refused: (refused != 0).then(|| String::from_utf8_lossy(message).into_owned()),
            device,
            fabric,
            staging,
            slot_bytes,
            dtype_set,
            algo,
        })
    }
}

/// Decides the outcome of the settings exchange, identically on every rank
/// (every rank holds the same `all`): this rank's own refusal, else the
/// first rank that refused ([`Error::PeerFailed`]), else the first rank
/// whose settings differ from rank 0's ([`Error::Mismatch`] naming the
/// rank and the setting's variable), else `local`'s settings.
pub(crate) fn agree_settings(local: Result<Config>, all: &[Vec<u8>]) -> Result<Config> {
    let cfg = local?;
    let first = all.first().map(Vec::as_slice).unwrap_or(&[]);
    let recs = all
        .iter()
        .enumerate()
        .map(|(r, b)| Settings::decode(r, b, first))
        .collect::<Result<Vec<_>>>()?;
    if let Some((peer, reason)) = recs
        .iter()
        .enumerate()
        .find_map(|(r, s)| s.refused.clone().map(|m| (r, m)))
    {
        return Err(Error::PeerFailed { peer, reason });
    }
    let r0 = &recs[0];
    for (r, s) in recs.iter().enumerate() {
        let bad = |what: &'static str, theirs: String, ours: String| Error::Mismatch {
            what,
            rank: r,
            ours,
            theirs,
        };
        if s.world as usize != all.len() {
            return Err(bad(
                "world size",
                s.world.to_string(),
                all.len().to_string(),
            ));
        }
        if s.rank as usize != r {
            return Err(bad("rank number", s.rank.to_string(), r.to_string()));
        }
        for (what, theirs, ours) in [
            ("ARX_DEVICE", s.device, r0.device),
            ("ARX_FABRIC", s.fabric, r0.fabric),
            ("ARX_STAGING", s.staging, r0.staging),
            ("ARX_ALGO", s.algo, r0.algo),
        ] {
            if theirs != ours {
                return Err(bad(
                    what,
                    setting_name(what, theirs),
                    setting_name(what, ours),
                ));
            }
        }
        // Slot sizes are compared once the page is agreed, after rounding
        // (`Layout::agreed`): 4000 and 4096 bytes make the same slots.
        if s.dtype_set != r0.dtype_set {
            return Err(bad(
                "dtype set (another arx build?)",
                format!("{:#b}", s.dtype_set),
                format!("{:#b}", r0.dtype_set),
            ));
        }
    }
    Ok(cfg)
}

/// Encoded size of a [`PeerInfo`].
pub const PEER_INFO_BYTES: usize = 128;
const HOST_BYTES: usize = 64;

/// The element types this build supports, as a bit set of `ARX_DTYPE_*`.
pub const DTYPE_SET: u32 =
    (1 << abi::ARX_DTYPE_BF16) | (1 << abi::ARX_DTYPE_F16) | (1 << abi::ARX_DTYPE_F32);

/// One rank's description of itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// `ARX_MAGIC`.
    pub magic: u32,
    /// `ARX_ABI_VERSION`.
    pub abi_version: u32,
    /// Communicator size as this rank sees it.
    pub world: u32,
    /// This rank.
    pub rank: u32,
    /// Slot size in bytes (after rounding).
    pub slot_bytes: u64,
    /// Supported dtypes (bit set).
    pub dtype_set: u32,
    /// Requested fabric.
    pub fabric: FabricKind,
    /// Resolved device side (1 host, 2 gpu); informational.
    pub device: u8,
    /// Process id, for messages.
    pub pid: u32,
    /// Host name (truncated to 64 bytes), to find ranks of one node.
    pub host: String,
}

impl PeerInfo {
    /// This build's info for `rank` of `world`.
    pub fn local(
        world: usize,
        rank: usize,
        slot_bytes: usize,
        fabric: FabricKind,
        device: u8,
    ) -> Self {
        let host = mpi::environment::processor_name().unwrap_or_else(|_| "unknown".into());
        PeerInfo {
            magic: abi::ARX_MAGIC,
            abi_version: abi::ARX_ABI_VERSION,
            world: world as u32,
            rank: rank as u32,
            slot_bytes: slot_bytes as u64,
            dtype_set: DTYPE_SET,
            fabric,
            device,
            pid: std::process::id(),
            host,
        }
    }

    /// Encodes to exactly 128 bytes (`PEER_INFO_BYTES`).
    pub fn encode(&self) -> Vec<u8> {
        let host = self.host.as_bytes();
        Writer::with_capacity(PEER_INFO_BYTES)
            .u32(self.magic)
            .u32(self.abi_version)
            .u32(self.world)
            .u32(self.rank)
            .u64(self.slot_bytes)
            .u32(self.dtype_set)
            .u8(self.fabric.code())
            .u8(self.device)
            .u16(0)
            .u32(self.pid)
            .bytes(&host[..host.len().min(HOST_BYTES)])
            .pad_to(PEER_INFO_BYTES)
            .finish()
    }

    /// Decodes and checks the framing (length, magic, ABI version) so that a
    /// rank running another build of arx is named clearly.
    pub fn decode(rank: usize, b: &[u8]) -> Result<Self> {
        let bad = |what: &'static str, theirs: String, ours: String| Error::Mismatch {
            what,
            rank,
            ours,
            theirs,
        };
        if b.len() != PEER_INFO_BYTES {
            return Err(bad(
                "PeerInfo size (another arx build?)",
                b.len().to_string(),
                PEER_INFO_BYTES.to_string(),
            ));
        }
        let mut r = Reader::new(b);
        let (magic, abi_version, world, rank) = (r.u32(), r.u32(), r.u32(), r.u32());
        let (slot_bytes, dtype_set) = (r.u64(), r.u32());
        let [fabric, device, _, _] = r.array();
        let pid = r.u32();
        let host_raw: [u8; HOST_BYTES] = r.array();
        if magic != abi::ARX_MAGIC {
            return Err(bad(
                "magic (not an arx peer?)",
                format!("{magic:#x}"),
                format!("{:#x}", abi::ARX_MAGIC),
            ));
        }
        if abi_version != abi::ARX_ABI_VERSION {
            return Err(bad(
                "ABI version",
                abi_version.to_string(),
                abi::ARX_ABI_VERSION.to_string(),
            ));
        }
        let fabric = FabricKind::from_code(fabric)
            .ok_or_else(|| bad("fabric code", fabric.to_string(), "0, 1 or 2".into()))?;
        let end = host_raw.iter().position(|&c| c == 0).unwrap_or(HOST_BYTES);
        Ok(PeerInfo {
            magic,
            abi_version,
            world,
            rank,
            slot_bytes,
            dtype_set,
            fabric,
            device,
            pid,
            host: String::from_utf8_lossy(&host_raw[..end]).into_owned(),
        })
    }
}

/// Decodes every rank's info and checks that all agree with rank 0 on what
/// they must share. Every rank runs this on the same data, so every rank
/// returns the same error.
pub fn validate(all: &[Vec<u8>]) -> Result<Vec<PeerInfo>> {
    let infos = all
        .iter()
        .enumerate()
        .map(|(r, b)| PeerInfo::decode(r, b))
        .collect::<Result<Vec<_>>>()?;
    let first = &infos[0];
    for (r, p) in infos.iter().enumerate() {
        let bad = |what: &'static str, theirs: String, ours: String| Error::Mismatch {
            what,
            rank: r,
            ours,
            theirs,
        };
        if p.world as usize != all.len() || p.world != first.world {
            return Err(bad(
                "world size",
                p.world.to_string(),
                all.len().to_string(),
            ));
        }
        if p.rank as usize != r {
            return Err(bad("rank number", p.rank.to_string(), r.to_string()));
        }
        if p.slot_bytes != first.slot_bytes {
            return Err(bad(
                "slot size (ARX_SLOT_BYTES)",
                p.slot_bytes.to_string(),
                first.slot_bytes.to_string(),
            ));
        }
        if p.dtype_set != first.dtype_set {
            return Err(bad(
                "dtype set",
                format!("{:#b}", p.dtype_set),
                format!("{:#b}", first.dtype_set),
            ));
        }
        if p.fabric != first.fabric {
            return Err(bad(
                "fabric (ARX_FABRIC)",
                format!("{:?}", p.fabric),
                format!("{:?}", first.fabric),
            ));
        }
    }
    Ok(infos)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(rank: usize) -> PeerInfo {
        PeerInfo {
            magic: abi::ARX_MAGIC,
            abi_version: abi::ARX_ABI_VERSION,
            world: 3,
            rank: rank as u32,
            slot_bytes: 1 << 20,
            dtype_set: DTYPE_SET,
            fabric: FabricKind::Auto,
            device: 1,
            pid: 4242 + rank as u32,
            host: format!("spark-{rank}"),
        }
    }

    fn all(f: impl Fn(usize, &mut PeerInfo)) -> Vec<Vec<u8>> {
        (0..3)
            .map(|r| {
                let mut p = info(r);
                f(r, &mut p);
                p.encode()
            })
            .collect()
    }

    #[test]
    fn round_trip() {
        for r in 0..3 {
            let p = info(r);
            let b = p.encode();
            assert_eq!(b.len(), PEER_INFO_BYTES);
            assert_eq!(PeerInfo::decode(r, &b).unwrap(), p);
        }
        let mut long = info(0);
        long.host = "h".repeat(200);
        assert_eq!(PeerInfo::decode(0, &long.encode()).unwrap().host.len(), 64);
    }

    #[test]
    fn agreeing_ranks_validate() {
        let v = validate(&all(|_, _| {})).unwrap();
        assert_eq!(v.len(), 3);
        assert_eq!(v[2].host, "spark-2");
    }

    /// Changes `rank`'s info with `f` and expects a mismatch naming `what`
    /// and that rank.
    fn rejected(rank: usize, f: impl Fn(&mut PeerInfo), what: &str) {
        let infos = all(|r, p| {
            if r == rank {
                f(p)
            }
        });
        match validate(&infos) {
            Err(Error::Mismatch {
                what: w, rank: r, ..
            }) => {
                assert!(w.contains(what), "{w} does not name {what}");
                assert_eq!(r, rank);
            }
            other => panic!("expected a mismatch on {what}, got {other:?}"),
        }
    }

    #[test]
    fn every_disagreement_is_named() {
        rejected(2, |p| p.magic ^= 1, "magic");
        rejected(1, |p| p.abi_version += 1, "ABI version");
        rejected(1, |p| p.world = 4, "world size");
        rejected(2, |p| p.rank = 0, "rank number");
        rejected(2, |p| p.slot_bytes = 4096, "slot size");
        rejected(1, |p| p.dtype_set = 1 << abi::ARX_DTYPE_F32, "dtype set");
        rejected(1, |p| p.fabric = FabricKind::Verbs, "fabric");
    }

    fn settings(world: usize, f: impl Fn(usize, &mut Config)) -> Vec<Vec<u8>> {
        (0..world)
            .map(|r| {
                let mut c = Config::resolve_with(&Default::default(), |_| None).unwrap();
                f(r, &mut c);
                Settings::local(world, r, &Ok(c)).encode()
            })
            .collect()
    }

    fn ok_config() -> Result<Config> {
        Config::resolve_with(&Default::default(), |_| None)
    }

    #[test]
    fn settings_record_has_one_size() {
        let cfg = ok_config();
        assert_eq!(Settings::local(3, 1, &cfg).encode().len(), SETTINGS_BYTES);
        let refused = Err(Error::InvalidArgument("é".repeat(500)));
        let b = Settings::local(3, 1, &refused).encode();
        assert_eq!(b.len(), SETTINGS_BYTES);
        let s = Settings::decode(1, &b, &b).unwrap();
        assert!(s.refused.unwrap().starts_with("invalid argument: é"));
    }

    /// Expects the decision to name `what`, `rank` and both values.
    fn mismatch(all: &[Vec<u8>], what: &str, rank: usize, ours: &str, theirs: &str) {
        match agree_settings(ok_config(), all) {
            Err(Error::Mismatch {
                what: w,
                rank: r,
                ours: o,
                theirs: t,
            }) => assert_eq!((w, r, o.as_str(), t.as_str()), (what, rank, ours, theirs)),
            other => panic!("{what}: expected a mismatch, got {other:?}"),
        }
    }

    /// Every rank decides the same: the first odd rank, the variable's name,
    /// both values.
    #[test]
    fn settings_mismatches_name_rank_and_variable() {
        use crate::config::{DeviceKind, Staging};
        let odd = |rank: usize, f: fn(&mut Config)| {
            settings(4, move |r, c| {
                if r == rank {
                    f(c)
                }
            })
        };
        mismatch(
            &odd(2, |c| c.device = DeviceKind::Gpu),
            "ARX_DEVICE",
            2,
            "auto",
            "gpu",
        );
        mismatch(
            &odd(1, |c| c.device = DeviceKind::Host),
            "ARX_DEVICE",
            1,
            "auto",
            "host",
        );
        let later = settings(3, |r, c| {
            if r >= 1 {
                c.device = DeviceKind::Host
            }
        });
        mismatch(&later, "ARX_DEVICE", 1, "auto", "host");
        mismatch(
            &odd(1, |c| c.staging = Staging::CopyEngine),
            "ARX_STAGING",
            1,
            "sm",
            "copy",
        );
        mismatch(
            &odd(3, |c| c.fabric = FabricKind::Verbs),
            "ARX_FABRIC",
            3,
            "auto",
            "verbs",
        );
        mismatch(
            &odd(2, |c| c.algo = crate::Algo::TwoShot),
            "ARX_ALGO",
            2,
            "auto",
            "twoshot",
        );
        mismatch(
            &settings(3, |r, c| {
                c.algo = if r == 0 {
                    crate::Algo::OneShot
                } else {
                    crate::Algo::Auto
                }
            }),
            "ARX_ALGO",
            1,
            "oneshot",
            "auto",
        );
        assert!(agree_settings(ok_config(), &settings(3, |_, _| {})).is_ok());
        // Slot sizes are left to `Layout::agreed`, which compares them
        // rounded to the agreed page.
        assert!(agree_settings(ok_config(), &odd(1, |c| c.slot_bytes = 4000)).is_ok());
    }

    #[test]
    fn a_refusal_is_named_on_every_other_rank() {
        let mut all = settings(4, |_, _| {});
        let e = Error::Config {
            name: "ARX_SLOT_BYTES",
            value: "12Q".into(),
            reason: "r".into(),
        };
        all[2] = Settings::local(4, 2, &Err(e.clone())).encode();
        all[3] = Settings::local(4, 3, &Err(e.clone())).encode();
        match agree_settings(ok_config(), &all) {
            Err(Error::PeerFailed { peer: 2, reason }) => assert!(reason.contains("12Q")),
            other => panic!("expected rank 2 named, got {other:?}"),
        }
        // The refusing ranks return their own error.
        assert!(matches!(
            agree_settings(Err(e), &all),
            Err(Error::Config {
                name: "ARX_SLOT_BYTES",
                ..
            })
        ));
    }

    #[test]
    fn another_build_is_named() {
        let mut all = settings(3, |_, _| {});
        all[1][4] ^= 1; // ABI version
        assert!(matches!(
            agree_settings(ok_config(), &all),
            Err(Error::Mismatch { rank: 1, what, .. }) if what.starts_with("ABI version")
        ));
        let mut all = settings(3, |_, _| {});
        all[2][0] ^= 1;
        assert!(matches!(
            agree_settings(ok_config(), &all),
            Err(Error::Mismatch { rank: 2, what, .. }) if what.starts_with("magic")
        ));
        let mut all = settings(3, |_, _| {});
        all[1].truncate(100);
        assert!(matches!(
            agree_settings(ok_config(), &all),
            Err(Error::Mismatch { rank: 1, .. })
        ));
    }

    /// Hex of `b`, for the golden encodings below.
    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// The records' byte layout is the wire format between builds of one ABI
    /// version: pinned here (the hex came from the encoders before the shared
    /// codec), with this build's magic and ABI version spliced in.
    fn golden(tail: &str) -> String {
        let mut h = hex(&abi::ARX_MAGIC.to_le_bytes());
        h += &hex(&abi::ARX_ABI_VERSION.to_le_bytes());
        h + tail
    }

    #[test]
    fn peer_info_layout_is_pinned() {
        let mut p = info(2);
        p.host = "node-x".into();
        p.fabric = FabricKind::Verbs;
        p.slot_bytes = 0x0102_0304_0506_0708;
        p.device = 2;
        let want = golden(
            &["03000000", "02000000", "0807060504030201", "0e000000", "02", "02", "0000"]
                .concat(),
        ) + "94100000" // pid
            + "6e6f64652d78"
            + &"00".repeat(PEER_INFO_BYTES - 42);
        assert_eq!(hex(&p.encode()), want);
    }

    #[test]
    fn settings_layout_is_pinned() {
        let s = Settings {
            magic: abi::ARX_MAGIC,
            abi_version: abi::ARX_ABI_VERSION,
            world: 5,
            rank: 3,
            refused: Some("no".into()),
            device: 1,
            fabric: 2,
            staging: 3,
            slot_bytes: 0x1122_3344_5566_7788,
            dtype_set: DTYPE_SET,
            algo: 2,
        };
        let want = golden(
            &[
                "00010000",
                "05000000",
                "03000000",
                "01010203",
                "8877665544332211",
                "0e000000",
                "0200",
                "02",
            ]
            .concat(),
        ) + &"00".repeat(MESSAGE_AT - 39)
            + "6e6f"
            + &"00".repeat(SETTINGS_BYTES - MESSAGE_AT - 2);
        assert_eq!(hex(&s.encode()), want);
    }

    #[test]
    fn short_and_foreign_buffers_are_rejected() {
        let mut v = all(|_, _| {});
        v[1].truncate(100);
        assert!(matches!(validate(&v), Err(Error::Mismatch { rank: 1, .. })));
        let mut v = all(|_, _| {});
        v[2][28] = 9;
        assert!(matches!(validate(&v), Err(Error::Mismatch { rank: 2, .. })));
    }
}
