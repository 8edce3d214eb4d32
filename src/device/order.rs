//! Orders the GPU calls of one instance whatever streams the caller uses.
//!
//! Every launch of an instance uses the same device state (the call counter
//! and the tickets of `arx_gpu_state_t`) and the same send slots, so two of
//! its kernels must never run at the same time: on two streams with no
//! dependency, on parallel branches of a CUDA graph, or a graph replay on
//! one stream next to an eager call on another, they would take the same
//! seq and mix their tickets (a silent wrong sum). Calls are ordered the way
//! MPI orders collectives: in the order the host issues them.
//!
//! How: an event `last` is recorded after every launch, and every launch
//! first makes its stream wait for `last`.
//! * Eager launches use plain `cuStreamWaitEvent` / `cuEventRecord`.
//! * A launch captured into a graph waits with `CU_EVENT_WAIT_EXTERNAL` and
//!   records with `CU_EVENT_RECORD_EXTERNAL`: the graph then holds an event
//!   wait node and an event record node, so each replay waits for whatever
//!   arx launch was last recorded when the replay was launched, and the
//!   launches after the replay wait for it.
//! * Inside one capture, a launch after another launch of the same capture
//!   (also on a forked stream) waits on a per-capture event with an ordinary,
//!   internal wait: an edge in the graph from the previous launch. An external
//!   wait would not do there: it is resolved when the whole graph is
//!   launched, so two calls of one graph would run concurrently.
//!
//! * A captured launch's external record node is kept off the path of what
//!   follows it: the record depends on the launch (and on the capture's
//!   previous record, so the last record of a replay follows every launch
//!   of it), and the stream's dependency set goes back to the launch alone
//!   (`cuStreamUpdateCaptureDependencies`), so the next launch, and the
//!   caller's own work after the call, wait for the kernel, not for the
//!   record (0.6 µs per captured call on an H200, docs/GPU.md). The
//!   per-capture event is recorded after that, at the launch.
//!
//! Cost: one event record (and, when the stream changes or a graph may have
//! run in between, one wait) per eager call; per captured call, an event
//! record node beside the launch (and an event wait node before the first
//! launch of a capture).

use cudarc::driver::sys;

use crate::error::{Error, Result};

/// Capture ids whose last launch is remembered (captures in progress at the
/// same time on this instance; more than this is unusual).
const CAPTURES: usize = 16;

fn cu(call: &'static str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(|e| Error::Cuda {
        call,
        detail: e.to_string(),
    })
}

fn new_event() -> Result<sys::CUevent> {
    let mut e: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: `e` is a valid out-pointer; the context is bound by the caller.
    cu("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut e, flags)
    })?;
    Ok(e)
}

/// Checks that the driver exports the entry points used here (cudarc's
/// loader would panic on a missing one).
pub(crate) fn probe() -> Result<()> {
    for name in [
        c"cuStreamGetCaptureInfo_v3",
        c"cuStreamUpdateCaptureDependencies_v2",
        c"cuEventRecordWithFlags",
        c"cuStreamWaitEvent",
    ] {
        // SAFETY: dlopen with RTLD_NOLOAD only looks up a library that is
        // already loaded (cudarc loaded libcuda before this is called);
        // dlsym reads its symbol table.
        let found = unsafe {
            let h = libc::dlopen(
                c"libcuda.so.1".as_ptr(),
                libc::RTLD_LAZY | libc::RTLD_NOLOAD,
            );
            let h = if h.is_null() {
                libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD)
            } else {
                h
            };
            if h.is_null() {
                // Loaded under another name: let the calls themselves tell.
                return Ok(());
            }
            let f = !libc::dlsym(h, name.as_ptr()).is_null();
            libc::dlclose(h);
            f
        };
        if !found {
            return Err(Error::Unavailable {
                what: "the GPU device side",
                reason: format!(
                    "the NVIDIA driver lacks {} (CUDA 12.3 or newer is needed)",
                    name.to_string_lossy()
                ),
            });
        }
    }
    Ok(())
}

/// Whether a stream is being captured, and into which capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Capture {
    /// Eager: work runs when enqueued.
    None,
    /// Captured into the capture sequence with this id.
    Active(u64),
}

