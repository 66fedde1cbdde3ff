//! CUDA for the native engines: whether its libraries load, the engines' kernels compiled by
//! NVRTC, and a device opened the way both engines run on it.
//!
//! cudarc loads the driver, NVRTC and cuBLAS at run time, so everything here builds without
//! CUDA and answers [`SetupError::NoDriver`] (or the library missing) where there is none.
//! Kernels compile with NVRTC alone, so a machine without a GPU can check them.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;

/// Why a device could not be opened, the kernels compiled, or a driver or cuBLAS call made.
/// Each engine's error wraps it as it is (`CudaError::Setup`), so its message is unchanged.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The NVIDIA driver library (libcuda) is not installed.
    #[error("no CUDA driver: libcuda could not be loaded (no NVIDIA GPU or driver on this machine)")]
    NoDriver,
    /// NVRTC (libnvrtc) is not installed.
    #[error("no NVRTC: libnvrtc could not be loaded (install the CUDA runtime compiler)")]
    NoNvrtc,
    /// cuBLAS (libcublas) is not installed.
    #[error("no cuBLAS: libcublas could not be loaded (install the CUDA toolkit's cuBLAS)")]
    NoCublas,
    /// No device with that ordinal.
    #[error("CUDA device {ordinal} does not exist ({count} device(s) found)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// NVRTC rejected the kernels.
    #[error("NVRTC could not compile the kernels: {0}")]
    Compile(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(String),
}

/// A driver error as a [`SetupError::Driver`].
pub fn driver(err: cudarc::driver::DriverError) -> SetupError {
    SetupError::Driver(err.to_string())
}

/// Whether NVRTC can be loaded on this machine (no GPU needed).
pub fn nvrtc_present() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether the CUDA driver can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether cuBLAS can be loaded on this machine.
pub fn cublas_present() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// Compiles `source` (named `name` in the compiler's messages) to PTX. Needs NVRTC only, not a
/// GPU, so CPU machines can check the kernels.
///
/// # Errors
///
/// [`SetupError::NoNvrtc`] without NVRTC, [`SetupError::Compile`] with the compiler's log.
pub fn compile(source: &str, name: &str) -> Result<Ptx, SetupError> {
    if !nvrtc_present() {
        return Err(SetupError::NoNvrtc);
    }
    cudarc::nvrtc::compile_ptx_with_opts(
        source,
        cudarc::nvrtc::CompileOptions {
            name: Some(name.into()),
            ..Default::default()
        },
    )
    .map_err(|err| SetupError::Compile(err.to_string()))
}

/// Checks that the driver and cuBLAS load and that device `ordinal` exists.
///
/// # Errors
///
/// [`SetupError::NoDriver`], [`SetupError::NoCublas`] or [`SetupError::NoDevice`] as the case
/// is; [`SetupError::Driver`] when the driver cannot count its devices.
pub fn check_device(ordinal: usize) -> Result<(), SetupError> {
    if !driver_present() {
        return Err(SetupError::NoDriver);
    }
    if !cublas_present() {
        return Err(SetupError::NoCublas);
    }
    let count = CudaContext::device_count().map_err(driver)?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(SetupError::NoDevice { ordinal, count });
    }
    Ok(())
}

/// A device as an engine runs on it: one stream for everything, the engine's kernels loaded,
/// and a cuBLAS handle on that stream with a workspace of its own.
#[derive(Debug)]
pub struct Device {
    /// The stream every copy, kernel and cuBLAS call goes to.
    pub stream: Arc<CudaStream>,
    /// The engine's kernels.
    pub module: Arc<CudaModule>,
    /// cuBLAS, on [`Device::stream`].
    pub blas: CudaBlas,
    /// cuBLAS's workspace, the engine's so that cuBLAS never allocates (a graph capture would
    /// not allow it); it must live as long as [`Device::blas`].
    pub workspace: CudaSlice<u8>,
}

/// Opens device `ordinal` (checked with [`check_device`] first) with `ptx` loaded and a cuBLAS
/// workspace of `workspace_bytes`.
///
/// # Errors
///
/// As [`check_device`]; [`SetupError::Driver`] or [`SetupError::Blas`] when a call fails.
pub fn open(ordinal: usize, ptx: Ptx, workspace_bytes: usize) -> Result<Device, SetupError> {
    let context = CudaContext::new(ordinal).map_err(driver)?;
    // One stream does everything, so cudarc's cross-stream event tracking is not needed (and
    // its event records would not belong in a captured graph).
    // SAFETY: the engines share no slice between streams.
    unsafe { context.disable_event_tracking() };
    // A stream of its own: graph capture cannot use the legacy default stream.
    let stream = context.new_stream().map_err(driver)?;
    let module = context.load_module(ptx).map_err(driver)?;
    let blas = CudaBlas::new(stream.clone()).map_err(|err| SetupError::Blas(err.to_string()))?;
    let workspace = stream.alloc_zeros::<u8>(workspace_bytes).map_err(driver)?;
    {
        use cudarc::driver::DevicePtr;
        let (pointer, _synced) = workspace.device_ptr(&stream);
        // SAFETY: the workspace is device memory of `workspace_bytes` that lives as long as the
        // handle (both are fields of `Device`, and the engines keep them together), used only
        // on this stream.
        let status = unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                pointer as *mut std::ffi::c_void,
                workspace_bytes,
            )
        };
        if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(SetupError::Blas(format!("cublasSetWorkspace: {status:?}")));
        }
    }
    Ok(Device {
        stream,
        module,
        blas,
        workspace,
    })
}
