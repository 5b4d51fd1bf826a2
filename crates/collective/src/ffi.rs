//! The one place with `unsafe`: the shim's C functions and two owning
//! handles over its objects. Everything above this module is safe Rust.
//!
//! Contract of every fallible shim call: it returns 0 on success, 1 on
//! failure with `*error` a malloc'd C string (or null when even that
//! allocation failed) that we copy and free with `dflash_c10d_free_error`.
//! The shim catches every C++ exception, so none unwinds into Rust.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A positive timeout in whole milliseconds, as c10d takes it.
pub(crate) fn timeout_millis(timeout: Duration) -> Result<i64, String> {
    let millis = timeout.as_millis();
    if millis == 0 {
        return Err(format!("timeout {timeout:?} is under 1 ms"));
    }
    Ok(i64::try_from(millis).unwrap_or(i64::MAX))
}

/// Opaque `dflash_c10d_store` (a TCPStore server).
#[repr(C)]
struct RawStore {
    _opaque: [u8; 0],
}

/// Opaque `dflash_c10d_group` (a c10d Backend over a PrefixStore).
#[repr(C)]
struct RawGroup {
    _opaque: [u8; 0],
}

extern "C" {
    fn dflash_c10d_free_error(error: *mut c_char);
    fn dflash_c10d_store_host(
        host: *const c_char,
        listen_fd: c_int,
        port: u16,
        timeout_ms: i64,
        out: *mut *mut RawStore,
        out_port: *mut u16,
        error: *mut *mut c_char,
    ) -> c_int;
    fn dflash_c10d_store_free(store: *mut RawStore);
    #[allow(clippy::too_many_arguments)]
    fn dflash_c10d_group_new(
        store_host: *const c_char,
        store_port: u16,
        local_store: *mut RawStore,
        prefix: *const c_char,
        rank: c_int,
        world_size: c_int,
        interface_host: *const c_char,
        timeout_ms: i64,
        backend: c_int,
        out: *mut *mut RawGroup,
        error: *mut *mut c_char,
    ) -> c_int;
    fn dflash_c10d_group_free(group: *mut RawGroup);
    fn dflash_c10d_all_reduce_sum(
        group: *mut RawGroup,
        tensor: *mut c_void,
        error: *mut *mut c_char,
    ) -> c_int;
    fn dflash_c10d_broadcast(
        group: *mut RawGroup,
        tensor: *mut c_void,
        root: c_int,
        error: *mut *mut c_char,
    ) -> c_int;
    fn dflash_c10d_barrier(group: *mut RawGroup, error: *mut *mut c_char) -> c_int;
}

/// Backend codes of the shim (`kBackendGloo`, `kBackendNccl`).
pub(crate) const BACKEND_GLOO: c_int = 0;
pub(crate) const BACKEND_NCCL: c_int = 1;

/// Turns a shim status and its error pointer into a Result, freeing the text.
fn take_status(status: c_int, error: *mut c_char) -> Result<(), String> {
    if status == 0 {
        return Ok(());
    }
    if error.is_null() {
        return Err("c++ error whose text was lost (out of memory)".to_string());
    }
    // SAFETY: a non-null `error` is a NUL-terminated string the shim malloc'd
    // for us; we copy it, then hand it back exactly once.
    let message = unsafe { CStr::from_ptr(error) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: see above; freed once, never read again.
    unsafe { dflash_c10d_free_error(error) };
    Err(message)
}

/// One reference to a c10d TCPStore server; dropping it releases that
/// reference (groups built over the store hold their own).
pub(crate) struct StoreHandle(NonNull<RawStore>);

// SAFETY: TCPStore is thread-safe (its client operations take a lock; the
// server runs on its own thread) and the handle only copies its intrusive
// pointer (an atomic reference count) or releases it.
unsafe impl Send for StoreHandle {}
unsafe impl Sync for StoreHandle {}

impl StoreHandle {
    /// Hosts a TCPStore server on the bound, listening socket `listen_fd`
    /// (bound to `port`), which the store takes over. Returns the port the
    /// store reports.
    pub(crate) fn host(
        host: &CStr,
        listen_fd: RawFd,
        port: u16,
        timeout_ms: i64,
    ) -> Result<(StoreHandle, u16), String> {
        let mut out: *mut RawStore = ptr::null_mut();
        let mut out_port: u16 = 0;
        let mut error: *mut c_char = ptr::null_mut();
        // SAFETY: valid C strings and out-pointers for the call's duration.
        let status = unsafe {
            dflash_c10d_store_host(
                host.as_ptr(),
                listen_fd,
                port,
                timeout_ms,
                &mut out,
                &mut out_port,
                &mut error,
            )
        };
        take_status(status, error)?;
        let store = NonNull::new(out)
            .ok_or_else(|| "the shim reported success but returned no store".to_string())?;
        Ok((StoreHandle(store), out_port))
    }
}

impl Drop for StoreHandle {
    fn drop(&mut self) {
        // SAFETY: we own this reference; released once.
        unsafe { dflash_c10d_store_free(self.0.as_ptr()) };
    }
}

/// Groups handed to a destroying thread and not yet destroyed.
static GROUPS_BEING_DESTROYED: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn groups_being_destroyed() -> usize {
    GROUPS_BEING_DESTROYED.load(Ordering::SeqCst)
}

/// Arguments of [`GroupHandle::new`], as C strings and C integers.
pub(crate) struct RawGroupOptions<'a> {
    pub store_host: &'a CStr,
    pub store_port: u16,
    pub local_store: Option<&'a StoreHandle>,
    pub prefix: &'a CStr,
    pub rank: c_int,
    pub world_size: c_int,
    pub interface_host: &'a CStr,
    pub timeout_ms: i64,
    pub backend: c_int,
}

