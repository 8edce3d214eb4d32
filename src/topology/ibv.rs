//! What libibverbs itself lists: the devices sysfs shows are usable only
//! where the user-space provider is installed and `/dev/infiniband` is
//! visible (a container often has the one without the other).

use std::ffi::{c_int, CStr};

use rdma_sys::{ibv_free_device_list, ibv_get_device_list, ibv_get_device_name};

use crate::error::{Error, Result};

/// The names of the RDMA devices libibverbs lists (`ibv_get_device_list`),
/// possibly none; [`Error::Unavailable`] when the call itself fails (no
/// RDMA stack in this kernel, say).
pub fn ibv_devices() -> Result<Vec<String>> {
    let mut n: c_int = 0;
    // SAFETY: plain call; `n` receives the count.
    let raw = unsafe { ibv_get_device_list(&mut n) };
    if raw.is_null() {
        let err = std::io::Error::last_os_error();
        let reason = if err.raw_os_error() == Some(libc::ENOSYS) {
            "this kernel has no RDMA stack (ibv_get_device_list: ENOSYS); load ib_uverbs and \
             the NIC's RDMA driver"
                .to_string()
        } else {
            format!("ibv_get_device_list failed: {err}")
        };
        return Err(Error::Unavailable {
            what: "RDMA (libibverbs)",
            reason,
        });
    }
    let names = (0..n.max(0) as usize)
        .map(|i| {
            // SAFETY: `i` is below the count of a live list; each name is a
            // C string owned by its device, copied before the list is freed.
            unsafe {
                let p = ibv_get_device_name(*raw.add(i));
                if p.is_null() {
                    String::new()
                } else {
                    CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            }
        })
        .collect();
    // SAFETY: the list came from ibv_get_device_list and is freed once.
    unsafe { ibv_free_device_list(raw) };
    Ok(names)
}
