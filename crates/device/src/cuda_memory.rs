//! GPU memory of a CUDA service: which allocator libtorch uses there, and
//! how much device memory the process's GPU holds at its peak.
//!
//! libtorch's CUDA caching allocator keeps freed blocks for reuse, so a
//! training step that allocates the same tensors every time does not call
//! `cudaMalloc`/`cudaFree` on each (the GPU side of the page faults that
//! [`crate::alloc`] removes on the CPU). It is on unless the environment
//! turns it off: [`CudaAllocatorSettings::from_environment`] reads the same
//! variables libtorch reads (`PYTORCH_NO_CUDA_MEMORY_CACHING`,
//! `PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF`) so a service can say at
//! start which allocator is in force and warn when caching is off.
//!
//! tch exposes none of the caching allocator's statistics, so the peak is
//! read from the driver instead: [`DeviceMemoryProbe`] opens NVML
//! (`libnvidia-ml.so.1`, shipped with every NVIDIA driver) at run time, with
//! no build-time CUDA dependency, and reads the device's used memory. With
//! the caching allocator that figure is what the allocator has reserved plus
//! the CUDA context (a few hundred MiB), for every process on that GPU: in a
//! pod that owns its GPU, this process's. [`PeakTracker`] keeps the maximum
//! of the readings a service takes after each step. On a host without the
//! driver the probe fails to open with the reason, and nothing is reported.

use std::sync::atomic::{AtomicU64, Ordering};

/// Which CUDA allocator libtorch will use, read from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaAllocatorSettings {
    /// False when `PYTORCH_NO_CUDA_MEMORY_CACHING` turns caching off: every
    /// tensor is then a `cudaMalloc` and every free a `cudaFree`.
    pub caching: bool,
    /// `native` (libtorch's caching allocator) or `cudaMallocAsync` (CUDA's
    /// stream-ordered pool, also caching), from the allocator configuration.
    pub backend: String,
    /// The allocator configuration string as set, if any.
    pub configuration: Option<String>,
}

impl CudaAllocatorSettings {
    /// Reads the settings from this process's environment.
    pub fn from_environment() -> CudaAllocatorSettings {
        CudaAllocatorSettings::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the settings through `lookup` (a variable's value, or `None`
    /// when unset), so tests need no process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> CudaAllocatorSettings {
        // libtorch treats the variable as a switch: any value but an
        // explicit off turns caching off.
        let caching = match lookup("PYTORCH_NO_CUDA_MEMORY_CACHING") {
            None => true,
            Some(value) => matches!(value.trim(), "" | "0" | "false" | "False" | "FALSE"),
        };
        let configuration = lookup("PYTORCH_CUDA_ALLOC_CONF")
            .or_else(|| lookup("PYTORCH_ALLOC_CONF"))
            .filter(|value| !value.trim().is_empty());
        let backend = configuration
            .as_deref()
            .and_then(|configuration| {
                configuration.split(',').find_map(|option| {
                    let (key, value) = option.split_once(':')?;
                    (key.trim() == "backend").then(|| value.trim().to_string())
                })
            })
            .unwrap_or_else(|| "native".to_string());
        CudaAllocatorSettings {
            caching,
            backend,
            configuration,
        }
    }

    /// The warning a service logs at start, when there is one to give.
    pub fn warning(&self) -> Option<String> {
        (!self.caching).then(|| {
            "PYTORCH_NO_CUDA_MEMORY_CACHING is set: libtorch's CUDA caching allocator is off, \
             so every tensor of every step is a cudaMalloc and a cudaFree"
                .to_string()
        })
    }
}

impl std::fmt::Display for CudaAllocatorSettings {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "cuda allocator: {}, caching {}",
            self.backend,
            if self.caching { "on" } else { "off" }
        )?;
        if let Some(configuration) = &self.configuration {
            write!(formatter, " ({configuration})")?;
        }
        Ok(())
    }
}

/// How a CUDA device index of this process names a GPU for NVML, which
/// ignores `CUDA_VISIBLE_DEVICES` and counts every GPU of the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NvmlDeviceName {
    /// NVML's own index.
    Index(u32),
    /// A `GPU-…` or `MIG-…` UUID.
    Uuid(String),
}