/// One c10d process group. Dropping it destroys the C++ object on a
/// detached thread: ProcessGroupGloo's destructor joins its worker threads,
/// which a collective stuck on a stopped peer holds until the timeout.
pub(crate) struct GroupHandle(NonNull<RawGroup>);

// SAFETY: the group is used by one thread at a time (`GroupHandle` is not
// Sync and its methods take `&self` of a non-Sync owner); c10d backends may
// be driven from any thread.
unsafe impl Send for GroupHandle {}

impl GroupHandle {
    pub(crate) fn new(options: &RawGroupOptions<'_>) -> Result<GroupHandle, String> {
        let mut out: *mut RawGroup = ptr::null_mut();
        let mut error: *mut c_char = ptr::null_mut();
        let local_store = options
            .local_store
            .map_or(ptr::null_mut(), |store| store.0.as_ptr());
        // SAFETY: valid C strings, a live store (borrowed for the call; the
        // shim takes its own reference) and out-pointers.
        let status = unsafe {
            dflash_c10d_group_new(
                options.store_host.as_ptr(),
                options.store_port,
                local_store,
                options.prefix.as_ptr(),
                options.rank,
                options.world_size,
                options.interface_host.as_ptr(),
                options.timeout_ms,
                options.backend,
                &mut out,
                &mut error,
            )
        };
        take_status(status, error)?;
        let group = NonNull::new(out)
            .ok_or_else(|| "the shim reported success but returned no group".to_string())?;
        Ok(GroupHandle(group))
    }

    /// In place: `tensor` is tch's tensor, borrowed mutably for the call.
    pub(crate) fn all_reduce_sum(&self, tensor: &mut tch::Tensor) -> Result<(), String> {
        let mut error: *mut c_char = ptr::null_mut();
        // SAFETY: a live group and tch's `at::Tensor*`, exclusively borrowed.
        let status = unsafe {
            dflash_c10d_all_reduce_sum(
                self.0.as_ptr(),
                tensor.as_mut_ptr().cast::<c_void>(),
                &mut error,
            )
        };
        take_status(status, error)
    }

    pub(crate) fn broadcast(&self, tensor: &mut tch::Tensor, root: c_int) -> Result<(), String> {
        let mut error: *mut c_char = ptr::null_mut();
        // SAFETY: as in all_reduce_sum.
        let status = unsafe {
            dflash_c10d_broadcast(
                self.0.as_ptr(),
                tensor.as_mut_ptr().cast::<c_void>(),
                root,
                &mut error,
            )
        };
        take_status(status, error)
    }

    pub(crate) fn barrier(&self) -> Result<(), String> {
        let mut error: *mut c_char = ptr::null_mut();
        // SAFETY: a live group.
        let status = unsafe { dflash_c10d_barrier(self.0.as_ptr(), &mut error) };
        take_status(status, error)
    }
}

/// The raw pointer moved to the destroying thread.
struct GroupToDestroy(NonNull<RawGroup>);

// SAFETY: ownership moves to exactly one thread, which destroys it.
unsafe impl Send for GroupToDestroy {}

impl GroupToDestroy {
    fn destroy(self) {
        // SAFETY: we own the group; destroyed once.
        unsafe { dflash_c10d_group_free(self.0.as_ptr()) };
        GROUPS_BEING_DESTROYED.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for GroupHandle {
    fn drop(&mut self) {
        GROUPS_BEING_DESTROYED.fetch_add(1, Ordering::SeqCst);
        let group = GroupToDestroy(self.0);
        let spawned = std::thread::Builder::new()
            .name("c10d-group-drop".to_string())
            .spawn(move || group.destroy());
        if spawned.is_err() {
            // No thread to be had: leak the group rather than block the
            // caller for the timeout (its threads end at their timeout).
            GROUPS_BEING_DESTROYED.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod timeout_tests {
    use super::*;

    #[test]
    fn timeouts_under_a_millisecond_are_refused() {
        assert!(timeout_millis(Duration::from_micros(999)).is_err());
        assert_eq!(timeout_millis(Duration::from_secs(3)), Ok(3000));
        assert_eq!(timeout_millis(Duration::MAX), Ok(i64::MAX));
    }
}