/// Capture status of `stream`.
pub(crate) fn capture_of(stream: sys::CUstream) -> Result<Capture> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    // SAFETY: valid out-pointers for status and id; the optional outputs are
    // NULL, which the driver allows.
    cu("cuStreamGetCaptureInfo", unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            &mut id,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    })?;
    match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(Capture::None),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(Capture::Active(id)),
        _ => Err(Error::InvalidArgument(
            "the stream's capture was invalidated (an earlier error in this capture); end the capture and start again".into(),
        )),
    }
}

/// The dependency set of a capturing stream: the nodes (and edge data)
/// its next captured work will depend on, copied out of the driver's
/// arrays (valid only until the next capture call).
struct Frontier {
    nodes: Vec<sys::CUgraphNode>,
    edges: Option<Vec<sys::CUgraphEdgeData>>,
}

fn frontier(stream: sys::CUstream) -> Result<Frontier> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut nodes: *const sys::CUgraphNode = std::ptr::null();
    let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
    let mut n: usize = 0;
    // SAFETY: valid out-pointers; the driver's arrays are read below,
    // before any other capture call on this stream.
    cu("cuStreamGetCaptureInfo", unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut nodes,
            &mut edges,
            &mut n,
        )
    })?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
        return Err(Error::InvalidArgument(
            "the stream's capture was invalidated (an earlier error in this capture); end the capture and start again".into(),
        ));
    }
    fn copy<T: Copy>(p: *const T, n: usize) -> Option<Vec<T>> {
        if p.is_null() || n == 0 {
            None
        } else {
            // SAFETY: the driver returned `n` elements at `p`, valid until
            // the next capture call on this stream (none in between).
            Some(unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
        }
    }
    Ok(Frontier {
        nodes: copy(nodes, n).unwrap_or_default(),
        edges: copy(edges, n),
    })
}

/// Replaces (`set`) or extends a capturing stream's dependency set.
fn depend(stream: sys::CUstream, f: &Frontier, set: bool) -> Result<()> {
    let flag = if set {
        sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES
    } else {
        sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_ADD_CAPTURE_DEPENDENCIES
    };
    let mut nodes = f.nodes.clone();
    let edges = f.edges.as_ref().map_or(std::ptr::null(), |e| e.as_ptr());
    // SAFETY: `nodes` (and `edges`, when given) hold `nodes.len()` entries
    // of this stream's capture graph; the driver copies them.
    cu("cuStreamUpdateCaptureDependencies", unsafe {
        sys::cuStreamUpdateCaptureDependencies_v2(
            stream,
            nodes.as_mut_ptr(),
            edges,
            nodes.len(),
            flag as u32,
        )
    })
}

/// What is remembered of one capture in progress.
struct Captured {
    id: u64,
    /// Recorded (internally) after the capture's last arx launch.
    event: sys::CUevent,
    /// That launch's external record node of `last`.
    record: Option<sys::CUgraphNode>,
}

/// The events that order one instance's launches.
pub(crate) struct Order {
    /// Recorded after every launch (eagerly or as an external graph node).
    last: sys::CUevent,
    /// Per capture id: an event recorded inside that capture after its last
    /// arx launch, and that launch's record node (oldest first; reused
    /// round-robin past `CAPTURES`).
    captures: Vec<Captured>,
    /// Stream of the previous launch, if it was eager.
    prev_eager: Option<sys::CUstream>,
    /// True once any launch was captured: a graph replay may then run
    /// between two eager calls without the host seeing it.
    captured: bool,
    /// False once the events were leaked on purpose (see `leak`).
    owned: bool,
}

// SAFETY: event handles are plain driver handles, usable from any thread
// with the context bound; `Order` is used by one thread at a time.
unsafe impl Send for Order {}

impl Order {
    /// Creates the events (the instance's context must be bound).
    pub(crate) fn new() -> Result<Self> {
        probe()?;
        Ok(Order {
            last: new_event()?,
            captures: Vec::new(),
            prev_eager: None,
            captured: false,
            owned: true,
        })
    }

    /// True once a launch of this instance was captured into a graph.
    pub(crate) fn captured(&self) -> bool {
        self.captured
    }