/// Maps CUDA device `cuda_index` through `CUDA_VISIBLE_DEVICES` (`None`:
/// unset, every GPU visible in NVML's order), or says why it cannot.
pub fn nvml_device_name(
    cuda_index: usize,
    visible_devices: Option<&str>,
) -> Result<NvmlDeviceName, String> {
    let Some(visible) = visible_devices.map(str::trim) else {
        return u32::try_from(cuda_index)
            .map(NvmlDeviceName::Index)
            .map_err(|_| format!("cuda:{cuda_index}: index out of range"));
    };
    let entry = visible
        .split(',')
        .map(str::trim)
        .nth(cuda_index)
        .filter(|entry| !entry.is_empty())
        .ok_or_else(|| {
            format!("cuda:{cuda_index}: CUDA_VISIBLE_DEVICES={visible:?} has no entry {cuda_index}")
        })?;
    if entry.starts_with("GPU-") || entry.starts_with("MIG-") {
        return Ok(NvmlDeviceName::Uuid(entry.to_string()));
    }
    entry
        .parse()
        .map(NvmlDeviceName::Index)
        .map_err(|_| format!("cuda:{cuda_index}: CUDA_VISIBLE_DEVICES entry {entry:?} is neither an index nor a UUID"))
}

/// The maximum of a series of memory readings; shared between the place
/// that reads and the places that report.
#[derive(Debug, Default)]
pub struct PeakTracker {
    peak_bytes: AtomicU64,
}

impl PeakTracker {
    /// Records one reading; returns the peak so far.
    pub fn record(&self, bytes: u64) -> u64 {
        self.peak_bytes
            .fetch_max(bytes, Ordering::Relaxed)
            .max(bytes)
    }

    /// The peak so far (0 before the first reading).
    pub fn peak_bytes(&self) -> u64 {
        self.peak_bytes.load(Ordering::Relaxed)
    }
}

/// One GPU's memory as NVML reports it (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub total_bytes: u64,
    pub used_bytes: u64,
}

/// Reads one GPU's memory through NVML, loaded at run time.
#[derive(Debug)]
pub struct DeviceMemoryProbe {
    library: nvml::Library,
    device: nvml::DeviceHandle,
}

impl DeviceMemoryProbe {
    /// Opens NVML and the GPU that is CUDA device `cuda_index` of this
    /// process. Fails with the reason (no driver library, NVML refused, no
    /// such GPU) on a host without one.
    pub fn open(cuda_index: usize) -> Result<DeviceMemoryProbe, String> {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let name = nvml_device_name(cuda_index, visible.as_deref())?;
        let library = nvml::Library::open()?;
        let device = library.device(&name)?;
        Ok(DeviceMemoryProbe { library, device })
    }

    /// The GPU's total and used memory now.
    pub fn read(&self) -> Result<DeviceMemory, String> {
        self.library.memory(self.device)
    }
}

/// One reading of [`GpuMemoryMonitor::sample`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuMemoryReading {
    pub used_bytes: u64,
    pub peak_bytes: u64,
}

/// What a CUDA service keeps for its GPU: the probe and the peak of its
/// readings. [`GpuMemoryMonitor::start`] logs the allocator settings once;
/// [`GpuMemoryMonitor::sample`] is called after each step or batch.
#[derive(Debug)]
pub struct GpuMemoryMonitor {
    probe: DeviceMemoryProbe,
    peak: PeakTracker,
    /// Set after the first failed reading, so a broken driver logs once.
    read_failed: std::sync::atomic::AtomicBool,
}

impl GpuMemoryMonitor {
    /// Logs which CUDA allocator libtorch will use (a warning when caching
    /// is off) and opens the probe for CUDA device `cuda_index`; `None`,
    /// with the reason logged, where NVML cannot be opened.
    pub fn start(cuda_index: usize) -> Option<GpuMemoryMonitor> {
        let settings = CudaAllocatorSettings::from_environment();
        match settings.warning() {
            Some(warning) => tracing::warn!(%settings, "{warning}"),
            None => tracing::info!(%settings, "cuda allocator"),
        }
        match DeviceMemoryProbe::open(cuda_index) {
            Ok(probe) => Some(GpuMemoryMonitor {
                probe,
                peak: PeakTracker::default(),
                read_failed: std::sync::atomic::AtomicBool::new(false),
            }),
            Err(reason) => {
                tracing::warn!(cuda_index, %reason, "no GPU memory readings: NVML unavailable");
                None
            }
        }
    }

    /// Reads the GPU's memory now and records it in the peak: the used
    /// bytes now and the peak so far, for a service's two gauges.
    pub fn sample(&self) -> Option<GpuMemoryReading> {
        match self.probe.read() {
            Ok(memory) => Some(GpuMemoryReading {
                used_bytes: memory.used_bytes,
                peak_bytes: self.peak.record(memory.used_bytes),
            }),
            Err(reason) => {
                if !self.read_failed.swap(true, Ordering::Relaxed) {
                    tracing::warn!(%reason, "GPU memory reading failed");
                }
                None
            }
        }
    }