    /// Makes `stream` wait for the previous launch; returns the capture
    /// state to hand to [`Order::after`].
    pub(crate) fn before(&mut self, stream: sys::CUstream) -> Result<Capture> {
        let cap = capture_of(stream)?;
        match cap {
            Capture::None => {
                // Same stream as the previous eager launch and no graph that
                // could have run in between: stream order is enough.
                if self.captured || self.prev_eager != Some(stream) {
                    // SAFETY: live stream and event of the bound context.
                    cu("cuStreamWaitEvent", unsafe {
                        sys::cuStreamWaitEvent(stream, self.last, 0)
                    })?;
                }
            }
            Capture::Active(id) => {
                if let Some(ev) = self.captures.iter().find(|c| c.id == id).map(|c| c.event) {
                    // SAFETY: as above; an internal wait inside the capture
                    // adds an edge from the capture's previous arx launch
                    // (the frontier the event was recorded at).
                    cu("cuStreamWaitEvent", unsafe {
                        sys::cuStreamWaitEvent(stream, ev, 0)
                    })?;
                } else {
                    let flag = sys::CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL as u32;
                    // SAFETY: as above; captured as an event wait node.
                    cu("cuStreamWaitEvent", unsafe {
                        sys::cuStreamWaitEvent(stream, self.last, flag)
                    })?;
                }
            }
        }
        Ok(cap)
    }

    /// Records the launch just enqueued on `stream` (`cap` from `before`).
    pub(crate) fn after(&mut self, stream: sys::CUstream, cap: Capture) -> Result<()> {
        match cap {
            Capture::None => {
                // SAFETY: live stream and event of the bound context.
                cu("cuEventRecord", unsafe {
                    sys::cuEventRecord(self.last, stream)
                })?;
                self.prev_eager = Some(stream);
            }
            Capture::Active(id) => {
                // The launch's own frontier (its last node), which what
                // follows the call depends on.
                let launch = frontier(stream)?;
                let at = self.capture_at(id)?;
                if let Some(prev) = self.captures[at].record {
                    // The capture's records in launch order: a replay's last
                    // record follows all of its launches.
                    let prev = Frontier {
                        nodes: vec![prev],
                        edges: None,
                    };
                    depend(stream, &prev, false)?;
                }
                let flag = sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32;
                // SAFETY: as above; captured as an event record node.
                cu("cuEventRecordWithFlags", unsafe {
                    sys::cuEventRecordWithFlags(self.last, stream, flag)
                })?;
                let record = frontier(stream)?.nodes.first().copied();
                // Off the path: the stream depends on the launch again.
                depend(stream, &launch, true)?;
                let c = &mut self.captures[at];
                c.record = record;
                // SAFETY: as above; an internal record inside the capture
                // (of the launch, the frontier just set).
                cu("cuEventRecord", unsafe {
                    sys::cuEventRecord(c.event, stream)
                })?;
                self.captured = true;
                self.prev_eager = None;
            }
        }
        Ok(())
    }

    /// The index in `captures` of capture `id`, created or reused.
    fn capture_at(&mut self, id: u64) -> Result<usize> {
        if let Some(i) = self.captures.iter().position(|c| c.id == id) {
            return Ok(i);
        }
        let event = if self.captures.len() < CAPTURES {
            new_event()?
        } else {
            // Reuse the oldest: its capture most likely ended long ago (a
            // record into another capture does not disturb nodes already
            // captured).
            self.captures.remove(0).event
        };
        self.captures.push(Captured {
            id,
            event,
            record: None,
        });
        Ok(self.captures.len() - 1)
    }

    /// Keeps the events alive for good: graphs that hold their nodes may be
    /// replayed after the instance is gone.
    pub(crate) fn leak(&mut self) {
        self.owned = false;
    }
}

impl Drop for Order {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        for ev in std::iter::once(self.last).chain(self.captures.iter().map(|c| c.event)) {
            // SAFETY: created in `new`/`capture_event`, destroyed once here;
            // the owner synchronized before dropping (no work waits on them).
            unsafe {
                let _ = sys::cuEventDestroy_v2(ev);
            }
        }
    }
}