    /// The largest used-memory reading so far, in bytes.
    pub fn peak_bytes(&self) -> u64 {
        self.peak.peak_bytes()
    }
}

/// The few NVML entry points the probe needs, resolved with `dlopen`.
#[allow(unsafe_code)]
mod nvml {
    use super::{DeviceMemory, NvmlDeviceName};
    use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

    /// `nvmlReturn_t` success.
    const NVML_SUCCESS: c_int = 0;

    /// `nvmlMemory_t`.
    #[repr(C)]
    #[derive(Default)]
    struct NvmlMemory {
        total: u64,
        free: u64,
        used: u64,
    }

    type Init = unsafe extern "C" fn() -> c_int;
    type ByIndex = unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_int;
    type ByUuid = unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> c_int;
    type MemoryInfo = unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_int;
    type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

    /// An `nvmlDevice_t`: an opaque handle NVML keeps valid until shutdown,
    /// which this process never calls (the library stays loaded).
    #[derive(Debug, Clone, Copy)]
    pub struct DeviceHandle(*mut c_void);

    // SAFETY: NVML handles may be used from any thread (NVML is
    // thread-safe by its documentation); the handle is only passed back.
    unsafe impl Send for DeviceHandle {}
    unsafe impl Sync for DeviceHandle {}

    #[derive(Debug)]
    pub struct Library {
        by_index: ByIndex,
        by_uuid: ByUuid,
        memory_info: MemoryInfo,
        error_string: ErrorString,
    }

    impl Library {
        pub fn open() -> Result<Library, String> {
            // SAFETY: dlopen with a constant, NUL-terminated name; the
            // handle is never closed, so the symbols below stay valid for
            // the process's lifetime.
            let handle = unsafe {
                libc::dlopen(
                    c"libnvidia-ml.so.1".as_ptr(),
                    libc::RTLD_NOW | libc::RTLD_LOCAL,
                )
            };
            if handle.is_null() {
                return Err("libnvidia-ml.so.1 (the NVIDIA driver's NVML) not found".to_string());
            }
            let symbol = |name: &CStr| {
                // SAFETY: dlsym on a live handle with a NUL-terminated name.
                let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
                if address.is_null() {
                    Err(format!("NVML has no {}", name.to_string_lossy()))
                } else {
                    Ok(address)
                }
            };
            // SAFETY: each symbol is NVML's C function of that name, whose
            // signature (nvml.h) is the one it is cast to.
            let library = unsafe {
                let init: Init = std::mem::transmute::<*mut c_void, Init>(symbol(c"nvmlInit_v2")?);
                let library = Library {
                    by_index: std::mem::transmute::<*mut c_void, ByIndex>(symbol(
                        c"nvmlDeviceGetHandleByIndex_v2",
                    )?),
                    by_uuid: std::mem::transmute::<*mut c_void, ByUuid>(symbol(
                        c"nvmlDeviceGetHandleByUUID",
                    )?),
                    memory_info: std::mem::transmute::<*mut c_void, MemoryInfo>(symbol(
                        c"nvmlDeviceGetMemoryInfo",
                    )?),
                    error_string: std::mem::transmute::<*mut c_void, ErrorString>(symbol(
                        c"nvmlErrorString",
                    )?),
                };
                let status = init();
                if status != NVML_SUCCESS {
                    return Err(format!("nvmlInit: {}", library.describe(status)));
                }
                library
            };
            Ok(library)
        }

        pub fn device(&self, name: &NvmlDeviceName) -> Result<DeviceHandle, String> {
            let mut handle: *mut c_void = std::ptr::null_mut();
            // SAFETY: NVML writes one handle through the out pointer; the
            // UUID is a NUL-terminated copy that outlives the call.
            let status = unsafe {
                match name {
                    NvmlDeviceName::Index(index) => (self.by_index)(*index, &mut handle),
                    NvmlDeviceName::Uuid(uuid) => {
                        let uuid = CString::new(uuid.as_str())
                            .map_err(|_| format!("GPU UUID {uuid:?} has a NUL byte"))?;
                        (self.by_uuid)(uuid.as_ptr(), &mut handle)
                    }
                }
            };
            if status != NVML_SUCCESS {
                return Err(format!("NVML device {name:?}: {}", self.describe(status)));
            }
            Ok(DeviceHandle(handle))
        }

        pub fn memory(&self, device: DeviceHandle) -> Result<DeviceMemory, String> {
            let mut memory = NvmlMemory::default();
            // SAFETY: a handle NVML gave out, and a struct of nvml.h's
            // layout for it to fill.
            let status = unsafe { (self.memory_info)(device.0, &mut memory) };
            if status != NVML_SUCCESS {
                return Err(format!(
                    "nvmlDeviceGetMemoryInfo: {}",
                    self.describe(status)
                ));
            }
            Ok(DeviceMemory {
                total_bytes: memory.total,
                used_bytes: memory.used,
            })
        }

        fn describe(&self, status: c_int) -> String {
            // SAFETY: nvmlErrorString returns a static NUL-terminated string
            // (or null for an unknown code).
            let text = unsafe { (self.error_string)(status) };
            if text.is_null() {
                format!("error {status}")
            } else {
                // SAFETY: non-null and NUL-terminated, per NVML.
                let text = unsafe { CStr::from_ptr(text) };
                format!("{} (error {status})", text.to_string_lossy())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(variables: &[(&str, &str)]) -> CudaAllocatorSettings {
        let variables: HashMap<String, String> = variables
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect();
        CudaAllocatorSettings::from_lookup(|name| variables.get(name).cloned())
    }

    #[test]
    fn caching_is_on_unless_the_environment_turns_it_off() {
        let default = settings(&[]);
        assert!(default.caching);
        assert_eq!(default.backend, "native");
        assert_eq!(default.warning(), None);
        assert!(settings(&[("PYTORCH_NO_CUDA_MEMORY_CACHING", "0")]).caching);
        let off = settings(&[("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")]);
        assert!(!off.caching);
        assert!(off
            .warning()
            .unwrap()
            .contains("PYTORCH_NO_CUDA_MEMORY_CACHING"));
        assert!(off.to_string().contains("caching off"), "{off}");
    }

    #[test]
    fn the_backend_comes_from_either_configuration_variable() {
        let asynchronous = settings(&[(
            "PYTORCH_CUDA_ALLOC_CONF",
            "expandable_segments:True, backend:cudaMallocAsync",
        )]);
        assert_eq!(asynchronous.backend, "cudaMallocAsync");
        assert!(asynchronous.caching);
        assert!(
            asynchronous.to_string().contains("expandable_segments"),
            "{asynchronous}"
        );
        let newer_name = settings(&[("PYTORCH_ALLOC_CONF", "backend:native")]);
        assert_eq!(newer_name.backend, "native");
        assert_eq!(newer_name.configuration.as_deref(), Some("backend:native"));
    }

    #[test]
    fn cuda_indices_map_through_visible_devices() {
        assert_eq!(nvml_device_name(1, None), Ok(NvmlDeviceName::Index(1)));
        assert_eq!(
            nvml_device_name(0, Some("3,5")),
            Ok(NvmlDeviceName::Index(3))
        );
        assert_eq!(
            nvml_device_name(1, Some("3, 5")),
            Ok(NvmlDeviceName::Index(5))
        );
        assert_eq!(
            nvml_device_name(0, Some("GPU-8f1e0c2a-1111")),
            Ok(NvmlDeviceName::Uuid("GPU-8f1e0c2a-1111".to_string()))
        );
        let missing = nvml_device_name(2, Some("3,5")).unwrap_err();
        assert!(missing.contains("no entry 2"), "{missing}");
        let garbage = nvml_device_name(0, Some("first")).unwrap_err();
        assert!(garbage.contains("\"first\""), "{garbage}");
    }

    #[test]
    fn the_peak_is_the_largest_reading() {
        let tracker = PeakTracker::default();
        assert_eq!(tracker.peak_bytes(), 0);
        assert_eq!(tracker.record(5), 5);
        assert_eq!(tracker.record(3), 5);
        assert_eq!(tracker.record(9), 9);
        assert_eq!(tracker.peak_bytes(), 9);
    }

    #[test]
    fn a_host_without_the_driver_gets_a_reason_not_a_panic() {
        // This machine's CI has no NVIDIA driver; on one that has it the
        // probe opens and reads a total above zero.
        match DeviceMemoryProbe::open(0) {
            Ok(probe) => {
                let memory = probe.read().unwrap();
                assert!(memory.total_bytes > 0 && memory.used_bytes <= memory.total_bytes);
            }
            Err(reason) => assert!(!reason.is_empty()),
        }
    }
}
